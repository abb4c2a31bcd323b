"""A real SkyRL Tinker service for tests: PyPI ``skyrl==0.4.0``, JAX backend on CPU, a tiny local Qwen3, SQLite.

``SkyRLService`` starts the API (which spawns its engine) from its own venv (``scripts/install_skyrl_service.sh``,
cached in ``.venv-skyrl-service/``) through ``shims.py``, bound to 127.0.0.1 on a free port, with its database,
checkpoints and log in a temporary directory. Every wait has a timeout and ``stop`` always tears the whole process
group down (API and engine), also when start-up fails.

``pause``/``resume`` stop and continue the engine process (SIGSTOP/SIGCONT): requests submitted while it is paused
become pending rows of the futures table that its next iteration sees all at once, which makes a mix's batching
independent of submission timing (see test_conformance.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from skyrl_sim_plugins.megatron_vllm.local_ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVICE_VENV = Path(os.environ.get("SKYRL_SERVICE_VENV", ROOT / ".venv-skyrl-service"))
INSTALL_SCRIPT = ROOT / "scripts" / "install_skyrl_service.sh"
SHIMS = Path(__file__).resolve().parent / "shims.py"

# The tiny model: the `tiny-dense` preset's dimensions (head_dim 32; synthetic token ids stay below the vocabulary).
TINY_VOCAB = 512
TINY_QWEN3: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
START_TIMEOUT_S = 300.0
CLOCK_NANOSLEEP = "230"  # x86_64 syscall number of clock_nanosleep (time.sleep)
STOP_TIMEOUT_S = 15.0


def install_service_venv(timeout_s: float = 900.0) -> Path:
    """Run the install script (a no-op when the venv is ready); returns the venv's python."""
    subprocess.run(["bash", str(INSTALL_SCRIPT), str(SERVICE_VENV)], check=True, timeout=timeout_s)
    return SERVICE_VENV / "bin" / "python"


def make_tiny_qwen3(directory: Path) -> Path:
    """A randomly initialised tiny Qwen3 and a word-level tokenizer, saved the way the HF hub would serve them."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3))
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(TINY_VOCAB - 2)}
    vocab["<|endoftext|>"] = TINY_VOCAB - 2
    vocab["<unk>"] = TINY_VOCAB - 1
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)
    return directory


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, even by a signal no ``finally`` sees
    (prctl PR_SET_PDEATHSIG; the API then shuts its engine down)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class ServiceError(RuntimeError):
    """The service did not start or stopped unexpectedly; the message carries the log's tail."""


class SkyRLService:
    """One running service. Use as a context manager; ``base_url`` and ``log_path`` are what a backend needs."""

    def __init__(
        self,
        model_dir: Path,
        workdir: Path | None = None,
        sample_max_num_sequences: int = 4,
        python: Path | None = None,
    ) -> None:
        self.model_dir = model_dir
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="skyrl-service-")
        self.workdir = workdir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.python = python or SERVICE_VENV / "bin" / "python"
        self.sample_max_num_sequences = sample_max_num_sequences
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "service.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.engine_pid: int | None = None

    def command(self) -> list[str]:
        backend_config = {
            "sample_max_num_sequences": self.sample_max_num_sequences,
            "max_lora_adapters": 8,
            "max_lora_rank": 8,
        }
        return [
            str(self.python),
            str(SHIMS),
            "api",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-model",
            str(self.model_dir),
            "--backend",
            "jax",
            "--backend-config",
            json.dumps(backend_config),
            "--database-url",
            f"sqlite:///{self.workdir / 'tinker.db'}",
            "--checkpoints-base",
            str(self.workdir / "checkpoints"),
        ]

    def start(self) -> SkyRLService:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "COLUMNS": "1000",  # SkyRL logs through rich: keep each record on one line
            "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        }
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.workdir,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        try:
            self._wait_ready(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _wait_ready(self, timeout_s: float) -> None:
        """The API answers /healthz and the engine has entered its loop."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ServiceError(f"SkyRL service exited with {self.process.returncode} while starting:\n{self._tail()}")
            text = self.log_text()
            if self.engine_pid is None and (m := re.search(r"Started background engine with PID (\d+)", text)):
                self.engine_pid = int(m.group(1))
            if "Starting background engine" in text and self._healthy():
                return
            time.sleep(0.25)
        raise ServiceError(f"SkyRL service not ready after {timeout_s:.0f} s:\n{self._tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/api/v1/healthz", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def pause(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process between two iterations: submissions then queue up as pending rows.

        The engine is stopped only while its main thread sits in the loop's 100 ms sleep (syscall clock_nanosleep):
        stopped in the middle of its queries, its next iteration could act on a half-old snapshot.
        """
        assert self.engine_pid is not None, "engine pid unknown"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            os.kill(self.engine_pid, signal.SIGSTOP)
            time.sleep(0.002)
            syscall = Path(f"/proc/{self.engine_pid}/syscall").read_text().split()
            if syscall and syscall[0] == CLOCK_NANOSLEEP:
                return
            os.kill(self.engine_pid, signal.SIGCONT)
            time.sleep(0.01)
        raise ServiceError(f"engine never idle within {timeout_s:.0f} s; cannot pause it between iterations")

    def resume(self) -> None:
        assert self.engine_pid is not None, "engine pid unknown"
        os.kill(self.engine_pid, signal.SIGCONT)

    def stop(self) -> None:
        """Terminate the API and its engine (one process group); SIGKILL after a timeout. Safe to call twice."""
        if self.process is None:
            return
        if self.engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine_pid, signal.SIGCONT)  # a paused engine cannot act on SIGTERM
        for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if self.engine_pid is not None:  # the engine may have left the group; make sure it is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine_pid, signal.SIGKILL)
        self.process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def gate(self) -> EngineGate:
        """A ``Gate`` for the tinker backend: the engine is paused while clients submit."""
        return EngineGate(self)

    def __enter__(self) -> SkyRLService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EngineGate:
    """``hold`` pauses the service's engine between iterations, ``release`` resumes it (see TinkerBackend's gate)."""

    def __init__(self, service: SkyRLService) -> None:
        self.service = service

    def hold(self) -> None:
        self.service.pause()

    def release(self) -> None:
        self.service.resume()

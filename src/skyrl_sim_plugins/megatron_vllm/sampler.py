"""The real backend's sampler: vLLM serving the latest saved checkpoint, driven through the generation client.

``VllmSampler`` is what the backend calls for a ``sample`` request (contract with the training side):
``sample(checkpoint_dir, prompts, max_tokens, num_samples, seed, temperature)`` returns, per prompt and per sample, the
generated token ids. It serves ``checkpoint_dir`` (a Hugging Face ``LlamaForCausalLM`` directory with LoRA merged,
written by ``save_weights_for_sampler``) with a vLLM server on 127.0.0.1, restarting that server whenever the checkpoint
differs from the one being served, by path or by content (a checkpoint saved again under the same name has new files).
A restart is the simplest way to load new weights that works in every vLLM build; it costs one server start.

Samples are exactly ``max_tokens`` long (``ignore_eos``): scenario token counts are lengths to reproduce, and the
random end-of-sequence token of an untrained model would otherwise cut them short at random. Greedy sampling
(temperature 0) is deterministic (several greedy samples are decoded as top-k 1, since vLLM refuses ``n > 1`` when
greedy); with a temperature, prompt ``i`` of a call draws with ``seed + i``, so one call is reproducible and equal
prompts in it still differ.

The server is always stopped: by ``close()``, by leaving the ``with`` block (also on an exception) and, failing those,
at interpreter exit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

from skyrl_sim_plugins.megatron_vllm.generation_client import GenerationClient, GenerationUnavailable, RetryPolicy
from skyrl_sim_plugins.megatron_vllm.vllm_server import SERVED_MODEL_NAME, VllmServer, log_tail

Fingerprint = tuple[str, tuple[tuple[str, int, int], ...]]


class SamplerError(RuntimeError):
    """The sampler cannot serve a checkpoint or its server stopped answering; the message says which and why."""


def checkpoint_fingerprint(checkpoint_dir: Path) -> Fingerprint:
    """The resolved path plus name, size and mtime of every config and weight file: changes when the weights do."""
    path = checkpoint_dir.resolve()
    if not path.is_dir():
        raise SamplerError(f"checkpoint directory {checkpoint_dir} does not exist")
    if not (path / "config.json").is_file():
        raise SamplerError(f"checkpoint directory {checkpoint_dir} has no config.json")
    files = sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in (".json", ".safetensors", ".bin")))
    if not any(p.suffix in (".safetensors", ".bin") for p in files):
        raise SamplerError(f"checkpoint directory {checkpoint_dir} has no weights (*.safetensors)")
    stats = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return str(path), stats


def _vocab_size(checkpoint_dir: Path) -> int | None:
    try:
        config: Any = orjson.loads((checkpoint_dir / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise SamplerError(f"cannot read {checkpoint_dir / 'config.json'}: {exc}") from None
    text = config.get("text_config", config) if isinstance(config, dict) else {}
    value = text.get("vocab_size") if isinstance(text, dict) else None
    return int(value) if isinstance(value, int) else None


class VllmSampler:
    """Samples token ids from a checkpoint through a vLLM server it starts, restarts and stops itself."""

    def __init__(
        self,
        work_dir: Path,
        startup_timeout_s: float = 180,
        *,
        policy: RetryPolicy | None = None,
        ignore_eos: bool = True,
        server_args: tuple[str, ...] = (),
        server_env: dict[str, str | None] | None = None,
        max_concurrency: int = 16,
    ) -> None:
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.work_dir = Path(work_dir)
        self.startup_timeout_s = startup_timeout_s
        self.policy = policy or RetryPolicy()
        self.ignore_eos = ignore_eos
        self.server_args = server_args
        self.server_env = server_env
        self.max_concurrency = max_concurrency
        self.server: VllmServer | None = None
        self.client: GenerationClient | None = None
        self.served: Fingerprint | None = None
        self.start_seconds: list[float] = []  # one entry per server start, in order
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> VllmSampler:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ contract

    def sample(
        self,
        checkpoint_dir: Path,
        prompts: list[list[int]],
        max_tokens: int,
        num_samples: int,
        seed: int,
        temperature: float = 0.0,
    ) -> list[list[list[int]]]:
        """Per prompt, per sample, the generated token ids (each exactly ``max_tokens`` long)."""
        checkpoint_dir = Path(checkpoint_dir)
        if not prompts:
            return []
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        checkpoint_fingerprint(checkpoint_dir)  # a clear error for an unusable checkpoint, before anything starts
        vocab = _vocab_size(checkpoint_dir)
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            if vocab is not None and not all(0 <= int(t) < vocab for t in prompt):
                bad = next(int(t) for t in prompt if not 0 <= int(t) < vocab)
                raise ValueError(f"prompt {index} holds token id {bad}, outside the checkpoint's vocabulary of {vocab}")
        with self._lock:
            client = self._serve(checkpoint_dir)
            try:
                generations = client.generate_batch(
                    prompts, max_tokens, n=num_samples, temperature=temperature, seed=seed, ignore_eos=self.ignore_eos
                )
            except GenerationUnavailable as exc:
                server = self.server
                if server is not None and server.process is not None and not server.process.alive():
                    log = server.process.log_path
                    self._stop()
                    raise SamplerError(f"the vLLM server died while sampling ({exc}); log {log}:\n{log_tail(log)}") from exc
                raise
        return [[sample.token_ids for sample in generation.samples] for generation in generations]

    def client_for(self, checkpoint_dir: Path) -> GenerationClient:
        """The generation client of a healthy server for ``checkpoint_dir``, (re)starting the server when it serves
        another checkpoint (the caller has nothing in flight then: a restart drops what the old server was doing)."""
        checkpoint_dir = Path(checkpoint_dir)
        checkpoint_fingerprint(checkpoint_dir)
        with self._lock:
            return self._serve(checkpoint_dir)

    def metrics_text(self) -> str:
        """The server's ``/metrics`` (Prometheus text); ``OSError`` when no server answers."""
        client = self.client
        if client is None:
            raise OSError("no vLLM server is running")
        status, body = client.get("/metrics", timeout_s=5.0)
        if status != 200:
            raise OSError(f"GET /metrics answered {status}")
        return body.decode(errors="replace")

    def close(self) -> None:
        """Stop the server (the whole process group). Idempotent; a later ``sample`` starts a new one."""
        with self._lock:
            self._stop()

    # ------------------------------------------------------------------ introspection (tests, logs)

    @property
    def server_pid(self) -> int | None:
        return self.server.process.pid if self.server is not None and self.server.process is not None else None

    @property
    def server_pgid(self) -> int | None:
        return self.server.process.pgid if self.server is not None and self.server.process is not None else None

    @property
    def served_checkpoint(self) -> str | None:
        return self.served[0] if self.served is not None else None

    # ------------------------------------------------------------------ internals

    def _serve(self, checkpoint_dir: Path) -> GenerationClient:
        """The client of a healthy server for ``checkpoint_dir``, (re)starting the server when needed."""
        fingerprint = checkpoint_fingerprint(checkpoint_dir)
        alive = self.server is not None and self.server.process is not None and self.server.process.alive()
        if alive and fingerprint == self.served and self.client is not None:
            return self.client
        self._stop()
        server = VllmServer(
            checkpoint_dir.resolve(), self.work_dir / "logs", extra_args=self.server_args, env=self.server_env
        )
        self.start_seconds.append(server.start(self.startup_timeout_s))
        self.server = server
        self.served = fingerprint
        self.client = GenerationClient(server.base_url, SERVED_MODEL_NAME, self.policy, max_concurrency=self.max_concurrency)
        return self.client

    def _stop(self) -> None:
        server, self.server, self.client, self.served = self.server, None, None, None
        if server is not None:
            server.stop()

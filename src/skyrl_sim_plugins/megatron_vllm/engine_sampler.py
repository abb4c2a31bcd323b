"""The real backend's sampler: samples sent to the vLLM server concurrently, as SkyRL-Train's client sends them.

The engine loop hands it samples (``skyrl_sim.engine.sampler.Sampler``) in every mode: continuous admissions,
serial waves, forwarded submissions. What it does with them is what SkyRL 0.4.0 does (``skyrl_train_backend.py``:
``_sample_with_remote_client_async``; ``remote_inference_client.py``: ``sample``):

- every sample of a request is one HTTP generate request (``n = 1``, the sample's seed = the request's seed + its
  index), all of them sent at once (the server is looked up only at a checkpoint's first sample or after a
  failure), at most ``generate_concurrency_per_engine x num_engines`` in flight
  (``SKYRL_GENERATE_CONCURRENCY_PER_ENGINE``; the rest wait in order, a thread pool of that size);
- a request's result is written to the futures table, from the thread of its last sample, when the last sample
  returns (a failed sample fails the request with its error); the engine loop meanwhile goes on, and its ``drain``
  blocks until every admitted request is written (bounded by ``timeout_s``).

Prompts are pseudo-random token ids from the run's seed and the request id, so two requests never share a prompt
(only the samples of one request do, as in an RL rollout). The server serves the checkpoint the samples name;
switching to another one restarts it, which waits until nothing is in flight (merged weights: one set at a time).
A server that does not start fails the samples of its checkpoint with the reason, once, without starting again.
While requests are in flight the server's ``/metrics`` are read every 0.25 s (``vllm_metrics.MetricsPoller``), so
the run records vLLM's own running and waiting counts, KV cache usage, preemptions and block count.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_sim.api import CallOutcome, Endpoint, FuturesTable, Request, Sleep, WaveResults
from skyrl_sim_plugins.megatron_vllm.batch import datum_tokens
from skyrl_sim_plugins.megatron_vllm.vllm_metrics import MetricsPoller

UNCAPPED_WORKERS = 256
"""Threads when SkyRL's cap is off (0): enough for every sample of a tiny CPU run at once."""
PROMPT_SEED_STRIDE = 1_000_003
"""A request's prompt seed is ``seed * PROMPT_SEED_STRIDE + request id``: distinct prompts per request."""


@dataclass
class _Pending:
    """A request whose samples are in flight."""

    request: Request
    hold: bool
    samples: list[list[int] | None]
    sent_s: float | None = None
    done: int = 0
    error: str | None = None


class VllmEngineSampler:
    """``Sampler`` on a real vLLM server (see the module doc). ``serve(checkpoint_dir)`` returns a generation client
    for a server of that checkpoint; ``metrics()`` the server's ``/metrics`` text; ``checkpoint(request)`` the
    directory a request samples from, or an error text when it cannot be served."""

    def __init__(
        self,
        endpoint: Endpoint,
        table: FuturesTable,
        clock: Callable[[], float],
        serve: Callable[[Path], Any],
        metrics: Callable[[], str],
        checkpoint: Callable[[Request], Path | str],
        vocab_size: int,
        seed: int,
        timeout_s: float,
    ) -> None:
        self.endpoint = endpoint
        self.table = table
        self.clock = clock
        self.serve = serve
        self.checkpoint = checkpoint
        self.vocab_size = vocab_size
        self.seed = seed
        self.timeout_s = timeout_s
        cap = endpoint.inference.concurrency_cap
        self.pool = ThreadPoolExecutor(max_workers=cap or UNCAPPED_WORKERS, thread_name_prefix="skyrl-generate")
        self._cond = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._queue: deque[tuple[_Pending, int, Path]] = deque()
        self._http = 0  # generate requests in flight
        self._served: Path | None = None
        self._client: Any = None  # the served checkpoint's client, sent to without asking the server again
        self._unservable: dict[Path, str] = {}  # checkpoints whose server did not start, and why
        self._wave: WaveResults | None = None
        self._closed = False
        self.used = False
        self.poller = MetricsPoller(metrics, self._busy, clock)
        self._dispatcher = threading.Thread(target=self._dispatch, name="skyrl-sampler", daemon=True)
        self._dispatcher.start()

    # ------------------------------------------------------------------ Sampler

    def submit(self, requests: Sequence[Request]) -> None:
        self._submit(requests, hold=False)

    def in_flight(self) -> int:
        with self._cond:
            return len(self._pending)

    def drain(self) -> Generator[Sleep, None, None]:
        """Block until every admitted request is written (at most ``timeout_s``; then the engine goes on and what is
        still in flight finishes later)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending, timeout=self.timeout_s)
        return
        yield  # a generator that only blocks: the wall clock has already passed

    def wave(self, requests: Sequence[Request]) -> Generator[Sleep, None, CallOutcome]:
        start = time.perf_counter()
        with self._cond:
            self._wave = WaveResults()
        self._submit(requests, hold=True)
        yield from self.drain()
        with self._cond:
            wave, self._wave = self._wave, None
        assert wave is not None
        return CallOutcome(duration_s=time.perf_counter() - start, outputs=wave.outputs, failed=wave.failed)

    def report(self) -> dict[str, Any]:
        if not self.used:
            return {}
        engines = self.poller.report()
        blocks = next((e["num_gpu_blocks"] for e in engines if e.get("num_gpu_blocks")), None)
        return {"kv_cache": {"num_blocks": blocks, "usable_blocks": blocks - 1 if blocks else None}, "engines": engines}

    # ------------------------------------------------------------------ work

    def _busy(self) -> bool:
        with self._cond:
            return bool(self._pending)

    def _submit(self, requests: Sequence[Request], hold: bool) -> None:
        self.used = True
        failed: list[tuple[_Pending, str]] = []
        with self._cond:
            for request in requests:
                pending = _Pending(request, hold, [None] * request.num_samples)
                self._pending[request.id] = pending
                where = self.checkpoint(request)
                if isinstance(where, str):
                    failed.append((pending, where))
                    continue
                for index in range(request.num_samples):
                    self._queue.append((pending, index, where))
            self._cond.notify_all()
        for pending, error in failed:
            pending.error = error
            self._write(pending)

    def _dispatch(self) -> None:
        """Send queued samples while slots are free; switch the server's checkpoint only when nothing is in flight."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._queue and self._http < self._cap()))
                if self._closed:
                    return
                pending, index, where = self._queue[0]
                if where != self._served and self._http:
                    self._cond.wait_for(lambda: self._closed or not self._http)
                    continue
                self._queue.popleft()
                self._http += 1
                if pending.sent_s is None:
                    pending.sent_s = self.clock()
                broken = self._unservable.get(where)
            if broken is not None:  # its server failed to start once: fail at once rather than start it again
                self._sample_done(pending, index, None, broken)
                continue
            client = self._client if where == self._served else None
            if client is None:  # the first sample of a checkpoint (or after a failure): make sure its server runs
                try:
                    client = self._client = self.serve(where)
                    self._served = where
                except Exception as exc:  # the sampler's own errors name what failed
                    message = f"sampler not available: {exc}"
                    with self._cond:
                        self._unservable[where] = message
                    self._sample_done(pending, index, None, message)
                    continue
            self.pool.submit(self._one, client, pending, index)

    def _cap(self) -> float:
        cap = self.endpoint.inference.concurrency_cap
        return cap if cap is not None else float("inf")

    def _one(self, client: Any, pending: _Pending, index: int) -> None:
        request = pending.request
        prompt = datum_tokens(self.seed * PROMPT_SEED_STRIDE + request.id, request.prompt_tokens, self.vocab_size)
        try:
            generation = client.generate(
                prompt[: request.prompt_tokens].tolist(),
                request.max_tokens,
                n=1,
                temperature=1.0,
                seed=self.seed + index,
                ignore_eos=True,
            )
            self._sample_done(pending, index, list(generation.samples[0].token_ids), None)
        except Exception as exc:  # a failed sample fails its request, with the client's words
            self._client = None  # the next sample asks for a healthy server first
            self._sample_done(pending, index, None, f"sampling failed: {exc}")

    def _sample_done(self, pending: _Pending, index: int, tokens: list[int] | None, error: str | None) -> None:
        with self._cond:
            self._http -= 1
            pending.samples[index] = tokens
            pending.error = pending.error or error
            pending.done += 1
            complete = pending.done == len(pending.samples)
            self._cond.notify_all()
        if complete:
            self._write(pending)

    def _write(self, pending: _Pending) -> None:
        request = pending.request
        output: dict[str, Any] = {}
        if pending.error is None:
            output = {
                "samples": pending.samples,
                "generated_tokens": sum(len(s or ()) for s in pending.samples),
                "vllm": {"engine": 0, "sent_s": pending.sent_s, "finished_s": self.clock()},
            }
        with self._cond:
            wave = self._wave if pending.hold else None
            if wave is not None:
                if pending.error is not None:
                    wave.failed[request.id] = pending.error
                else:
                    wave.outputs[request.id] = output
        if not pending.hold:
            self.table.finish([request.id], error=pending.error, outputs={request.id: output} if output else None)
        with self._cond:
            self._pending.pop(request.id, None)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop sending; what is in flight returns or fails with the server; the last metrics are read."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._dispatcher.join(timeout=5.0)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.poller.stop(final_read=self.used)

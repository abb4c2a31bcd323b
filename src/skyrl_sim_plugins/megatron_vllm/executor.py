"""The real backend's ``CallExecutor``: each engine call goes to the torchrun workers (or the vLLM sampler).

It returns what really happened: the measured wall time (``wait_s = 0``: the time has already passed), the peak
tensor bytes the workers measured, a real OOM with the attempted size parsed from PyTorch's message, the metrics
(``num_tokens:sum``, ``total_loss:sum``) and per-request outputs (per-datum ``logprobs`` and ``elementwise_loss``).
An OOM fails only its call, as in SkyRL. A dead or silent worker fails the call with a clear error and returns
``fatal=True``, so the engine stops and every other request fails instead of waiting forever.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_sim.api import (
    BatchCall,
    CallOutcome,
    CallShape,
    Endpoint,
    FuturesTable,
    ModelArch,
    OomRecord,
    Request,
    r3_codec,
    synthetic_routes,
)
from skyrl_sim_plugins.megatron_vllm.batch import shape_to_dict
from skyrl_sim_plugins.megatron_vllm.engine_sampler import VllmEngineSampler
from skyrl_sim_plugins.megatron_vllm.rl_loss import IMPLEMENTED
from skyrl_sim_plugins.megatron_vllm.workers import WorkerDied, WorkerGroup

SAMPLER_MISSING = "sampler not available"


def checkpoint_dir(run_dir: Path, model_id: str, name: str) -> Path:
    """Where ``save_weights_for_sampler(model_id, name)`` writes (name "": the base weights every model shares)."""
    return run_dir / "checkpoints" / model_id / name if name else run_dir / "checkpoints" / "base"


@dataclass
class WorkerTenants:
    """The workers' adapter stores as the run driver sees them (``TenantStore``), measured: one slot's bytes and the
    most the slots held at once (the pristine slot included), per worker."""

    slot_bytes: int
    host_bytes_peak: int

    def start(self, model_ids: list[str]) -> None:
        """Nothing to do: the workers registered the models loaded at the start before their hello."""

    def report(self) -> dict[str, Any]:
        return {"slot_bytes": self.slot_bytes, "host_bytes_peak": self.host_bytes_peak}


class MegatronExecutor:
    """Runs engine calls on a ``WorkerGroup``; sampling through a lazily started ``VllmSampler``."""

    def __init__(
        self,
        workers: WorkerGroup,
        endpoint: Endpoint,
        model: ModelArch,
        run_dir: Path,
        seed: int,
        sampler_factory: Callable[[], Any] | None = None,
        kill_rank_before_call: tuple[int, int] | None = None,
        call_timeout_s: float = 1800.0,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.workers = workers
        self.endpoint = endpoint
        self.model = model
        self.run_dir = run_dir
        self.seed = seed
        self.sampler_factory = sampler_factory
        self.sampler_process: Any = None  # the vLLM server's owner (sampler.VllmSampler), started at the first sample
        self.engine_sampler: VllmEngineSampler | None = None
        self.call_timeout_s = call_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.sampler_error: str | None = None
        self.saved: set[tuple[str, str]] = set()
        self.kill_rank_before_call = kill_rank_before_call
        self.calls = 0
        self.tenants = WorkerTenants(
            slot_bytes=max(int(h.get("slot_bytes") or 0) for h in workers.hellos.values()),
            host_bytes_peak=max(int(h.get("host_bytes") or 0) for h in workers.hellos.values()),
        )

    # ------------------------------------------------------------------ batch calls

    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        self.calls += 1
        self._maybe_kill()
        if shape is None:
            return self._sample(call)
        datums = [length for request in call.requests for length in request.datums]
        message = {"cmd": call.kind, "model_id": call.model_id, "shape": shape_to_dict(shape), "datums": datums}
        if shape.rl_path:
            if shape.loss_fn not in IMPLEMENTED:
                implemented = ", ".join(IMPLEMENTED)
                error = f"loss_fn {shape.loss_fn}: the megatron backend implements {implemented} (the simulator all)"
                return CallOutcome(duration_s=0.0, error=error)
            message["rl"] = rl_message(call)
        routes = routes_message(call, self.endpoint, self.model)
        if routes is not None:
            message["routes"] = routes
        start = time.perf_counter()
        try:
            replies = self.workers.command(message)
        except WorkerDied as exc:
            return CallOutcome(duration_s=time.perf_counter() - start, error=f"training worker failed: {exc}", fatal=True)
        seconds = time.perf_counter() - start
        peaks = [r["peak_bytes"] for r in replies.values() if r.get("peak_bytes") is not None]
        peak = max(peaks) if peaks else None
        stages = stage_peaks(replies, self.workers.hellos)
        memory = {"stage_peaks": stages} if stages is not None else None
        failed = {rank: r for rank, r in replies.items() if not r.get("ok")}
        extra = {"worker_seconds": max(float(r.get("seconds", 0.0)) for r in replies.values()), **swap_extra(replies)}
        if failed:
            rank, reply = first_failure(failed)
            if stages is not None and reply.get("oom"):  # the call's peak is the failing stage's, as the walk's
                peak = stages[int(reply["oom"]["pp_stage"])]
            if reply.get("oom"):
                oom = reply["oom"]
                record = OomRecord(
                    attempted_bytes=int(oom.get("attempted_bytes") or 0),
                    where={**_site(oom), "rank": rank, "ranks_failed": own_failures(failed)},
                    message=oom["message"],
                    allocated_bytes=peak,
                    capacity_bytes=self.endpoint.capacity_bytes if self.endpoint.memory_limit_gib else None,
                )
                return CallOutcome(duration_s=seconds, peak_bytes=peak, oom=record, extra=extra, memory=memory)
            error = reply.get("error", "worker error")
            return CallOutcome(duration_s=seconds, peak_bytes=peak, error=error, extra=extra, memory=memory)
        return CallOutcome(
            duration_s=seconds,
            peak_bytes=peak,
            metrics=self._metrics(replies),
            outputs=self._outputs(call, replies),
            extra=extra,
            memory=memory,
        )

    def _leaders(self, replies: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """One reply per DP rank (its TP rank 0, on the last pipeline stage, which computes the loss and the
        log-probs): their row sets are disjoint and together cover the call."""
        hellos = self.workers.hellos
        last = self.endpoint.parallelism.pp - 1
        return [r for rank, r in replies.items() if hellos[rank]["tp_rank"] == 0 and hellos[rank].get("pp_rank", 0) == last]

    def _metrics(self, replies: dict[int, dict[str, Any]]) -> dict[str, float]:
        leaders = self._leaders(replies)
        metrics = {
            "num_tokens:sum": float(sum(r["num_tokens"] for r in leaders)),
            "total_loss:sum": float(sum(r["total_loss"] for r in leaders)),
        }
        entropies = [value for r in leaders for value in r.get("entropy") or []]
        if entropies:  # the RL path: SkyRL's policy_entropy, the mean over real micro-batches and DP ranks
            metrics["pg_loss:sum"] = metrics["total_loss:sum"]
            metrics["entropy_loss:sum"] = sum(entropies) / len(entropies)
        return metrics

    def _outputs(self, call: BatchCall, replies: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        rows: dict[int, dict[str, list[float]]] = {}
        for reply in self._leaders(replies):
            rows.update({int(k): v for k, v in reply["rows"].items()})
        outputs: dict[int, dict[str, Any]] = {}
        index = 0
        for request in call.requests:
            per = [rows.get(index + i, {}) for i in range(len(request.datums))]
            index += len(request.datums)
            outputs[request.id] = {
                "datum_lengths": list(request.datums),
                "logprobs": [d.get("logprobs", []) for d in per],
                "elementwise_loss": [d.get("elementwise_loss", []) for d in per],
                "loss": float(sum(sum(d.get("elementwise_loss", [])) for d in per)),
            }
        return outputs

    # ------------------------------------------------------------------ sampling

    def sampler(self, table: FuturesTable, clock: Any) -> VllmEngineSampler:
        """The run's sampler (``engine_sampler.VllmEngineSampler``): the engine loop's samples go to the vLLM server
        concurrently, one HTTP request per sample, under SkyRL's cap; the server starts at the first sample."""
        self.engine_sampler = VllmEngineSampler(
            self.endpoint,
            table,
            clock.now,
            serve=self._serve,
            metrics=self._metrics_text,
            checkpoint=self._checkpoint_of,
            vocab_size=self.model.vocab_size,
            seed=self.seed,
            timeout_s=self.call_timeout_s,
        )
        return self.engine_sampler

    def warm_sampler(self, model_id: str) -> float:
        """Start the vLLM server on ``model_id``'s base weights before the run's clock starts (the training workers
        are started before it too), so the run measures sampling, not a server start; returns the start's seconds."""
        start = time.perf_counter()
        self._serve(checkpoint_dir(self.run_dir, model_id, ""))
        return time.perf_counter() - start

    def _checkpoint_of(self, request: Request) -> Path | str:
        """The directory ``request`` samples from, or why it cannot be sampled."""
        if request.checkpoint and (request.model_id, request.checkpoint) not in self.saved:
            return f"sampler checkpoint not found: {request.checkpoint}"
        return checkpoint_dir(self.run_dir, request.model_id, request.checkpoint)

    def _serve(self, where: Path) -> Any:
        sampler = self._get_sampler()
        if sampler is None:
            raise RuntimeError(self.sampler_error)
        return sampler.client_for(where)

    def _metrics_text(self) -> str:
        if self.sampler_process is None:
            raise OSError("no vLLM server is running")
        return str(self.sampler_process.metrics_text())

    def _sample(self, call: BatchCall) -> CallOutcome:
        """A sample call outside the engine's sampler (a caller that drives the executor alone): one wave."""
        if self.engine_sampler is None:
            return CallOutcome(duration_s=0.0, error=f"{SAMPLER_MISSING}: the executor was not given a futures table")
        steps = self.engine_sampler.wave(call.requests)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def _get_sampler(self) -> Any:
        if self.sampler_process is not None or self.sampler_error is not None:
            return self.sampler_process
        try:
            if self.sampler_factory is not None:
                self.sampler_process = self.sampler_factory()
            else:
                from skyrl_sim_plugins.megatron_vllm.sampler import VllmSampler
                from skyrl_sim_plugins.megatron_vllm.vllm_server import inference_arguments

                args, env = inference_arguments(self.endpoint.inference)
                self.sampler_process = VllmSampler(
                    self.run_dir / "sampler",
                    startup_timeout_s=self.startup_timeout_s,
                    server_args=tuple(args),
                    server_env=env,
                )
        except ImportError as exc:
            self.sampler_error = (
                f"{SAMPLER_MISSING}: the vLLM sampler (skyrl_sim_plugins.megatron_vllm.sampler) cannot be imported ({exc})"
            )
        except Exception as exc:
            self.sampler_error = f"{SAMPLER_MISSING}: the vLLM sampler failed to start ({exc})"
        return self.sampler_process

    # ------------------------------------------------------------------ singles

    def single(self, request: Request) -> CallOutcome:
        self.calls += 1
        self._maybe_kill()
        start = time.perf_counter()
        try:
            if request.type == "optim_step":
                replies = self.workers.command(
                    {"cmd": "optim_step", "model_id": request.model_id, "learning_rate": request.learning_rate}
                )
                return self._single_outcome(start, replies, metrics=replies[0].get("metrics", {}))
            if request.type == "save_weights_for_sampler":
                path = checkpoint_dir(self.run_dir, request.model_id, request.checkpoint)
                replies = self.workers.command(
                    {"cmd": "save_weights_for_sampler", "model_id": request.model_id, "path": str(path)}
                )
                self.saved.add((request.model_id, request.checkpoint))
                return self._single_outcome(start, replies, outputs={request.id: {"path": str(path)}})
            if request.type in ("create_model", "unload_model"):
                return self._lifecycle(request, start)
        except WorkerDied as exc:
            return CallOutcome(duration_s=time.perf_counter() - start, error=f"training worker failed: {exc}", fatal=True)
        # save_weights / load_weights: no training checkpoint format here; they hold no state of the modelled trainer
        return CallOutcome(duration_s=time.perf_counter() - start, outputs={request.id: {"note": f"{request.type}: no-op"}})

    def _lifecycle(self, request: Request, start: float) -> CallOutcome:
        """``create_model`` (the endpoint's LoRA rank and alpha unless the request names its own) or ``unload_model``
        on every rank's adapter store; a refusal is the call's error, in SkyRL's words."""
        lora = request.lora or (self.endpoint.lora.rank, self.endpoint.lora.alpha)
        message: dict[str, Any] = {"cmd": request.type, "model_id": request.model_id, "lora": list(lora)}
        replies = self.workers.command(message)
        host = max(int(r.get("host_bytes") or 0) for r in replies.values())
        self.tenants.host_bytes_peak = max(self.tenants.host_bytes_peak, host)
        extra: dict[str, Any] = {"host_bytes": host}
        refused = [r for _, r in sorted(replies.items()) if not r.get("ok")]
        if refused:
            return CallOutcome(duration_s=time.perf_counter() - start, error=refused[0].get("error"), extra=extra)
        extra["tenancy"] = replies[0].get("kind")
        return CallOutcome(duration_s=time.perf_counter() - start, extra=extra)

    def _single_outcome(self, start: float, replies: dict[int, dict[str, Any]], **fields: Any) -> CallOutcome:
        return CallOutcome(duration_s=time.perf_counter() - start, extra=swap_extra(replies), **fields)


    # ------------------------------------------------------------------ lifecycle

    def _maybe_kill(self) -> None:
        """Fault injection for tests: SIGKILL one rank just before the N-th call (option kill_rank_before_call=N:RANK)."""
        if self.kill_rank_before_call and self.calls == self.kill_rank_before_call[0]:
            os.kill(int(self.workers.hellos[self.kill_rank_before_call[1]]["pid"]), signal.SIGKILL)

    def close(self) -> None:
        try:
            if self.engine_sampler is not None:
                self.engine_sampler.close()
        finally:
            if self.sampler_process is not None:
                try:
                    self.sampler_process.close()
                finally:
                    self.sampler_process = None


def rl_message(call: BatchCall) -> dict[str, Any]:
    """What the workers need for SkyRL's RL path: the call's loss (its first request's, as SkyRL runs a whole call)
    and every datum's sampling log-probs and advantages, one per target (zeros for a request that sent none)."""
    first = call.requests[0]
    inputs = []
    for request in call.requests:
        for length in request.datums:
            given = request.loss_fn_inputs
            if given is None:
                inputs.append(([0.0] * length, [0.0] * length))
            else:
                inputs.append((given.per_token("logprobs", length), given.per_token("advantages", length)))
    return {"loss_fn": first.loss_fn, "config": dict(first.loss_fn_config), "inputs": inputs}


def routes_message(call: BatchCall, endpoint: Endpoint, model: ModelArch) -> list[dict[str, Any] | None] | None:
    """An MoE call's recorded routes, one ``r3_codec`` payload per datum (None for a datum of a request that carries
    none), as SkyRL's service ships them to the trainer; None when no request carries routes or the endpoint does not
    replay them (the routers then route for themselves)."""
    if model.moe is None or endpoint.trainer.routed_expert_replay == "off":
        return None
    if all(request.routed_experts is None for request in call.requests):
        return None
    payloads: list[dict[str, Any] | None] = []
    for request in call.requests:
        for length in request.datums:
            recorded = request.routed_experts
            routes = None if recorded is None else r3_codec.encode_routes(synthetic_routes(recorded, length, model))
            payloads.append(routes)
    return payloads


SITE_KEYS = ("phase", "stage", "layer", "module", "op", "aten_op", "shape", "dtype", "autograd_node", "pp_stage")


def stage_peaks(replies: dict[int, dict[str, Any]], hellos: dict[int, dict[str, Any]]) -> list[int] | None:
    """Under pipeline parallelism, each stage's peak (the most of its ranks'), first stage first, as the walk's
    ``stage_peaks``; None without it."""
    stages = sorted({int(h.get("pp_rank", 0)) for h in hellos.values()})
    if len(stages) < 2:
        return None
    peaks = dict.fromkeys(stages, 0)
    for rank, reply in replies.items():
        stage = int(hellos[rank].get("pp_rank", 0))
        peaks[stage] = max(peaks[stage], int(reply.get("peak_bytes") or 0))
    return [peaks[s] for s in stages]


def own_failures(failed: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks that failed themselves (not a pipeline stage that ran its part while another stage failed)."""
    return sorted(rank for rank, reply in failed.items() if not reply.get("peer_failed"))


def first_failure(failed: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The failure a call reports: a rank's own out-of-memory before another stage's ``peer_failed`` reply, the
    stage that failed first in time among pipeline stages (the one that would stop a real job), else the lowest
    rank."""
    own = {rank: r for rank, r in failed.items() if not r.get("peer_failed")} or failed
    return min(own.items(), key=lambda item: (float(item[1].get("failed_at") or 0.0), item[0]))


def _site(oom: dict[str, Any]) -> dict[str, Any]:
    """The failing allocation's site a rank reported (``failure_site.failure_site``), keys it did not know left out."""
    return {key: oom[key] for key in SITE_KEYS if oom.get(key) is not None}


def swap_extra(replies: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A call's ``extra["swap"]`` from its replies: what rank 0 swapped, with the slowest rank's seconds (every rank
    swaps the same adapters: the rule is one, and the model ids are the same on every rank)."""
    swaps = [r["swap"] for r in replies.values() if r.get("swap")]
    if not swaps:
        return {}
    first = replies[min(replies)].get("swap") or swaps[0]
    return {"swap": {**first, "seconds": max(float(s["seconds"]) for s in swaps)}}

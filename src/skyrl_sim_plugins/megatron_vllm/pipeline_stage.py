"""Pipeline-parallel stages on the real backend: which part of the model a rank builds, its names in the whole model,
and a failure on one stage that must not leave the others waiting.

**The stage.** With ``parallelism.pp`` above 1 each rank builds one stage of megatron-core's ``GPTModel``
(``pre_process`` on the first: the embedding; ``post_process`` on the last: the final norm and the output layer) with
the stage's consecutive decoder layers, the split the simulator walks (``skyrl_sim.engine.pipeline.stage_plan``).
megatron-core names a stage's layers from 0 (``decoder.layers.0`` on stage 1 of 2 is the model's layer 2):
``to_stage`` picks and renames a stage's weights from the whole model's, ``to_global`` renames a stage's names back
(the LoRA seeds, the HF export, the OOM site's layer). An uneven split is refused (megatron-core needs the first and
last stages' sizes for one).

**A failure on one stage.** Under 1F1B each stage waits for its neighbours in point-to-point sends and receives. A
stage that runs out of memory (or fails otherwise) in a forward, a backward or a receive buffer would leave its
neighbours blocked in a receive that never comes (gloo then aborts the whole job, as NCCL does). ``StageContainment``,
entered around megatron's ``forward_backward_pipelining_without_interleaving``, keeps the schedule's communication
whole instead: the failing stage records the error, lifts its tensor limit (its verdict is made) and runs the rest of
its schedule with stand-ins, zero tensors of each micro-batch's real shapes in place of its outputs and its input
gradients, so every send and receive of every stage is matched, and no stage waits on one that stopped. The other
stages run their own work to the end, each on its own memory (so each stage's peak is its own, as the simulator walks
every stage as its own device). After the schedule every stage learns whether any stage failed (``agree``, one
all-reduce over the pipeline group): the failing one raises its error, the others ``PeerStageFailed``, and every stage
restores the gradients the call started with. Every wait is bounded by the process group's timeout.

On CPU, gloo needs two things megatron-core assumes of NCCL: single ``isend``/``irecv`` pairs
(``batch_p2p_comm=False``), and no ``torch.cuda.synchronize()`` after the shapes of a variable-length micro-batch are
exchanged (``variable_seq_lengths``, as SkyRL sets it: micro-batches are trimmed to their own width).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from skyrl_sim.api import Stage, UserError, stage_plan
from skyrl_sim_plugins.megatron_vllm.memory_meter import is_oom

LAYER_NAME = re.compile(r"((?:^|\.)layers\.)(\d+)(?=\.|$)")
FIRST_STAGE_NAMES = ("embedding.",)
LAST_STAGE_NAMES = ("decoder.final_layernorm.", "output_layer.")


class PeerStageFailed(RuntimeError):
    """Another pipeline stage failed this call; this stage ran its own work to the end."""


def check_pipeline(num_layers: int, pp: int, where: str) -> None:
    """Refuse a split megatron-core cannot build without per-stage sizes (``where`` names the endpoint)."""
    if pp > 1 and num_layers % pp:
        raise UserError(
            f"{where}: {num_layers} layers do not split evenly over pp = {pp} stages (megatron-core builds an uneven "
            "split only with the first and last stages' sizes given, which the real backend does not set)"
        )


def stage_of(num_layers: int, pp: int, pp_rank: int) -> Stage:
    """This rank's stage: its layers, and whether it holds the embedding and the output layer."""
    return stage_plan(num_layers, pp)[pp_rank]


def _renamed(name: str, offset: int) -> str:
    return LAYER_NAME.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}", name, count=1)


def to_stage(weights: dict[str, torch.Tensor], stage: Stage) -> dict[str, torch.Tensor]:
    """The stage's part of the whole model's megatron weights, its layers renamed from 0 as megatron-core names them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        match = LAYER_NAME.search(name)
        if match is not None:
            if int(match.group(2)) in stage.layers:
                out[_renamed(name, -stage.layers.start)] = tensor
        elif (name.startswith(FIRST_STAGE_NAMES) and stage.first) or (name.startswith(LAST_STAGE_NAMES) and stage.last):
            out[name] = tensor
    return out


def to_global(name: str, stage: Stage | None) -> str:
    """A stage's parameter or module name in the whole model (its layer index shifted by the stage's first layer)."""
    return name if stage is None or not stage.layers.start else _renamed(name, stage.layers.start)


def install_cpu_p2p() -> None:
    """gloo's side of megatron-core's p2p on CPU: the shapes exchange ends with ``torch.cuda.synchronize()``, which a
    CPU build cannot run and gloo does not need (its receives are complete when waited on). Idempotent."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *_a, **_k: None  # type: ignore[assignment]


def join_stages(parts: list[tuple[int, int, dict[str, torch.Tensor]]], tp: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's ``(dp_rank, tp_rank, shard under its whole-model names)``, joined into one whole-model shard per
    TP rank (the first data-parallel replica's): what ``hf_export.from_megatron`` takes."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for dp_rank, tp_rank, shard in parts:
        if dp_rank == 0:
            shards[tp_rank].update(shard)
    return shards


@dataclass
class StageFailureHooks:
    """What a pipeline stage does at the moment it fails, before its schedule goes on with stand-ins: read the
    failure's site while it is there (``on_fail``) and lift the tensor limit (``lift_limit``)."""

    on_fail: Callable[[BaseException], None] = lambda _exc: None
    lift_limit: Callable[[], None] = lambda: None


class StageFailure:
    """The worker's side of one call's failure on a pipeline stage: at the moment it fails, the site the walk would
    name (under the whole model's layer numbers) and the stage's peak so far are read, and the CPU tensor limit is
    lifted, so the stand-ins that follow cannot fail or raise the peak."""

    def __init__(self, meter: Any, scope: Any, stage: Stage | None) -> None:
        self.meter = meter  # memory_meter.CallMemory
        self.scope = scope  # failure_site.ModuleScope
        self.stage = stage
        self.site: dict[str, Any] | None = None
        self.peak_bytes: int | None = None
        self.failed_at: float | None = None

    def hooks(self) -> StageFailureHooks | None:
        """The hooks for ``LoraModel.run_pass`` (None without pipeline parallelism)."""
        return None if self.stage is None else StageFailureHooks(self._on_fail, self._lift_limit)

    def _on_fail(self, exc: BaseException) -> None:
        from skyrl_sim_plugins.megatron_vllm.failure_site import failure_site

        self.failed_at = time.monotonic()
        meter = self.meter.meter
        self.peak_bytes = meter.peak_bytes if meter is not None else None
        if is_oom(exc):
            site = failure_site(exc, self.scope.current, meter.refusal if meter is not None else None)
            if site.get("module"):
                site["module"] = to_global(site["module"], self.stage)
            if isinstance(site.get("layer"), int) and self.stage is not None:
                site["layer"] += self.stage.layers.start
            self.site = site

    def _lift_limit(self) -> None:
        if self.meter.meter is not None:
            self.meter.meter.limit_bytes = None


class StageContainment:
    """One call's failure containment on one pipeline stage (see the module docstring).

    ``stand_in_shape(i)`` gives micro-batch ``i``'s ``(rows, width)``: the shape of the stand-in output a failed
    stage sends on; ``on_fail(exc)`` runs once, at the failure, while the state it describes is still there (the
    worker reads the failure's site and its peak); ``lift_limit()`` turns the tensor limit off for the stand-ins."""

    def __init__(
        self,
        stand_in_shape: Callable[[int], tuple[int, int]],
        hidden: int,
        dtype: torch.dtype,
        on_fail: Callable[[BaseException], None],
        lift_limit: Callable[[], None],
    ) -> None:
        self.stand_in_shape = stand_in_shape
        self.hidden = hidden
        self.dtype = dtype
        self.on_fail = on_fail
        self.lift_limit = lift_limit
        self.error: BaseException | None = None
        self._shapes: Any = None  # this message's exchanged shapes, replayed when its receive buffer is made again
        self._replay = False

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.on_fail(exc)
            self.lift_limit()

    # ------------------------------------------------------------------ stand-ins

    def _output(self, microbatch: int, last_stage: bool) -> torch.Tensor:
        if last_stage:  # the last stage's "output" is its loss, which nothing sends on
            return torch.zeros((), dtype=torch.float32)
        rows, width = self.stand_in_shape(microbatch)
        return torch.zeros(width, rows, self.hidden, dtype=self.dtype)  # [s, b, h], as a stage sends it

    @staticmethod
    def _grads(input_tensor: Any) -> Any:
        if isinstance(input_tensor, list):
            return [None if x is None else torch.zeros_like(x, requires_grad=False) for x in input_tensor]
        return None if input_tensor is None else torch.zeros_like(input_tensor, requires_grad=False)

    # ------------------------------------------------------------------ megatron's schedule, wrapped

    def _forward_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            try:
                return original(*args, **kwargs)
            except Exception as exc:  # the stage's verdict is made: the schedule goes on with stand-ins
                self.fail(exc)
        input_tensor = kwargs.get("input_tensor", args[4] if len(args) > 4 else None)
        output = self._output(int(kwargs.get("current_microbatch") or 0), bool(kwargs.get("is_last_stage", True)))
        tokens = torch.zeros([], dtype=torch.int)
        return ([output], tokens) if isinstance(input_tensor, list) else (output, tokens)

    def _backward_step(self, original: Callable[..., Any], input_tensor: Any, *args: Any) -> Any:
        if not self.failed:
            try:
                return original(input_tensor, *args)
            except Exception as exc:
                self.fail(exc)
        return self._grads(input_tensor)

    def _communicate(self, original: Callable[..., Any], communicator: Any, **kwargs: Any) -> Any:
        self._shapes, self._replay = None, False  # each message exchanges its own shapes
        try:
            return original(communicator, **kwargs)
        except Exception as exc:
            # only a receive buffer can be refused here (the shapes exchange is outside the limit, below), and it is
            # allocated before anything is posted: fail, then allocate it again with the shapes already exchanged
            if self.failed or not is_oom(exc):
                raise
            self.fail(exc)
            self._replay = self._shapes is not None
            return original(communicator, **kwargs)

    def _communicate_shapes(self, original: Callable[..., Any], communicator: Any, *args: Any, **kwargs: Any) -> Any:
        if self._replay:
            self._replay = False
            return self._shapes
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # three int64 per message: outside the tensor limit (and the walk)
            self._shapes = original(communicator, *args, **kwargs)
        return self._shapes

    @contextmanager
    def installed(self) -> Iterator[StageContainment]:
        """megatron's ``forward_step``, ``backward_step`` and p2p ``_communicate`` wrapped for the schedule's run."""
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        comm = p2p_communication.P2PCommunicator
        forward, backward = schedules.forward_step, schedules.backward_step
        communicate, shapes = comm._communicate, comm._communicate_shapes
        schedules.forward_step = lambda *a, **k: self._forward_step(forward, *a, **k)
        schedules.backward_step = lambda *a: self._backward_step(backward, *a)
        comm._communicate = lambda c, **k: self._communicate(communicate, c, **k)  # type: ignore[method-assign]
        comm._communicate_shapes = lambda c, *a, **k: self._communicate_shapes(shapes, c, *a, **k)  # type: ignore[method-assign]
        try:
            yield self
        finally:
            schedules.forward_step, schedules.backward_step = forward, backward
            comm._communicate, comm._communicate_shapes = communicate, shapes  # type: ignore[method-assign]

    def agree(self) -> None:
        """After the schedule: every stage learns whether any failed; the failing one raises its error, the others
        ``PeerStageFailed`` naming the first failing stage. Outside the tensor limit (one int per stage)."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from torch.utils._python_dispatch import _disable_current_modes

        group = parallel_state.get_pipeline_model_parallel_group()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        with _disable_current_modes():
            flags = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
            flags[stage] = int(self.failed)
            dist.all_reduce(flags, group=group)
        if self.error is not None:
            raise self.error
        if flags.any():
            first = int(torch.nonzero(flags)[0])
            raise PeerStageFailed(f"pipeline stage {first} failed this call; stage {stage} ran its part to the end")

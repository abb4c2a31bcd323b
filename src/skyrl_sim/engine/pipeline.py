"""Pipeline-parallel stages: which decoder layers each stage holds, and how many micro-batches each stage has in
flight under megatron-core's 1F1B schedule; defined once for the memory walk and MoE replay.

Stages take consecutive layers; an uneven split gives the first stages one more layer, as vLLM's ``get_pp_indices``
does (megatron-core refuses an uneven split unless its first/last stage sizes are given). The first stage also runs
the embedding, the last the LM head and the log-prob.

1F1B (megatron-core ``forward_backward_pipelining_without_interleaving``): stage ``s`` of ``p`` first runs
``min(p - s - 1, m)`` warm-up forwards of its ``m`` micro-batches, then alternates one forward and one backward, then
drains the warm-up backwards. A micro-batch's activations live from its forward to its backward, so at its peak the
stage holds ``min(p - s, m)`` micro-batches' activations: an early stage holds more of them than the last one (which
holds one), and can peak higher though the last stage also holds the logits. A forward-only call keeps nothing for a
backward: one micro-batch at a time on every stage.

When several stages run out of memory in one call, the one that fails first in time stops a real job:
``event_starts`` places every stage's forwards and backwards on one clock (each waits for its own stage's previous
event and for the neighbour it receives from), so the first failure can be named.

The interleaved schedule (virtual pipeline stages) is not modelled: ``refuse_virtual_stages`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skyrl_sim.schema.architecture import ModelArch
    from skyrl_sim.schema.endpoint import Endpoint

VIRTUAL_STAGES_KEY = "virtual_pipeline_model_parallel_size"


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its index, its decoder layers, and whether it runs the embedding and the LM head."""

    index: int
    layers: range
    first: bool
    last: bool


def pipeline_stages(num_layers: int, pp: int) -> list[range]:
    """Consecutive layers of each of ``pp`` stages; an uneven split gives the first stages one more."""
    if pp > num_layers:
        raise ValueError(f"pipeline parallel size {pp} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    stages: list[range] = []
    start = 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def stage_plan(num_layers: int, pp: int) -> list[Stage]:
    """Every stage of a ``pp``-stage pipeline: layers (``pipeline_stages``), the embedding on the first, the head on
    the last (one stage holds both when ``pp`` is 1)."""
    return [Stage(s, layers, s == 0, s == pp - 1) for s, layers in enumerate(pipeline_stages(num_layers, pp))]


def warmup_microbatches(stage: int, pp: int, num_microbatches: int) -> int:
    """1F1B's warm-up forwards on ``stage``: ``p - s - 1``, at most the number of micro-batches."""
    _check_stage(stage, pp, num_microbatches)
    return min(pp - stage - 1, num_microbatches)


def in_flight_microbatches(stage: int, pp: int, num_microbatches: int, forward_only: bool = False) -> int:
    """The most micro-batches whose activations ``stage`` holds at once under 1F1B: the warm-up forwards plus the one
    of the steady state (``min(p - s, m)``); one in a forward-only call (nothing waits for a backward)."""
    _check_stage(stage, pp, num_microbatches)
    if num_microbatches == 0:
        return 0
    return 1 if forward_only else min(pp - stage, num_microbatches)


def stage_order(stage: int, pp: int, num_microbatches: int, forward_only: bool = False) -> list[tuple[str, int]]:
    """The events of ``stage`` in 1F1B's order: ``("forward", k)`` and ``("backward", k)`` (forwards only in a
    forward-only call)."""
    if forward_only:
        return [("forward", k) for k in range(num_microbatches)]
    warmup = warmup_microbatches(stage, pp, num_microbatches)
    order = [("forward", k) for k in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    return order + [("backward", k) for k in range(num_microbatches - warmup, num_microbatches)]


def event_starts(
    costs: Sequence[Sequence[tuple[float, float]]], forward_only: bool = False
) -> dict[tuple[int, str, int], float]:
    """When each event of a 1F1B call starts, on one clock: ``costs[s][k]`` is micro-batch ``k``'s forward and backward
    cost on stage ``s``. A stage runs its events in ``stage_order``; a forward waits for the previous stage's forward
    of the same micro-batch (its input), a backward for the next stage's backward (its output's gradient). Keys are
    ``(stage, phase, micro-batch)``."""
    pp = len(costs)
    orders = [stage_order(s, pp, len(costs[s]), forward_only) for s in range(pp)]
    ends: dict[tuple[int, str, int], float] = {}
    starts: dict[tuple[int, str, int], float] = {}
    free = [0.0] * pp
    position = [0] * pp
    while any(position[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if position[s] == len(orders[s]):
                continue
            phase, k = orders[s][position[s]]
            needs = (s - 1, "forward", k) if phase == "forward" else (s + 1, "backward", k)
            if 0 <= needs[0] < pp and needs not in ends:
                continue
            start = max(free[s], ends.get(needs, 0.0))
            starts[(s, phase, k)] = start
            ends[(s, phase, k)] = free[s] = start + costs[s][k][0 if phase == "forward" else 1]
            position[s] += 1
            progressed = True
        if not progressed:
            raise ValueError("the stages' micro-batch counts differ: 1F1B cannot pair their sends and receives")
    return starts


def _check_stage(stage: int, pp: int, num_microbatches: int) -> None:
    if pp < 1 or not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} is not one of {pp} stages")
    if num_microbatches < 0:
        raise ValueError(f"a call cannot have {num_microbatches} micro-batches")


def stage_layers(model: ModelArch, endpoint: Endpoint) -> list[int]:
    """Layer indices on the last pipeline stage (it also runs the LM head): the stage the adapter-state sizes of
    tenancy and colocation follow."""
    return list(pipeline_stages(model.num_layers, endpoint.parallelism.pp)[-1])

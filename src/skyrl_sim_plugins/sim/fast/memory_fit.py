"""A call answered from its micro-batches' effects: the memory walk's fast path for a call that fits.

Each micro-batch shape's whole walk is one allocator ``Effect`` (``memory_lanes``, kept per endpoint by the bound
model); when every micro-batch of every rank fits, applying the effects in order gives the report a step-by-step walk
(``reference.memory_walk.walk_ranks``) gives, in a few integer operations, and its timeline is made only when someone
reads it (``fitted_timeline``). ``fit_ranks`` returns None where the effects cannot answer (a micro-batch or the
static memory does not fit, a size past the lanes' exact range): the caller walks the call step by step.
``tests/test_memory_lanes.py`` holds this path to the walk.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any, NamedTuple

from skyrl_sim.api import CallShape, CarriedMemory, Endpoint, ModelArch
from skyrl_sim_plugins.sim.fast.memory_lanes import LaneResult, TileDetail
from skyrl_sim_plugins.sim.reference.allocator import AllocatorState, Effect
from skyrl_sim_plugins.sim.reference.memory_walk import EndpointFacts, StartOf
from skyrl_sim_plugins.sim.reference.segments import (
    BUFFER_LAYER,
    INPUTS_LAYER,
    REPLAY_LAYER,
    Segment,
    SegmentLayout,
    buffer_growth,
    microbatch_dims,
    shifted_growth,
    short_rows,
    timeline_rows,
)


class FittedMicroBatch(NamedTuple):
    """A micro-batch applied from its effect: the allocated bytes before it, its peak above them, and what its
    timeline needs (its lane of a tile, its replay and buffer-growth segments). A named tuple: one is made per
    fitting micro-batch, so construction is hot."""

    allocated_before: int
    peak: int
    detail: TileDetail
    lane: int
    replay: tuple[Segment, Segment] | None
    growth: Segment | None


FittedRank = tuple[int, AllocatorState, dict[str, int], list[FittedMicroBatch]]
"""A rank's index, its allocator after its micro-batches, the buffers it holds then, its micro-batches as applied."""
EffectOf = Callable[[int, int, int, tuple[int, ...]], LaneResult]
"""A micro-batch shape's effect (rows, width, logits width, its rows' shortfalls where the head reads them:
``MicroBatchEffects.get``)."""
ReplayOf = Callable[[int], tuple[Segment, Segment] | None]
"""A micro-batch's routed-expert replay setup and release, by its token slots (``segments.replay_segments``)."""


def fit_ranks(
    shape: CallShape,
    endpoint: Endpoint,
    model: ModelArch,
    facts: EndpointFacts,
    effect_of: EffectOf,
    start_of: StartOf,
    replay_of: ReplayOf,
    before: CarriedMemory,
) -> list[FittedRank] | None:
    """Each data-parallel rank's allocator after its micro-batches, the buffers it holds then, and its
    micro-batches as applied, from their effects (each rank's allocator from ``start_of``, at the capacity of the
    call's device); None when some micro-batch (or the static memory) does not fit."""
    ranks: list[FittedRank] = []
    for rank in range(endpoint.parallelism.dp):
        mbs = shape.microbatches_of_rank(rank)
        if not mbs:
            continue
        held = before.held(rank)
        state = start_of(held)
        if state.reserved > state.capacity:  # ``start_of`` sizes the allocator to the call's device
            return None
        walked: list[FittedMicroBatch] = []
        for mb in mbs:
            short = short_rows(mb, endpoint) if facts.row_tokens else ()
            try:
                effect, detail, lane = effect_of(1 if mb.packed else mb.rows, mb.width, shape.logits_width, short)
            except OverflowError:  # sizes too large for the lanes' exact sums: walk it step by step
                return None
            replay = replay_of(mb.slots) if facts.replays_experts else None
            if replay is not None:
                effect = Effect.of(replay[0].array).then(effect).then(replay[1].array)
            grown, growth = held, None
            if facts.grows_buffer:
                growth, grown = buffer_growth(held, microbatch_dims(mb, shape, endpoint, model), model, endpoint)
                if growth is not None and shifted_growth(growth, model):
                    return None  # it runs inside the micro-batch (``memory_walk.growth_position``): walk it step by step
                if growth is not None:
                    effect = Effect.of(growth.array).then(effect)
            if not state.fits(effect):
                return None
            walked.append(FittedMicroBatch(state.allocated, effect.peak_allocated, detail, lane, replay, growth))
            state.apply(effect)
            held = grown
        ranks.append((rank, state, held, walked))
    return ranks


def fitted_timeline(walked: list[FittedMicroBatch], layout: SegmentLayout) -> list[dict[str, Any]]:
    """The timeline of a rank whose micro-batches all fitted: that of its highest micro-batch (the first of equals),
    made from its lane's step array totals (``TileDetail.lane_totals``) in the order the step-by-step walk applies
    them: the layout's positions, wrapped as ``SegmentOrder.wrapped`` wraps them (the held inputs, then the replay,
    then a buffer's growth, each outside the last). Plain lists: a timeline has a few hundred positions."""
    index = max(range(len(walked)), key=lambda i: walked[i].allocated_before + walked[i].peak)
    mb = walked[index]
    ends, peaks, ops = mb.detail.lane_totals(mb.lane)
    phases = list(mb.detail.phases)
    order, layers = layout.order, layout.layers
    body = len(layout.distinct)
    if mb.detail.inputs:  # its setup and release are the detail's last two step arrays
        order, layers = [body, *order, body + 1], [INPUTS_LAYER, *layers, INPUTS_LAYER]
    for first, last, layer in ((*(mb.replay or (None, None)), REPLAY_LAYER), (mb.growth, None, BUFFER_LAYER)):
        before: list[int] = []
        after: list[int] = []
        for segment, where in ((first, before), (last, after)):
            if segment is not None:
                where.append(len(ends))
                ends.append(segment.array.end_allocated)
                peaks.append(segment.array.peak_allocated)
                ops.append(segment.array.peak_op)
                phases.append(segment.phase)
        order = before + order + after
        layers = [layer] * len(before) + layers + [layer] * len(after)
    bases = list(accumulate([ends[i] for i in order], initial=mb.allocated_before))  # before each, and after the last
    tops = [base + peaks[i] for base, i in zip(bases[:-1], order, strict=True)]
    return timeline_rows(index, phases, ops, order, layers, bases[1:], tops)

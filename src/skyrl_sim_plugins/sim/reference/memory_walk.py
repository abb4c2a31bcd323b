"""Memory model of one backend call, the reference: the allocation walk, step by step.

On every data-parallel rank (of one pipeline stage, or of the whole model), a rank's allocator starts from its static
memory (``static_memory``) and the buffers earlier calls left, and the segments of its micro-batches
(``segments``) are applied to it in execution order, each micro-batch wrapped in what holds beside it (its routed-
expert replay, the activations 1F1B keeps in flight, a stage's sends and receives, a persistent buffer's growth).
Allocations are rounded as the device's allocator rounds them (``device_memory.endpoint_allocator``); a call fails at
the first allocation whose reserved memory would pass the endpoint's capacity (device memory minus the non-PyTorch
reserve): the segment that does not fit is scanned step by step to name the failing allocation (``walk_rank``), and
the report names it the way PyTorch does (``device_memory.oom_message``).

This module is the walk's meaning. Results are those of a step-by-step walk (``tests/test_walk_compiled.py``); the
fast path that answers a fitting call from its micro-batches' effects (``fast.memory_lanes``, ``fast.memory_fit``)
is held to this walk (``tests/test_memory_lanes.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from skyrl_sim.api import (
    CallShape,
    CarriedMemory,
    DeviceMemory,
    Endpoint,
    MemoryReport,
    MicroBatch,
    ModelArch,
    OomRecord,
    Stage,
    event_starts,
    stage_layers,
    warmup_microbatches,
)
from skyrl_sim_plugins.sim.description.trainers import LAZY_CATEGORIES, after_backward, trainer_of
from skyrl_sim_plugins.sim.reference.allocator import CATEGORIES, AllocatorRule, AllocatorState, Failure
from skyrl_sim_plugins.sim.reference.device_memory import endpoint_allocator, oom_message
from skyrl_sim_plugins.sim.reference.memory_fsdp import fsdp_positions
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, reads_row_tokens, scores_buffer
from skyrl_sim_plugins.sim.reference.segments import (
    BUFFER_LAYER,
    IN_FLIGHT_LAYER,
    P2P_LAYER,
    REPLAY_LAYER,
    Segment,
    SegmentLayout,
    SegmentOrder,
    ShapeKey,
    ShapeSegments,
    buffer_growth,
    growth_position,
    in_flight_residue,
    in_flight_segments,
    microbatch_dims,
    replay_segments,
    shape_key,
)
from skyrl_sim_plugins.sim.reference.static_memory import static_bytes


@dataclass(frozen=True)
class EndpointFacts:
    """What a walk needs of one endpoint and model that no call changes: the stage's layers and their kinds, the
    static bytes, the layouts of a training and of a forward-only pass, and what may wrap a micro-batch."""

    layers: list[int]
    kinds: list[tuple[str, bool]]
    static: dict[str, int]
    layout: SegmentLayout  # a training pass (on SkyRL's RL path too: the head's segments differ, not their order)
    forward_layout: SegmentLayout  # a forward-only pass (``forward`` calls): no backward segments
    grows_buffer: bool  # some micro-batch may grow megatron's persistent scores buffer (``buffer_growth``)
    replays_experts: bool  # an MoE model: a micro-batch may replay its routed experts (``replay_segments``)
    allocator: AllocatorRule  # how the endpoint's device sizes requests (``allocator.allocator_rule``)
    stage: Stage | None = None  # the pipeline stage walked; None: the whole model
    row_tokens: bool = False  # the LM head reads each row's tokens (``memory_ops.reads_row_tokens``)

    @classmethod
    def of(cls, endpoint: Endpoint, model: ModelArch, stage: Stage | None = None) -> EndpointFacts:
        """The endpoint's facts; of one pipeline ``stage`` when given (its layers, its static memory, its sends and
        receives), else of the whole model as the last stage sees it."""
        layers = stage_layers(model, endpoint) if stage is None else list(stage.layers)
        first, last = (True, True) if stage is None else (stage.first, stage.last)
        kinds = [(model.layer_types[i], model.is_moe_layer(i)) for i in layers]
        gathers = model.moe is not None and endpoint.parallelism.tp * endpoint.parallelism.ep > 1  # the MoE dispatch
        if trainer_of(endpoint).model_code == "hf":  # the FSDP trainer: its own order, no megatron buffer
            keep = not endpoint.trainer.fsdp.reshard_after_forward
            untied, flat = not model.tied_embeddings, endpoint.parallelism.dp > 1
            return cls(
                layers,
                kinds,
                static_bytes(model, endpoint, stage),
                SegmentLayout.from_positions(fsdp_positions(layers, kinds, False, untied, keep, flat)),
                SegmentLayout.from_positions(fsdp_positions(layers, kinds, True, untied, keep, flat)),
                False,
                False,
                endpoint_allocator(endpoint),
                stage,
            )
        return cls(
            layers,
            kinds,
            static_bytes(model, endpoint, stage),
            SegmentLayout.of(layers, kinds, False, first, last),
            SegmentLayout.of(layers, kinds, True, first, last),
            scores_buffer(Dims.of(endpoint, model, 1, 1, 0), model, int(gathers)) is not None,
            model.moe is not None,
            endpoint_allocator(endpoint),
            stage,
            reads_row_tokens(endpoint),
        )

    def pass_layout(self, shape: CallShape) -> SegmentLayout:
        """The layout of the call's pass: forward-only for a ``forward`` call, a training pass otherwise."""
        return self.forward_layout if shape.kind == "forward" else self.layout

    def start(self, held: dict[str, int], capacity: int) -> AllocatorState:
        """A rank's allocator before its first micro-batch: the static memory, then the buffers earlier calls left."""
        state = AllocatorState(capacity=capacity, rule=self.allocator)
        for category, nbytes in self.static.items():  # weights, adapters; full fine-tuning's gradients and optimizer
            if nbytes or category in ("weights", "adapters"):
                state.hold(nbytes, category)
        buffers = sum(size for name, size in held.items() if name not in LAZY_CATEGORIES)
        if buffers:
            state.hold(buffers, "persistent_buffers")
        for name in LAZY_CATEGORIES:  # a trainer's lazily made state (FSDP's gradients, Adam's moments)
            if held.get(name):
                state.hold(held[name], name)
        return state


SegmentsOf = Callable[[Dims, bool], ShapeSegments]
"""A micro-batch shape's compiled segments (its dims, whether the pass is forward-only): ``build_segments`` for the
endpoint, kept per shape by the bound model."""


StartOf = Callable[[dict[str, int]], AllocatorState]
"""A rank's allocator before its first micro-batch, given the buffers earlier calls left (``EndpointFacts.start``
at the endpoint's capacity, a fresh copy of a state the bound model keeps)."""


def walk_ranks(
    shape: CallShape,
    endpoint: Endpoint,
    model: ModelArch,
    carried: CarriedMemory | None,
    facts: EndpointFacts,
    segments_of: SegmentsOf,
    start_of: StartOf,
    device: DeviceMemory,
) -> MemoryReport:
    """The call walked step by step on every data-parallel rank of one endpoint (the whole model, or one pipeline
    stage) on ``device`` (``start_of`` gives each rank's allocator at its capacity): the report of the rank that fails
    first, else of the one that peaks highest, and the buffers every rank carries after it."""
    before = carried or CarriedMemory()
    after = before
    reports = []
    for rank in range(endpoint.parallelism.dp):
        mbs = shape.microbatches_of_rank(rank)
        if mbs:
            held = before.held(rank)
            report = walk_rank(mbs, shape, endpoint, model, facts, segments_of, start_of(held), rank, held, device)
            after = after.with_rank(rank, report.carried.held(rank))
            reports.append(report)
    failed = [r for r in reports if r.oom is not None]
    if failed:
        chosen = min(failed, key=lambda r: r.progress)
    elif reports:
        chosen = max(reports, key=lambda r: r.peak_bytes)
    else:
        chosen = MemoryReport(peak_bytes=sum(facts.static.values()) + before.total(0))
    chosen.carried = after
    return chosen


def microbatch_orders(
    mbs: list[MicroBatch],
    shape: CallShape,
    endpoint: Endpoint,
    model: ModelArch,
    facts: EndpointFacts,
    segments_of: SegmentsOf,
) -> tuple[dict[ShapeKey, ShapeSegments], list[SegmentOrder]]:
    """The segments of each micro-batch shape of a rank, and each micro-batch's order in the call's pass
    (micro-batches of one shape share their step arrays)."""
    layout = facts.pass_layout(shape)
    forward_only = layout is facts.forward_layout
    shapes: dict[ShapeKey, ShapeSegments] = {}
    orders = []
    for mb in mbs:
        key = shape_key(mb, endpoint)
        plan = shapes.get(key)
        if plan is None:
            plan = shapes[key] = segments_of(microbatch_dims(mb, shape, endpoint, model), forward_only)
        orders.append(plan.order(layout))
    return shapes, orders


def failure_time(
    report: MemoryReport,
    shape: CallShape,
    endpoint: Endpoint,
    model: ModelArch,
    stages: list[tuple[EndpointFacts, SegmentsOf]],
) -> tuple[float, int]:
    """When a pipeline stage's failure happens in the call (``pipeline.event_starts``: the failing micro-batch's
    forward or backward on that stage, each event costing its segments' work), then its stage: the order in which
    the stages' failures would stop the job."""
    assert report.oom is not None
    where = report.oom.where
    stage = int(where.get("pp_stage", 0))
    if where.get("phase") == "load":
        return (-1.0, stage)
    mbs = shape.microbatches_of_rank(int(where.get("dp_rank", 0)))
    costs = [
        [order.phase_work for order in microbatch_orders(mbs, shape, endpoint, model, facts, segments_of)[1]]
        for facts, segments_of in stages
    ]
    starts = event_starts(costs, shape.kind == "forward")
    return (starts[(stage, str(where["phase"]), int(where["microbatch"]))], stage)


def walk_rank(
    mbs: list[MicroBatch],
    shape: CallShape,
    endpoint: Endpoint,
    model: ModelArch,
    facts: EndpointFacts,
    segments_of: SegmentsOf,
    state: AllocatorState,
    rank: int,
    held: dict[str, int],
    device: DeviceMemory,
) -> MemoryReport:
    """One rank's micro-batches walked in order from ``state`` (its allocator before them, at ``device``'s
    capacity): every segment applied, the failing one scanned to name the allocation that fails, and the timeline of
    the failing or highest micro-batch."""
    static = facts.static
    if state.reserved > state.capacity:
        attempted = static["weights"] + static["adapters"]
        where = {
            "phase": "load",
            "layer": "static",
            "op": "weights",
            "shape": [],
            "dtype": endpoint.trainer.params_dtype,
        }
        if facts.stage is not None:
            where["pp_stage"] = facts.stage.index
        oom = OomRecord(attempted, where, oom_message(attempted, 0, 0, endpoint, device), 0, device.capacity_bytes)
        report = MemoryReport(peak_bytes=attempted, breakdown=dict(static), oom=oom, progress=0.0)
        report.carried = CarriedMemory().with_rank(rank, held)
        return report
    shapes, orders = microbatch_orders(mbs, shape, endpoint, model, facts, segments_of)
    total_work = sum(order.work for order in orders)
    walked: list[tuple[SegmentOrder, np.ndarray, int]] = []  # each micro-batch's order, bases, peak
    stage = facts.stage
    for item in wrapped_orders(mbs, shape, endpoint, model, facts, shapes, orders, held):
        index, order, growth, grown = item.index, item.order, item.growth, item.grown
        applied, bases = state.run_sequence(order.sequence)
        if growth is None or applied > 0:  # a buffer that failed to grow keeps its old size
            held = grown
        if applied < len(order.layers):
            segment, layer = order.segments[applied]
            base = state.allocated
            failure = state.run(segment.array)
            assert failure is not None, "a segment that does not fit fails at one of its allocations"
            rows = order.timeline(bases, applied, index)
            rows.extend(failure_rows(segment, failure, layer, index, base))
            done = 0.0  # the work done, summed segment by segment in walk order
            for previous, _, _ in walked:
                for s, _ in previous.segments:
                    done += s.array.work
            for s, _ in order.segments[:applied]:
                done += s.array.work
            done += segment.array.work * (failure.index / max(1, len(segment.array.allocated)))
            oom = oom_record(segment, failure, layer, index, rank, endpoint, device)
            if stage is not None:
                oom.where["pp_stage"] = stage.index
                oom.where["in_flight_microbatches"] = item.in_flight
            return rank_report(state, rows, oom, done / total_work if total_work else 0.0, rank, held)
        peaks = bases[:-1] + order.sequence.peak_allocated
        walked.append((order, bases, int(peaks.max())))
    if facts.pass_layout(shape) is not facts.forward_layout:  # the gradients a trainer makes on the way (FSDP's)
        held = after_backward(held, model, endpoint)  # exist from now on
    if not walked:
        return rank_report(state, [], None, 1.0, rank, held)
    worst = max(range(len(walked)), key=lambda i: walked[i][2])
    order, bases, _ = walked[worst]
    return rank_report(state, order.timeline(bases, len(order.layers), worst), None, 1.0, rank, held)


@dataclass(frozen=True)
class WrappedMicroBatch:
    """One micro-batch of a rank's call as the walk applies it: its order with what wraps it (routed-expert replay,
    the activations 1F1B keeps in flight, the previous micro-batch's pipeline tensors, a persistent buffer's growth)."""

    index: int
    order: SegmentOrder
    growth: Segment | None  # the persistent buffer's growth before it, if any
    grown: dict[str, int]  # the buffers held once it has run (its growth applied)
    in_flight: int  # micro-batches whose activations 1F1B holds while it runs (itself included)


def wrapped_orders(
    mbs: list[MicroBatch],
    shape: CallShape,
    endpoint: Endpoint,
    model: ModelArch,
    facts: EndpointFacts,
    shapes: dict[ShapeKey, ShapeSegments],
    orders: list[SegmentOrder],
    held: dict[str, int],
) -> Iterator[WrappedMicroBatch]:
    """A rank's micro-batches in call order, each wrapped as the walk applies it (``microbatch_orders`` gives
    ``shapes`` and ``orders``), from the buffers ``held`` before the call; each growth is taken as applied (a walk
    stops at the micro-batch whose growth fails). One definition for the walk and the classic allocator's replay."""
    forward_only = facts.pass_layout(shape) is facts.forward_layout
    stage = facts.stage
    warmup = 0 if stage is None or forward_only else warmup_microbatches(stage.index, endpoint.parallelism.pp, len(mbs))
    replays = [replay_segments(mb.slots, endpoint, model, stage) for mb in mbs]
    residues = [in_flight_residue(o, r) for o, r in zip(orders, replays, strict=True)] if warmup else []
    for index, order in enumerate(orders):
        replay = replays[index]
        if replay is not None:
            order = order.wrapped(replay[0], replay[1], REPLAY_LAYER)
        others = residues[index + 1 : index + 1 + warmup] if warmup else []
        if others:
            hold, release = in_flight_segments(others, endpoint)
            order = order.wrapped(hold, release, IN_FLIGHT_LAYER)
        if stage is not None and index:  # what megatron's 1F1B loop still references of the previous micro-batch
            previous = shapes[shape_key(mbs[index - 1], endpoint)].p2p
            if not stage.first and not forward_only:
                order = order.wrapped(previous["input_grad_held"], previous["input_grad_released"], P2P_LAYER)
            elif not stage.last and forward_only:
                order = order.wrapped(previous["output_held"], previous["output_dropped"], P2P_LAYER)
        growth, grown = buffer_growth(held, microbatch_dims(mbs[index], shape, endpoint, model), model, endpoint)
        if growth is not None:
            position = growth_position(order.layers, growth, model)
            order = order.inserted(growth, position, BUFFER_LAYER) if position else order.wrapped(growth, None, BUFFER_LAYER)
        yield WrappedMicroBatch(index, order, growth, grown, 1 + len(others))
        held = grown


def failure_rows(segment: Segment, failure: Failure, layer: Any, index: int, base: int) -> list[dict[str, Any]]:
    """Every step of the failing segment up to and including the allocation that failed."""
    rows = []
    array = segment.array
    for i, step in enumerate(array.steps[: failure.index + 1]):
        allocated = base + (int(array.cum_allocated[i - 1]) if i else 0) + step.nbytes
        rows.append(
            {
                "microbatch": index,
                "phase": segment.phase,
                "layer": layer,
                "op": step.op,
                "bytes": step.nbytes,
                "allocated": allocated,
                "stage": "recompute" if i < segment.recompute_steps else segment.phase,
                "failed": i == failure.index,
            }
        )
    return rows


def oom_record(
    segment: Segment, failure: Failure, layer: Any, index: int, rank: int, endpoint: Endpoint, device: DeviceMemory
) -> OomRecord:
    """The failing allocation as an OOM record: where it is (phase, layer, op, shape, dtype, micro-batch, rank) and
    PyTorch's message."""
    step = failure.step
    where = {
        "phase": segment.phase,
        "stage": "recompute" if failure.index < segment.recompute_steps else segment.phase,
        "layer": layer,
        "op": step.op,
        "shape": list(step.shape),
        "dtype": step.dtype,
        "microbatch": index,
        "dp_rank": rank,
    }
    message = oom_message(step.nbytes, failure.allocated_before, failure.reserved_before, endpoint, device)
    return OomRecord(
        attempted_bytes=step.nbytes,
        where=where,
        message=message,
        allocated_bytes=failure.allocated_before,
        capacity_bytes=device.capacity_bytes,
    )


def rank_report(
    state: AllocatorState,
    timeline: list[dict[str, Any]],
    oom: OomRecord | None,
    progress: float,
    rank: int,
    held: dict[str, int],
) -> MemoryReport:
    """A rank's report from its allocator after the walk."""
    return MemoryReport(
        peak_bytes=state.peak_allocated,
        breakdown=breakdown(state),
        oom=oom,
        progress=min(1.0, progress),
        timeline=timeline,
        carried=CarriedMemory().with_rank(rank, held),
    )


OPTIONAL_CATEGORIES = (
    "routed_expert_replay",
    "persistent_buffers",
    "gradients",
    "optimizer_state",
    "fsdp_units",
    "master_weights",
)
"""Breakdown categories reported only where the trainer or the model has them."""


def breakdown(state: AllocatorState) -> dict[str, int]:
    """A report's breakdown: bytes per category at the rank's peak (the optional terms only when present), then
    the peak reserved bytes."""
    out = dict(zip(CATEGORIES, state.peak_categories, strict=True))
    for optional in OPTIONAL_CATEGORIES:
        if not out[optional]:
            del out[optional]  # dense models, replay off, no unfused attention, LoRA, Megatron: no such term
    out["reserved"] = state.peak_reserved
    return out


def empties_cache(endpoint: Endpoint) -> bool:
    """Whether the worker empties PyTorch's caching allocator after each call: ``trainer.empty_cuda_cache``, or the
    endpoint's SkyRL version's default (``SkyrlRules.empty_cuda_cache``)."""
    setting = endpoint.trainer.empty_cuda_cache
    return endpoint.rules.empty_cuda_cache if setting is None else setting


def reserved_after_call(report: MemoryReport, endpoint: Endpoint, model: ModelArch) -> int:
    """What PyTorch's caching allocator keeps reserved on the worker between this call and the next: what other users
    of the device (a colocated vLLM waking up) cannot have.

    SkyRL calls ``torch.cuda.empty_cache()`` at the end of a forward or forward_backward that returns
    (``empty_cuda_cache``): the reserve falls back to what stays allocated, the static memory and the persistent
    buffers the call leaves (``report.carried``), rounded to the allocator's pages, on the rank that holds most. A
    call that raised (an OOM) never reaches it, and without ``empty_cuda_cache`` nothing returns the cached blocks:
    the reserve stays at the call's peak reserve (``breakdown['reserved']``)."""
    rule = endpoint_allocator(endpoint)
    if report.oom is not None or not empties_cache(endpoint):
        return report.breakdown.get("reserved", rule.reserved(report.peak_bytes))
    static = static_bytes(model, endpoint)
    kept = rule.reserved(static["weights"]) + rule.reserved(static["adapters"])
    held = [report.carried.held(rank) for rank in range(endpoint.parallelism.dp)]
    return kept + max(rule.reserved(sum(buffers.values())) if buffers else 0 for buffers in held)

"""The memory model bound to an endpoint: the allocation walk behind caches, as a run asks for it.

``AllocationWalk`` is the ``MemoryModel`` the simulator runs (``plugin_host.costs``). A run binds it once to its
endpoint and model (``bind``): the ``BoundWalk`` it gets holds a ``BoundEndpoint``, the walk's facts
(``reference.memory_walk.EndpointFacts``) and, per pass, each micro-batch shape's whole walk as one effect
(``memory_effects.MicroBatchEffects``), and answers every call of the run on the device memory the call may use
(``DeviceMemory``, in bytes: the endpoint's own, or less once a colocated vLLM keeps its share). A call is first
answered from its micro-batches' effects (``fast.memory_fit``): when every micro-batch fits, the report follows in a
few integer operations and its timeline is made only if someone reads it (``MemoryReport.resolve_timeline``). A call
that does not fit (or fails before its first micro-batch), and every call of a pipeline-parallel endpoint, is walked
step by step by the reference (``memory_walk.walk_ranks``) to name the failing allocation.

Caches, every one a ``BoundedCache``: per endpoint settings its ``BoundWalk`` (``cache.EndpointBinding``, for
questions asked without a bound model; a run keeps its own) with a ``BoundEndpoint`` (and one per pipeline stage); per
micro-batch shape its compiled segments; per graph topology its compiled plan (``PlanCache``, shared by every walk
of the process), so a shape never seen before costs its graphs' sizes and a few array operations, not a liveness
analysis; per endpoint the allocator's start per capacity and held buffers, and the replay segments per slot count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from skyrl_sim.api import CallShape, CarriedMemory, DeviceMemory, Endpoint, MemoryReport, ModelArch, Stage, stage_plan
from skyrl_sim_plugins.sim.bound.binding import Binding
from skyrl_sim_plugins.sim.bound.cache import BoundedCache, EndpointBinding
from skyrl_sim_plugins.sim.bound.memory_effects import MicroBatchEffects
from skyrl_sim_plugins.sim.fast.memory_fit import fit_ranks, fitted_timeline
from skyrl_sim_plugins.sim.reference.allocator import AllocatorState
from skyrl_sim_plugins.sim.reference.memory_graph import CompiledPlan, Graph, Recipe
from skyrl_sim_plugins.sim.reference.memory_ops import Dims
from skyrl_sim_plugins.sim.reference.memory_walk import EndpointFacts, SegmentsOf, breakdown, failure_time, walk_ranks
from skyrl_sim_plugins.sim.reference.segments import (
    Segment,
    SegmentLayout,
    ShapeSegments,
    body_specs,
    build_segments,
    head_specs,
    replay_segments,
)

WALK_CACHE = 4096
"""Entries of the small per-endpoint caches (allocator starts, replay segments)."""
PLAN_CACHE = 256
"""Compiled plans kept per process (one per layer kind, setting and recipe)."""


class PlanCache:
    """Compiled plans by graph topology and recipes: the liveness analysis runs once per layer kind and setting,
    not once per micro-batch shape (a ``memory_graph.PlanSource``)."""

    def __init__(self, max_entries: int = PLAN_CACHE) -> None:
        self._plans: BoundedCache[tuple[object, ...], CompiledPlan] = BoundedCache(max_entries)

    def compile(self, graph: Graph, recipes: tuple[Recipe, ...]) -> CompiledPlan:
        key = (graph.topology(), recipes)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans.put(key, CompiledPlan.of(graph, recipes))
        return plan


SHARED_PLANS = PlanCache()
"""The step plans of every ``AllocationWalk`` in the process. A backend (and its walk) is made per run, so a check of
1,000 variants made 1,000 walks; the liveness analysis of a topology is the same for all of them."""


@dataclass
class BoundEndpoint:
    """One endpoint and model bound for the walk: its facts (``EndpointFacts``), and (filled as calls come) each
    micro-batch shape's whole walk as one effect, per pass."""

    facts: EndpointFacts
    effects: MicroBatchEffects
    rl_effects: MicroBatchEffects  # the same for calls on SkyRL's RL path (their head computes an entropy)
    forward_effects: MicroBatchEffects  # a forward-only pass (``forward`` calls)
    replays: BoundedCache[int, tuple[Segment, Segment] | None] = field(
        default_factory=lambda: BoundedCache(WALK_CACHE)
    )  # by slots: setup, release
    starts: BoundedCache[tuple[Any, ...], AllocatorState] = field(
        default_factory=lambda: BoundedCache(WALK_CACHE)
    )  # by capacity and held buffers

    @classmethod
    def of(
        cls, endpoint: Endpoint, model: ModelArch, plans: PlanCache, stage: Stage | None = None
    ) -> BoundEndpoint:
        """The endpoint's facts (of one pipeline ``stage`` when given; only the step-by-step walk reads such a one)
        and its passes' effects."""
        endpoint = endpoint.model_copy(deep=True)  # the effects are computed later: a caller's edits must not reach them
        facts = EndpointFacts.of(endpoint, model, stage)
        keys = set(facts.kinds)
        passes = []
        for forward_only, rl in ((False, False), (False, True), (True, False)):
            layout = facts.forward_layout if forward_only else facts.layout
            passes.append(
                MicroBatchEffects(
                    endpoint,
                    model,
                    partial(body_specs, model=model, endpoint=endpoint, layer_keys=keys, forward_only=forward_only),
                    partial(head_specs, model=model, forward_only=forward_only),
                    layout.distinct,
                    layout.index,
                    plans.compile,
                    "forward" if forward_only else "backward",
                    rl=rl,
                )
            )
        return cls(facts, *passes)

    def pass_of(self, shape: CallShape) -> tuple[SegmentLayout, MicroBatchEffects]:
        """The layout and effects of the call's pass: forward-only for a ``forward`` call, a training pass (on
        SkyRL's RL path when its loss is not cross-entropy) otherwise."""
        if shape.kind == "forward":
            return self.facts.forward_layout, self.forward_effects
        return self.facts.layout, self.rl_effects if shape.rl_path else self.effects

    def start(self, held: dict[str, int], capacity: int) -> AllocatorState:
        """A rank's allocator before its first micro-batch (``EndpointFacts.start``): a fresh copy of a state kept
        per held buffers."""
        found = self.starts.get_or_make((capacity, *held.items()), lambda: self.facts.start(held, capacity))
        return found.copy()

    def replay(self, slots: int, endpoint: Endpoint, model: ModelArch) -> tuple[Segment, Segment] | None:
        """A micro-batch's routed-expert replay setup and release (``replay_segments``, kept per slot count)."""
        if slots not in self.replays:
            self.replays.put(slots, replay_segments(slots, endpoint, model))
        return self.replays[slots]


class BoundWalk:
    """The memory model bound to one run's endpoint and model (a ``BoundMemoryModel``: ``AllocationWalk.bind``):
    every call of the run asks it, and nothing about the endpoint is recognised again call by call.

    It holds the run's choices (``binding.Binding``: the card, the allocator, the device memory), the endpoint's
    ``BoundEndpoint`` (its facts and each pass's effects; under pipeline parallelism one per stage, made on first
    use), the endpoint's device (``DeviceMemory.of``: a call may be walked on another, in bytes)
    and the walk's shared caches (compiled plans, each micro-batch shape's segments): a bound walk holds no reference
    back to the ``AllocationWalk`` that made it."""

    def __init__(
        self,
        endpoint: Endpoint,
        model: ModelArch,
        bound: BoundEndpoint,
        plans: PlanCache,
        segments: BoundedCache[tuple[Any, ...], ShapeSegments],
    ) -> None:
        self.endpoint = endpoint
        self.model = model
        self.binding = Binding.of(endpoint, model)  # the run's choices, made once
        self.device = self.binding.device
        self.bound = bound
        self._plans = plans
        self._segments = segments
        self._settings = endpoint.model_dump_json()  # the key of this endpoint's shapes in the shared cache
        self._stages: list[BoundEndpoint] | None = None

    @property
    def facts(self) -> EndpointFacts:
        return self.bound.facts

    @property
    def effects(self) -> MicroBatchEffects:
        return self.bound.effects

    @property
    def rl_effects(self) -> MicroBatchEffects:
        return self.bound.rl_effects

    @property
    def forward_effects(self) -> MicroBatchEffects:
        return self.bound.forward_effects

    def stages(self) -> list[BoundEndpoint]:
        """Each pipeline stage's ``BoundEndpoint`` (made on first use; only the step-by-step walk reads them)."""
        if self._stages is None:
            plan = stage_plan(self.model.num_layers, self.endpoint.parallelism.pp)
            self._stages = [BoundEndpoint.of(self.endpoint, self.model, self._plans, stage) for stage in plan]
        return self._stages

    def shape_segments(self, d: Dims, keys: set[tuple[str, bool]], forward_only: bool = False) -> ShapeSegments:
        """One micro-batch shape's compiled segments, cached on everything that decides them: the shape (``d``), the
        whole model (``ModelArch.cache_key``), the whole endpoint, the layer kinds and the pass."""
        endpoint, model = self.endpoint, self.model
        cache_key = (d, model.cache_key, self._settings, frozenset(keys), forward_only)
        return self._segments.get_or_make(
            cache_key, lambda: build_segments(d, model, endpoint, keys, self._plans.compile, forward_only)
        )

    def evaluate(
        self, shape: CallShape, carried: CarriedMemory | None = None, device: DeviceMemory | None = None
    ) -> MemoryReport:
        """The call's memory on every data-parallel rank (the report of the rank that fails first, else of the one
        that peaks highest), starting from what earlier calls left on each rank (``carried``), on ``device`` (the
        endpoint's own when not given), and the state it leaves for the next call (``MemoryReport.carried``). From
        the micro-batches' effects when the call fits (its timeline made only when asked for), else walked step by
        step."""
        endpoint, model = self.endpoint, self.model
        device = device or self.device
        if endpoint.parallelism.pp > 1:
            return self.walk_stages(shape, carried, device)
        bound = self.bound
        before = carried or CarriedMemory()
        capacity = device.capacity_bytes
        layout, effects = bound.pass_of(shape)
        ranks = fit_ranks(
            shape,
            endpoint,
            model,
            bound.facts,
            effects.get,
            lambda held: bound.start(held, capacity),
            lambda slots: bound.replay(slots, endpoint, model),
            before,
        )
        if ranks is None:
            return self.walk(shape, carried, device)
        after = before
        for rank, _, held, _ in ranks:
            if held or after.buffers:  # no buffers before and none held: the state stays empty
                after = after.with_rank(rank, held)
        if not ranks:
            return MemoryReport(peak_bytes=sum(bound.facts.static.values()) + before.total(0), carried=after)
        _, state, _, walked = max(ranks, key=lambda r: r[1].peak_allocated)
        report = MemoryReport(peak_bytes=state.peak_allocated, breakdown=breakdown(state), carried=after)
        report.deferred_timeline = lambda: fitted_timeline(walked, layout)
        return report

    def walk(
        self, shape: CallShape, carried: CarriedMemory | None = None, device: DeviceMemory | None = None
    ) -> MemoryReport:
        """``evaluate`` step by step: every micro-batch's segments applied in order, the failing one scanned to name
        the allocation that fails, and the timeline of the failing or highest micro-batch."""
        device = device or self.device
        if self.endpoint.parallelism.pp > 1:
            return self.walk_stages(shape, carried, device)
        return self.walk_bound(shape, carried, self.bound, device)

    def walk_stages(
        self, shape: CallShape, carried: CarriedMemory | None = None, device: DeviceMemory | None = None
    ) -> MemoryReport:
        """A pipeline-parallel call: every stage walked step by step as its own device (its layers, the embedding on
        the first, the LM head on the last, its sends and receives), with the activations of the micro-batches
        1F1B keeps in flight beside each micro-batch (``memory_walk.walk_rank``'s ``warmup``). The report is the
        failing stage's (the one that fails earliest in the call, the first of equals), else the highest;
        ``stage_peaks`` holds every stage's peak, and a failure's site names its ``pp_stage``."""
        endpoint, model = self.endpoint, self.model
        device = device or self.device
        bounds = self.stages()
        reports = [self.walk_bound(shape, carried, bound, device) for bound in bounds]
        failed = [r for r in reports if r.oom is not None]
        if len(failed) > 1:  # the stage that fails first in the schedule's time stops the job
            stages = [(bound.facts, self.segments_of(bound)) for bound in bounds]
            failed = [min(failed, key=lambda r: failure_time(r, shape, endpoint, model, stages))]
        chosen = failed[0] if failed else max(reports, key=lambda r: r.peak_bytes)
        chosen.stage_peaks = [r.peak_bytes for r in reports]
        chosen.carried = reports[-1].carried  # the buffers a stage keeps do not depend on its layers
        return chosen

    def walk_bound(
        self, shape: CallShape, carried: CarriedMemory | None, bound: BoundEndpoint, device: DeviceMemory | None = None
    ) -> MemoryReport:
        """``walk`` over the ranks of one bound endpoint (the whole model, or one pipeline stage)."""
        device = device or self.device
        capacity = device.capacity_bytes

        def start_of(held: dict[str, int]) -> AllocatorState:
            return bound.start(held, capacity)

        segments_of = self.segments_of(bound)
        return walk_ranks(shape, self.endpoint, self.model, carried, bound.facts, segments_of, start_of, device)

    def segments_of(self, bound: BoundEndpoint) -> SegmentsOf:
        """The segments of a micro-batch's dimensions on one bound endpoint (the whole model, or one stage)."""
        keys = set(bound.facts.kinds)

        def segments_of(d: Dims, forward_only: bool) -> ShapeSegments:
            return self.shape_segments(d, keys, forward_only)

        return segments_of


class AllocationWalk:
    """The simulator's ``MemoryModel``: walks a call's ops as allocations and frees and reports the peak, its
    breakdown and the failing allocation (see the module doc). ``bind`` gives the model of one endpoint
    (``BoundWalk``), which a run makes once and asks about every call.

    ``evaluate`` and ``walk`` (with an endpoint and model) answer one question without keeping the bound model: they
    bind (the endpoint and model asked about last are recognised by identity, any other by its settings: change an
    endpoint by copying it, ``model_copy``, not in place between two calls) and ask it, for a test, a script or a
    calibration that asks about many endpoints.
    """

    def __init__(self, max_cache: int = 256) -> None:
        self._plans = SHARED_PLANS  # a plan depends only on a graph's topology: every walk of the process shares them
        self._segments: BoundedCache[tuple[Any, ...], ShapeSegments] = BoundedCache(max_cache)
        # ``partial``, not a closure over ``self``: a run's walk must not be a reference cycle, or its caches would
        # outlive the run until the collector's next full pass (``plugin_host.virtual_clock.cyclic_gc_paused``).
        self._binding: EndpointBinding[BoundWalk] = EndpointBinding(
            partial(bind_walk, plans=self._plans, segments=self._segments)
        )

    def bind(self, endpoint: Endpoint, model: ModelArch) -> BoundWalk:
        """The model bound to ``endpoint`` and ``model`` (its facts and effects made once, kept per settings)."""
        return self._binding.bind(endpoint, model)

    def evaluate(
        self, shape: CallShape, endpoint: Endpoint, model: ModelArch, carried: CarriedMemory | None = None
    ) -> MemoryReport:
        """``BoundWalk.evaluate`` of the endpoint's bound model, on its own device."""
        return self.bind(endpoint, model).evaluate(shape, carried)

    def walk(
        self, shape: CallShape, endpoint: Endpoint, model: ModelArch, carried: CarriedMemory | None = None
    ) -> MemoryReport:
        """``BoundWalk.walk`` of the endpoint's bound model, on its own device."""
        return self.bind(endpoint, model).walk(shape, carried)


def bind_walk(
    endpoint: Endpoint,
    model: ModelArch,
    plans: PlanCache,
    segments: BoundedCache[tuple[Any, ...], ShapeSegments],
) -> BoundWalk:
    """A ``BoundWalk`` of the endpoint (of a copy: its effects are computed later, a caller's edits must not reach
    them)."""
    return BoundWalk(endpoint, model, BoundEndpoint.of(endpoint, model, plans), plans, segments)


def default_memory_model() -> AllocationWalk:
    return AllocationWalk()

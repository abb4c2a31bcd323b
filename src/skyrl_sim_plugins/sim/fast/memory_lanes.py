"""A micro-batch's whole walk as one allocator ``Effect``, computed for a tile of widths at once.

A run meets thousands of micro-batch shapes that differ only in their width (and rows). Compiling each shape's
step arrays and walking them costs milliseconds; but which tensor is allocated or freed when depends only on a graph's
topology, and the sizes are computed by the same builders for every width. So the builders of ``memory_ops`` run once
for a *tile* of widths: ``Lanes`` holds one int64 value per width (a lane), arithmetic on it is elementwise, and the
graphs come out with one size per lane. The allocation plans are the compiled plans of ``memory_graph.CompiledPlan``;
the per-array totals (peak, reserved, categories at the peak) and their composition over the micro-batch's segments
(``segments.SegmentLayout``) are array operations across the lanes. Every lane's result is an
``allocator.Effect``: the exact integers a step-by-step walk of that shape gives. This module computes; the bound
model (``bound.memory_effects.MicroBatchEffects``) decides which tiles to evaluate and keeps their effects.

Only the LM head reads the logits width, so a tile is cut in two: its body (held inputs, embedding, layers: most of
the work) is computed once per rows and widths (``body_tile``), its head per logits width, and the stretches of body
and head positions compose lane by lane (``LaneStats.then``, ``Effect.then`` on arrays). A single micro-batch's logits
width lies less than TP below its width, so the first call of a tile evaluates the head for every such distance at
once. A tile's effects stay arrays until a shape asks for its lane (``TileEffects``).

Exactness rests on one rule, which binds every builder of ``memory_ops`` and ``memory_logprob`` (their module docs
repeat it): a builder may *decide* something from a size (``if``, ``min``, ``range``, a dict key) only when every
lane decides it the same way. ``Lanes`` refuses any other decision by raising ``Diverged`` with the
lanes grouped by what they would decide; the tile is then evaluated group by group (a width-dependent chunk count
splits a tile into groups of equal count). Any other failure of the lane arithmetic falls back to one lane at a time
with plain integers. ``tests/test_memory_lanes.py`` checks every lane against the compiled walk on many endpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import numpy as np

from skyrl_sim.api import DTYPE_BYTES
from skyrl_sim_plugins.sim.reference.allocator import (
    CATEGORIES,
    CATEGORY_INDEX,
    NEVER,
    AllocatorRule,
    Effect,
)
from skyrl_sim_plugins.sim.reference.memory_graph import Graph, PlanSource, category_split, size_table
from skyrl_sim_plugins.sim.reference.memory_ops import Dims

EXACT = 2**53  # sums of a tile's sizes stay below this (exact in int64 and in float64 alike)
MAX_STEPS = 2**16  # no step array has more steps: a size below EXACT // MAX_STEPS keeps every sum below EXACT
SHORT_SEQUENCE = 4  # positions up to which ``LaneStats.sequence`` folds ``then`` (each ~10 array operations)


class Diverged(Exception):
    """Lanes that would decide differently: ``groups`` are lane indices that decide alike."""

    def __init__(self, groups: list[np.ndarray]) -> None:
        super().__init__(f"lanes diverge into {len(groups)} groups")
        self.groups = groups


class Lanes(np.ndarray):
    """One integer quantity of a tile of micro-batch shapes, one lane per shape. Arithmetic is numpy's, elementwise;
    converting to a Python truth value, int, index or float succeeds only when all lanes agree (``Diverged``)."""

    @classmethod
    def of(cls, values: np.ndarray) -> Lanes:
        return np.asarray(values, dtype=np.int64).view(cls)

    def _agreed(self, flat: np.ndarray | None = None) -> Any:
        flat = self.view(np.ndarray).ravel() if flat is None else flat
        if flat.size and (flat == flat[0]).all():
            return flat[0].item()
        raise Diverged([np.flatnonzero(flat == value) for value in np.unique(flat)])

    def __bool__(self) -> bool:
        return bool(self._agreed(self.view(np.ndarray).ravel() != 0))

    def __index__(self) -> int:
        return int(self._agreed())

    def __int__(self) -> int:
        return int(self._agreed())

    def __float__(self) -> float:
        return float(self._agreed())


@dataclass
class LaneStats:
    """The ``Effect`` fields of one step array (or sequence of step arrays), one column per lane."""

    end_allocated: np.ndarray  # [n]
    end_reserved: np.ndarray
    peak_allocated: np.ndarray
    peak_reserved: np.ndarray
    reserved_to_fit: np.ndarray
    categories_at_peak: np.ndarray  # [categories, n]
    end_categories: np.ndarray  # [categories, n]
    peak_step: np.ndarray | None = None  # a step array's: the step at its peak (-1: never above its start)
    peak_step_bytes: np.ndarray | None = None  # a step array's: that step's bytes (0 when none)

    @classmethod
    def of_steps(
        cls,
        allocated: np.ndarray,
        reserved: np.ndarray,
        category: np.ndarray,
        split: tuple[int, np.ndarray, np.ndarray] | None = None,
    ) -> LaneStats:
        """The totals ``allocator.StepArray`` computes from its steps (``allocated``, ``reserved``: [lanes, steps],
        signed and rounded; lanes first, so running sums run along contiguous memory), for every lane at once.
        ``split``: the categories' ``memory_graph.category_split`` (a compiled plan keeps its own)."""
        n, steps = allocated.shape
        if steps > MAX_STEPS:
            raise OverflowError(f"a step array of {steps} steps is longer than the lanes keep exact")
        if steps == 0:
            zero, cats = np.zeros(n, dtype=np.int64), np.zeros((len(CATEGORIES), n), dtype=np.int64)
            return cls(zero, zero, zero, zero, np.full(n, NEVER, dtype=np.int64), cats, cats, zero - 1, zero)
        cum = np.cumsum(allocated, axis=1)
        cum_reserved = np.cumsum(reserved, axis=1)
        first = cum.argmax(axis=1)
        lanes = np.arange(n)
        top = cum[lanes, first]
        above = top > 0
        peak = np.where(above, top, 0)
        peak_step = np.where(above, first, -1)
        highest = cum_reserved.max(axis=1)
        # A step allocates in every lane or in none (sizes are rounded up to a tile, never 0). The highest running
        # total is reached at an allocation unless that is step 0 and step 0 frees (as ``StepArray`` reasons).
        if allocated[0, 0] > 0:
            to_fit = highest
        else:
            allocating = allocated[0] > 0
            to_fit = cum_reserved[:, allocating].max(axis=1) if allocating.any() else np.full(n, NEVER, dtype=np.int64)
        # Bytes per category: the step array's most frequent category is the total less the others, so only the steps
        # of the other categories are summed per category (a few columns: int64, exact).
        main, others, one_hot = split if split is not None else category_split(category)
        some = allocated[:, others]  # [lanes, other steps]
        at_peak = (some * (others[None, :] <= peak_step[:, None])) @ one_hot  # [lanes, categories]
        at_end = some @ one_hot
        at_peak[:, main] = peak - at_peak.sum(axis=1)
        at_end[:, main] = cum[:, -1] - at_end.sum(axis=1)
        return cls(
            end_allocated=cum[:, -1],
            end_reserved=cum_reserved[:, -1],
            peak_allocated=peak,
            peak_reserved=np.maximum(0, highest),
            reserved_to_fit=to_fit,
            categories_at_peak=at_peak.T,
            end_categories=at_end.T,
            peak_step=peak_step,
            peak_step_bytes=np.where(above, allocated[lanes, first], 0),
        )

    @classmethod
    def sequence(cls, distinct: list[LaneStats], index: np.ndarray) -> LaneStats:
        """``distinct[index[i]]`` run ``i``-th, back to back: ``Effect.then`` over the positions, for every lane.
        A short sequence (the LM head's forward and backward) is folded with ``then``: a few array operations a position
        against some thirty for the whole sequence, the same integers."""
        if len(index) <= SHORT_SEQUENCE:
            first = distinct[index[0]]
            total = cls(*(getattr(first, name) for name in LANE_FIELDS[:7]))  # a sequence has no single peak step
            for i in index[1:].tolist():
                total = total.then(distinct[i])
            return total

        def positions(name: str) -> np.ndarray:  # [lanes, positions]
            return np.stack([getattr(s, name) for s in distinct], axis=1)[:, index]

        end_allocated, end_reserved = positions("end_allocated"), positions("end_reserved")
        before = np.cumsum(end_allocated, axis=1) - end_allocated
        before_reserved = np.cumsum(end_reserved, axis=1) - end_reserved
        peaks = before + positions("peak_allocated")
        first = peaks.argmax(axis=1)
        n, count = peaks.shape
        lanes = np.arange(n)
        end_categories = np.stack([s.end_categories for s in distinct])  # [distinct, categories, lanes]
        ran = np.zeros((count + 1, len(distinct)), dtype=np.int64)  # row p: how often each step array runs before p
        np.cumsum(index[:, None] == np.arange(len(distinct))[None, :], axis=0, out=ran[1:])
        counts = ran[first]  # [lanes, distinct]
        at_first = np.stack([s.categories_at_peak for s in distinct])[index[first], :, lanes].T  # [categories, lanes]
        to_fit = positions("reserved_to_fit")
        fits = np.where(to_fit == NEVER, NEVER, before_reserved + to_fit).max(axis=1)
        return cls(
            end_allocated=end_allocated.sum(axis=1),
            end_reserved=end_reserved.sum(axis=1),
            peak_allocated=peaks[lanes, first],
            peak_reserved=(before_reserved + positions("peak_reserved")).max(axis=1),
            reserved_to_fit=fits,
            categories_at_peak=np.einsum("nd,dcn->cn", counts, end_categories) + at_first,
            end_categories=np.einsum("d,dcn->cn", ran[-1], end_categories),
        )

    def take(self, lanes: np.ndarray) -> LaneStats:
        """These totals for the given lanes, in that order."""
        return LaneStats(
            *(getattr(self, name)[..., lanes] if getattr(self, name) is not None else None for name in LANE_FIELDS)
        )

    def then(self, other: LaneStats) -> LaneStats:
        """These totals followed by ``other``, lane by lane: ``Effect.then`` on arrays (the first peak wins a tie), so a
        sequence can be composed from parts computed apart (``sequence`` of the parts, then ``then``)."""
        shifted = self.end_allocated + other.peak_allocated
        later = shifted > self.peak_allocated
        after = self.end_reserved + other.reserved_to_fit
        mine = self.reserved_to_fit
        to_fit = np.where(other.reserved_to_fit == NEVER, mine, np.where(mine == NEVER, after, np.maximum(mine, after)))
        return LaneStats(
            end_allocated=self.end_allocated + other.end_allocated,
            end_reserved=self.end_reserved + other.end_reserved,
            peak_allocated=np.where(later, shifted, self.peak_allocated),
            peak_reserved=np.maximum(self.peak_reserved, self.end_reserved + other.peak_reserved),
            reserved_to_fit=to_fit,
            categories_at_peak=np.where(later, self.end_categories + other.categories_at_peak, self.categories_at_peak),
            end_categories=self.end_categories + other.end_categories,
        )

    def columns(self) -> TileEffects:
        """Every lane's ``Effect`` fields (``TileEffects``)."""
        scalars = (self.end_allocated, self.end_reserved, self.peak_allocated, self.peak_reserved, self.reserved_to_fit)
        return TileEffects(np.vstack([*scalars, self.categories_at_peak, self.end_categories]).T.copy())


LANE_FIELDS = tuple(f.name for f in fields(LaneStats))


SpecsOf = Callable[[Dims], list[Any]]  # segments.body_specs or head_specs bound to an endpoint, model, layer kinds


@dataclass
class TileDetail:
    """A tile's per-array totals, for the timeline of one of its lanes: per distinct segment (the layout's, then
    the held inputs' setup and release when there are some) its phase, its step labels and its lane totals."""

    phases: list[str]
    labels: list[Callable[[int], str]]
    stats: list[LaneStats]
    inputs: bool  # the last two segments are the held inputs' setup and release

    def lane_totals(self, lane: int) -> tuple[list[int], list[int], list[tuple[str, int]]]:
        """What a timeline (``memory_fit.fitted_timeline``) reads of each step array in one lane: its end and peak allocated
        bytes, and the op and bytes of the step at its peak (``("", 0)`` when it never rises above its start)."""
        row = self._by_lane[lane].tolist()
        k = len(self.stats)
        ops = [
            (label(at), nbytes) if at >= 0 else ("", 0)
            for label, at, nbytes in zip(self.labels, row[2 * k : 3 * k], row[3 * k :], strict=True)
        ]
        return row[:k], row[k : 2 * k], ops

    @cached_property
    def _by_lane(self) -> np.ndarray:
        """[lanes, 4 * step arrays]: every step array's end, peak, peak step and that step's bytes, one row per lane (stacked
        once per tile; a timeline converts one lane's row)."""
        columns = [s.end_allocated for s in self.stats] + [s.peak_allocated for s in self.stats]
        for stats in self.stats:
            assert stats.peak_step is not None and stats.peak_step_bytes is not None
        columns += [s.peak_step for s in self.stats] + [s.peak_step_bytes for s in self.stats]  # type: ignore[misc]
        return np.stack(columns, axis=1)


@dataclass(frozen=True)
class TileEffects:
    """A tile's lanes' ``Effect`` fields, one row per lane (end, reserved end, peak, reserved peak, reserved to
    fit, then the categories at the peak and at the end): ``effect(lane)`` makes one lane's effect. A run asks for a
    few of a tile's lanes, so an effect is made only when its shape comes (from a contiguous row); an array holds no
    Python objects for the garbage collector to walk."""

    fields: np.ndarray  # [lanes, 5 + 2 * categories]

    def effect(self, lane: int) -> Effect:
        values = self.fields[lane].tolist()
        split = 5 + len(CATEGORIES)
        return Effect(*values[:5], tuple(values[5:split]), tuple(values[split:]))


LaneResult = tuple[Effect, TileDetail, int]  # a shape's effect, its tile's detail and its lane there
LaneSlot = tuple[int, int]  # a lane of an evaluated tile (``MicroBatchEffects.evaluated``), its effect not yet made
SegmentDetail = tuple[str, Callable[[int], str], LaneStats]  # a segment's phase, step labels and lane totals
INPUTS_SETUP, INPUTS_RELEASE = ("inputs", "setup"), ("inputs", "release")  # the held inputs' segments, as slots


@dataclass(frozen=True)
class Stretch:
    """Consecutive positions of a micro-batch's sequence that are all body or all head segments: ``slots[index[i]]``
    runs ``i``-th."""

    head: bool
    slots: list[Any]
    index: np.ndarray


@dataclass
class BodyTile:
    """What a tile of widths gives apart from the LM head (which alone reads the logits width): each body segment's
    detail by slot, and the body stretches' totals in execution order (``Stretch``)."""

    segments: dict[Any, SegmentDetail]
    stretches: list[LaneStats]

    def take(self, lanes: np.ndarray) -> BodyTile:
        """This body for the given lanes of it, in that order."""
        segments = {slot: (phase, label, stats.take(lanes)) for slot, (phase, label, stats) in self.segments.items()}
        return BodyTile(segments, [stretch.take(lanes) for stretch in self.stretches])


def plan_label(specs: list[Any]) -> Callable[[int], str]:
    """Step ``i``'s op name of a compiled plan."""
    return lambda i: specs[i].op


def rounded(table: np.ndarray, rule: AllocatorRule) -> tuple[np.ndarray, np.ndarray]:
    """A [lanes, sizes] table of byte sizes (``memory_graph.size_table``) rounded to allocated and reserved bytes by the
    device's allocator rule."""
    if table.size and (table.min() < 0 or table.max() >= EXACT // MAX_STEPS):
        raise OverflowError("a tensor size is outside the range whose sums stay exact")
    return rule.rounded_arrays(table)


def tile_segments(specs: list[Any], n: int, plan_of: PlanSource) -> dict[Any, SegmentDetail]:
    """Each segment spec's phase, step labels and lane totals over ``n`` lanes, by slot (``specs``: the
    ``segments.SegmentSpec``s of a tile's shapes, their sizes ``Lanes``)."""
    tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    out: dict[Any, SegmentDetail] = {}
    for spec in specs:
        graph: Graph = spec.graph
        if id(graph) not in tables:
            tables[id(graph)] = rounded(size_table(graph.size_shapes(), n), graph.allocator)
        allocated, reserved = tables[id(graph)]
        plan = plan_of(graph, spec.recipes)
        sign = plan.sign[None, :]
        # np.take keeps lanes-first (C) order, so running sums run along contiguous memory (fancy indexing would not)
        steps_allocated = np.take(allocated, plan.positions, axis=1) * sign
        steps_reserved = np.take(reserved, plan.positions, axis=1) * sign
        stats = LaneStats.of_steps(steps_allocated, steps_reserved, plan.category, plan.category_split)
        out[spec.slot] = (spec.phase, plan_label(plan.specs), stats)
    return out


def position_stretches(distinct: list[Any], index: np.ndarray, head: frozenset[Any], inputs: bool) -> list[Stretch]:
    """A micro-batch's positions (``distinct[index[i]]`` runs ``i``-th; the held inputs' setup first and release
    last when there are some) cut into stretches of body and of head segments, each with its own slot list."""
    slots = [*distinct, *([INPUTS_SETUP, INPUTS_RELEASE] if inputs else [])]
    order = index.tolist()
    if inputs:
        order = [len(slots) - 2, *order, len(slots) - 1]
    found = []
    start = 0
    for end in range(1, len(order) + 1):
        is_head = slots[order[start]] in head
        if end < len(order) and (slots[order[end]] in head) == is_head:
            continue
        part = order[start:end]
        used = sorted(set(part))
        local = {position: i for i, position in enumerate(used)}
        found.append(Stretch(is_head, [slots[i] for i in used], np.array([local[i] for i in part], dtype=np.int64)))
        start = end
    return found


def body_tile(
    segments: dict[Any, SegmentDetail],
    inputs: tuple[Any, ...],
    d: Any,
    n: int,
    release_phase: str,
    stretches: Callable[[frozenset[Any], bool], list[Stretch]],
    distinct: list[Any],
) -> BodyTile:
    """A tile's body from its segments (``tile_segments`` of the body specs) and the micro-batch's held inputs
    (``memory_ops.microbatch_inputs`` of its dims ``d``; freed in ``release_phase``): the stretches of body positions
    composed, lane by lane."""
    if inputs:
        table = size_table([(shape, DTYPE_BYTES[dtype]) for _, shape, dtype in inputs], n)
        allocated, reserved = rounded(table, d.allocator)
        category = np.full(len(inputs), CATEGORY_INDEX["transient"], dtype=np.int64)
        names = [name for name, _, _ in inputs]
        segments[INPUTS_SETUP] = ("forward", names.__getitem__, LaneStats.of_steps(allocated, reserved, category))
        release = LaneStats.of_steps(-allocated, -reserved, category)
        segments[INPUTS_RELEASE] = (release_phase, names.__getitem__, release)
    head = frozenset(slot for slot in distinct if slot not in segments)
    composed = [
        LaneStats.sequence([segments[slot][2] for slot in stretch.slots], stretch.index)
        for stretch in stretches(head, bool(inputs))
        if not stretch.head
    ]
    return BodyTile(segments, composed)


def tile_total(
    body: BodyTile, head: dict[Any, SegmentDetail], stretches: list[Stretch], distinct: list[Any]
) -> tuple[LaneStats, TileDetail]:
    """A tile's whole micro-batch, lane by lane: its stretches of body and head positions composed in execution order
    (``LaneStats.then``), and the detail a lane's timeline reads."""
    segments = {**body.segments, **head}
    bodies = iter(body.stretches)
    total: LaneStats | None = None
    for stretch in stretches:
        stats = LaneStats.sequence([head[slot][2] for slot in stretch.slots], stretch.index) if stretch.head else None
        part = stats if stats is not None else next(bodies)
        total = part if total is None else total.then(part)
    assert total is not None
    inputs = INPUTS_SETUP in segments
    order = [*distinct, *([INPUTS_SETUP, INPUTS_RELEASE] if inputs else [])]
    phases, labels, stats = (list(column) for column in zip(*(segments[slot] for slot in order), strict=True))
    return total, TileDetail(phases, labels, stats, inputs)

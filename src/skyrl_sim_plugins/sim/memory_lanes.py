"""A micro-batch's whole walk as one allocator ``Effect``, computed for a block of widths at once.

A run meets thousands of micro-batch shapes that differ only in their width (and rows). Compiling each shape's
programs and walking them costs milliseconds; but which tensor is allocated or freed when depends only on a graph's
topology, and the sizes are computed by the same builders for every width. So the builders of ``memory_ops`` run once
for a *block* of widths: ``Lanes`` holds one int64 value per width (a lane), arithmetic on it is elementwise, and the
graphs come out with one size per lane. The allocation plans are the compiled plans of ``memory_graph.PlanCache``; the
per-program totals (peak, reserved, categories at the peak) and their composition over the micro-batch's segments
(``memory.SegmentLayout``) are array operations across the lanes. Every lane's result is an ``allocator.Effect``: the
exact integers a step-by-step walk of that shape gives.

Only the LM head reads the logits width, so a block is cut in two: its body (held inputs, embedding, layers: most of
the work) is computed once per rows and widths (``BodyBlock``), its head per logits width, and the runs of body and
head positions compose lane by lane (``LaneStats.then``, ``Effect.then`` on arrays). A single micro-batch's logits
width lies less than TP below its width, so the first call of a block evaluates the head for every such distance at
once. A block's effects stay arrays until a shape asks for its lane (``BlockEffects``).

Exactness rests on one rule: a builder may *decide* something from a size (``if``, ``min``, ``range``, a dict key)
only when every lane decides it the same way. ``Lanes`` refuses any other decision by raising ``Diverged`` with the
lanes grouped by what they would decide; the block is then evaluated group by group (a width-dependent chunk count
splits a block into groups of equal count). Any other failure of the lane arithmetic falls back to one lane at a time
with plain integers. ``tests/test_memory_lanes.py`` checks every lane against the compiled walk on many endpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.units import DTYPE_BYTES
from skyrl_sim_plugins.sim.allocator import (
    CATEGORIES,
    CATEGORY_INDEX,
    NEVER,
    AllocatorRule,
    Effect,
)
from skyrl_sim_plugins.sim.memory_graph import Graph, PlanCache, size_table
from skyrl_sim_plugins.sim.memory_ops import Dims, microbatch_inputs
from skyrl_sim_plugins.sim.width_block import WIDTH_BLOCK, block_first

EXACT = 2**53  # sums of a block's sizes stay below this (exact in int64 and in float64 alike)
MAX_STEPS = 2**16  # no program has more steps: a size below EXACT // MAX_STEPS keeps every sum below EXACT
ONE_HOT = np.eye(len(CATEGORIES), dtype=np.int64)  # row c: category c's column
MAX_EFFECTS = 1 << 20  # effects kept per endpoint before the cache starts over
SHORT_RUN = 4  # positions up to which ``LaneStats.sequence`` folds ``then`` (each ~10 array operations)
MAX_BODIES = 256  # block bodies kept per endpoint before that cache starts over (about 150 kB each)


class Diverged(Exception):
    """Lanes that would decide differently: ``groups`` are lane indices that decide alike."""

    def __init__(self, groups: list[np.ndarray]) -> None:
        super().__init__(f"lanes diverge into {len(groups)} groups")
        self.groups = groups


class Lanes(np.ndarray):
    """One integer quantity of a block of micro-batch shapes, one lane per shape. Arithmetic is numpy's, elementwise;
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
    """The ``Effect`` fields of one program (or sequence of programs), one column per lane."""

    end_allocated: np.ndarray  # [n]
    end_reserved: np.ndarray
    peak_allocated: np.ndarray
    peak_reserved: np.ndarray
    reserved_to_fit: np.ndarray
    categories_at_peak: np.ndarray  # [categories, n]
    end_categories: np.ndarray  # [categories, n]
    peak_step: np.ndarray | None = None  # a program's: the step at its peak (-1: never above its start)
    peak_step_bytes: np.ndarray | None = None  # a program's: that step's bytes (0 when none)

    @classmethod
    def of_steps(cls, allocated: np.ndarray, reserved: np.ndarray, category: np.ndarray) -> LaneStats:
        """The totals ``allocator.Program`` computes from its steps (``allocated``, ``reserved``: [lanes, steps],
        signed and rounded; lanes first, so running sums run along contiguous memory), for every lane at once."""
        n, steps = allocated.shape
        if steps > MAX_STEPS:
            raise OverflowError(f"a program of {steps} steps is longer than the lanes keep exact")
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
        # A step allocates in every lane or in none (sizes are rounded up to a block, never 0). The highest running
        # total is reached at an allocation unless that is step 0 and step 0 frees (as ``Program`` reasons).
        if allocated[0, 0] > 0:
            to_fit = highest
        else:
            allocating = allocated[0] > 0
            to_fit = cum_reserved[:, allocating].max(axis=1) if allocating.any() else np.full(n, NEVER, dtype=np.int64)
        # Bytes per category: the program's most frequent category is the total less the others, so only the steps
        # of the other categories are summed per category (a few columns: int64, exact).
        main, others, one_hot = category_split(category)
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
        A short run (the LM head's forward and backward) is folded with ``then``: a few array operations a position
        against some thirty for the whole sequence, the same integers."""
        if len(index) <= SHORT_RUN:
            first = distinct[index[0]]
            total = cls(*(getattr(first, name) for name in LANE_FIELDS[:7]))  # a run has no single peak step
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
        runs = np.zeros((count + 1, len(distinct)), dtype=np.int64)  # row p: how often each program runs before p
        np.cumsum(index[:, None] == np.arange(len(distinct))[None, :], axis=0, out=runs[1:])
        counts = runs[first]  # [lanes, distinct]
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
            end_categories=np.einsum("d,dcn->cn", runs[-1], end_categories),
        )

    def take(self, lanes: np.ndarray) -> LaneStats:
        """These totals for the given lanes, in that order."""
        return LaneStats(
            *(getattr(self, name)[..., lanes] if getattr(self, name) is not None else None for name in LANE_FIELDS)
        )

    def then(self, other: LaneStats) -> LaneStats:
        """This run followed by ``other``, lane by lane: ``Effect.then`` on arrays (the first peak wins a tie), so a
        sequence can be composed from runs computed apart (``sequence`` of the parts, then ``then``)."""
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

    def columns(self) -> BlockEffects:
        """Every lane's ``Effect`` fields (``BlockEffects``)."""
        scalars = (self.end_allocated, self.end_reserved, self.peak_allocated, self.peak_reserved, self.reserved_to_fit)
        return BlockEffects(np.vstack([*scalars, self.categories_at_peak, self.end_categories]).T.copy())


LANE_FIELDS = tuple(f.name for f in fields(LaneStats))


@lru_cache(maxsize=1024)
def _category_split(key: bytes) -> tuple[int, np.ndarray, np.ndarray]:
    category = np.frombuffer(key, dtype=np.int64)
    main = int(np.bincount(category, minlength=len(CATEGORIES)).argmax())
    others = np.flatnonzero(category != main)
    return main, others, ONE_HOT[category[others]]


def category_split(category: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """A program's step categories as ``LaneStats.of_steps`` sums them: its most frequent category, the steps of
    the others and their one-hot rows ([other steps, categories]). Kept per category sequence (a compiled plan's)."""
    return _category_split(np.ascontiguousarray(category, dtype=np.int64).tobytes())


SpecsOf = Callable[[Dims], list[Any]]  # memory.segment_specs bound to an endpoint, model and layer kinds


@dataclass
class BlockDetail:
    """A block's per-program totals, for the timeline of one of its lanes: per distinct segment (the layout's, then
    the held inputs' setup and release when there are some) its phase, its step labels and its lane totals."""

    phases: list[str]
    labels: list[Callable[[int], str]]
    stats: list[LaneStats]
    inputs: bool  # the last two segments are the held inputs' setup and release

    def lane_totals(self, lane: int) -> tuple[list[int], list[int], list[tuple[str, int]]]:
        """What a timeline (``memory.fitted_timeline``) reads of each program in one lane: its end and peak allocated
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
        """[lanes, 4 * programs]: every program's end, peak, peak step and that step's bytes, one row per lane (stacked
        once per block; a timeline converts one lane's row)."""
        columns = [s.end_allocated for s in self.stats] + [s.peak_allocated for s in self.stats]
        for stats in self.stats:
            assert stats.peak_step is not None and stats.peak_step_bytes is not None
        columns += [s.peak_step for s in self.stats] + [s.peak_step_bytes for s in self.stats]  # type: ignore[misc]
        return np.stack(columns, axis=1)


@dataclass(frozen=True)
class BlockEffects:
    """A block's lanes' ``Effect`` fields, one row per lane (end, reserved end, peak, reserved peak, reserved to
    fit, then the categories at the peak and at the end): ``effect(lane)`` makes one lane's effect. A run asks for a
    few of a block's lanes, so an effect is made only when its shape comes (from a contiguous row); an array holds no
    Python objects for the garbage collector to walk."""

    fields: np.ndarray  # [lanes, 5 + 2 * categories]

    def effect(self, lane: int) -> Effect:
        values = self.fields[lane].tolist()
        split = 5 + len(CATEGORIES)
        return Effect(*values[:5], tuple(values[5:split]), tuple(values[split:]))


LaneResult = tuple[Effect, BlockDetail, int]  # a shape's effect, its block's detail and its lane there
LaneSlot = tuple[int, int]  # a lane of an evaluated block (``MicroBatchEffects.evaluated``), its effect not made yet
SegmentDetail = tuple[str, Callable[[int], str], LaneStats]  # a segment's phase, step labels and lane totals
INPUTS_SETUP, INPUTS_RELEASE = ("inputs", "setup"), ("inputs", "release")  # the held inputs' segments, as slots


@dataclass(frozen=True)
class Run:
    """Consecutive positions of a micro-batch's sequence that are all body or all head segments: ``slots[index[i]]``
    runs ``i``-th."""

    head: bool
    slots: list[Any]
    index: np.ndarray


@dataclass
class BodyBlock:
    """What a block of widths gives apart from the LM head (which alone reads the logits width): each body segment's
    detail by slot, and the body runs' totals in execution order (``Run``)."""

    segments: dict[Any, SegmentDetail]
    runs: list[LaneStats]

    def take(self, lanes: np.ndarray) -> BodyBlock:
        """This body for the given lanes of it, in that order."""
        segments = {slot: (phase, label, stats.take(lanes)) for slot, (phase, label, stats) in self.segments.items()}
        return BodyBlock(segments, [run.take(lanes) for run in self.runs])


class MicroBatchEffects:
    """Per endpoint: each micro-batch shape's walk (its held inputs, embedding, layers, LM head, backward) as one
    ``Effect``, keyed by (rows, width, logits width) as ``memory.AllocationWalk.dims`` reads a micro-batch, and
    computed a block of widths at a time.

    ``distinct``/``index`` say which segment runs at each position (``memory.SegmentLayout``); ``body_specs`` gives
    one shape's segments without the LM head, ``head_specs`` the LM head's (``memory.segment_specs``), ``plans`` their
    compiled plans. Only the head reads the logits width, so the body of a block (its layers: most of the work) is
    computed once for the widths and shared by every logits width that comes with them (a call's logits width is its
    longest row, a few tokens below its width rounded up to TP). A block's effects are made lane by lane as their
    shapes come.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        model: ModelArch,
        body_specs: SpecsOf,
        head_specs: SpecsOf,
        distinct: list[Any],
        index: np.ndarray,
        plans: PlanCache,
        release_phase: str = "backward",
        rl: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.release_phase = release_phase  # when the held inputs are freed: after the last backward, or the head
        self.rl = rl  # the calls take SkyRL's RL path: their head computes an entropy (``Dims.of``)
        self.model = model
        self.body_specs = body_specs
        self.head_specs = head_specs
        self.distinct = distinct
        self.index = index
        self.plans = plans
        self.step = endpoint.parallelism.tp
        self.effects: dict[tuple[int, int, int], LaneResult] = {}
        self.pending: dict[tuple[int, int, int], LaneSlot] = {}  # evaluated lanes whose effect is not made yet
        # Each evaluated block's effects and detail, named by position in ``pending`` (pairs of ints hold nothing for
        # the garbage collector to walk).
        self.evaluated: list[tuple[BlockEffects, BlockDetail]] = []
        self.bodies: dict[tuple[Any, ...], BodyBlock] = {}
        # each width of a block body computed for several widths: (rows, width) -> (that body's key, its lane); a block
        # whose LM head diverged is evaluated again group by group, and each group's body is taken from it
        self.body_lanes: dict[tuple[int, int], tuple[tuple[Any, ...], int]] = {}
        self._runs: dict[tuple[frozenset[Any], bool], list[Run]] = {}
        self.blocks = 0  # blocks evaluated (lane arithmetic)
        self.bodies_evaluated = 0  # of them, blocks whose body was computed (not shared with another logits width)
        self.single_lanes = 0  # lanes that fell back to plain integers

    def get(self, rows: int, width: int, logits_width: int) -> LaneResult:
        """The effect of the micro-batch shape (rows, width, logits width), its block's detail and its lane."""
        key = (rows, width, logits_width)
        found = self.effects.get(key)
        if found is not None:
            return found
        slot = self.pending.pop(key, None)
        if slot is None:
            if len(self.effects) + len(self.pending) >= MAX_EFFECTS:
                self.effects.clear()
                self.pending.clear()
                self.evaluated.clear()
            widths, logits = self.lanes_with(width, logits_width)
            for w, lw, lane in zip(widths.tolist(), logits.tolist(), self.evaluate(rows, widths, logits), strict=True):
                self.pending[(rows, w, lw)] = lane
            slot = self.pending.pop(key)
        index, lane = slot
        block, detail = self.evaluated[index]
        found = self.effects[key] = (block.effect(lane), detail, lane)
        return found

    def lanes_with(self, width: int, logits_width: int) -> tuple[np.ndarray, np.ndarray]:
        """The (width, logits width) lanes evaluated with this shape: its block of widths, each with the logits width
        at the same distance below (a single micro-batch: its longest row, below its width rounded up to TP) or above
        (the call's global width). A single micro-batch's distance is below TP, and a block meets every such
        distance as calls come, so all of them are evaluated at once: they share the block's body, and one head
        evaluation of a few more lanes costs less than one per distance."""
        widths = self.block(width)
        if logits_width == 0:
            return widths, np.zeros_like(widths)
        distance = width - logits_width
        distances = range(self.step) if 0 <= distance < self.step else (distance,)
        logits = np.concatenate([widths - d for d in distances])
        widths = np.tile(widths, len(distances))
        return widths[logits > 0], logits[logits > 0]

    def block(self, width: int) -> np.ndarray:
        """The widths evaluated with ``width``: the WIDTH_BLOCK multiples of the TP size around it (widths are rounded up to
        TP), or ``width`` alone when it is not such a multiple."""
        step = self.step
        if width % step:
            return np.array([width], dtype=np.int64)
        first = block_first(width, step)
        return step * np.arange(max(1, first), first + WIDTH_BLOCK, dtype=np.int64)

    def evaluate(self, rows: int, widths: np.ndarray, logits: np.ndarray) -> list[LaneSlot]:
        """Each lane's result; lanes that decide differently somewhere are evaluated group by group."""
        try:
            self.blocks += 1
            return self.lanes(rows, Lanes.of(widths), Lanes.of(logits), len(widths))
        except Diverged as split:
            if len(split.groups) < 2:
                raise RuntimeError("lanes diverged into a single group") from None
            out: list[LaneSlot | None] = [None] * len(widths)
            for group in split.groups:
                for i, result in zip(group.tolist(), self.evaluate(rows, widths[group], logits[group]), strict=True):
                    out[i] = result
            return [result for result in out if result is not None]
        except (TypeError, ValueError):
            if len(widths) == 1:
                return self.lanes(rows, int(widths[0]), int(logits[0]), 1)
            self.single_lanes += len(widths)
            return [self.lanes(rows, w, lw, 1)[0] for w, lw in zip(widths.tolist(), logits.tolist(), strict=True)]

    def lanes(self, rows: int, width: Any, logits_width: Any, n: int) -> list[LaneSlot]:
        """The micro-batch's effect for ``n`` lanes (``width`` and ``logits_width``: Lanes, or ints for one lane)."""
        if isinstance(width, int):
            body = self.body(rows, width, 1)
        else:  # the body of each distinct width, once (lanes of one width and several logits widths share it)
            values = np.asarray(width).view(np.ndarray)
            distinct, where = np.unique(values, return_inverse=True)
            body = self.body(rows, Lanes.of(distinct), len(distinct))
            if len(distinct) < n or not np.array_equal(distinct, values):
                body = body.take(where)
        head_dims = Dims.of(self.endpoint, self.model, rows, width, logits_width, self.rl)
        head = self.segments(self.head_specs(head_dims), n)
        segments = {**body.segments, **head}
        runs = self.runs(frozenset(head), INPUTS_SETUP in segments)
        bodies = iter(body.runs)
        total: LaneStats | None = None
        for run in runs:
            stats = LaneStats.sequence([head[slot][2] for slot in run.slots], run.index) if run.head else None
            part = stats if stats is not None else next(bodies)
            total = part if total is None else total.then(part)
        assert total is not None
        order = [*self.distinct, *([INPUTS_SETUP, INPUTS_RELEASE] if INPUTS_SETUP in segments else [])]
        phases, labels, stats = (list(column) for column in zip(*(segments[slot] for slot in order), strict=True))
        detail = BlockDetail(phases, labels, stats, INPUTS_SETUP in segments)
        self.evaluated.append((total.columns(), detail))
        index = len(self.evaluated) - 1
        return [(index, lane) for lane in range(n)]

    def body(self, rows: int, width: Any, n: int) -> BodyBlock:
        """The body of a block (every segment but the LM head, and the body runs' totals), kept per rows and widths:
        the logits widths that come with the same widths share it."""
        key = (rows, width) if isinstance(width, int) else (rows, n, np.asarray(width).tobytes())
        found = self.bodies.get(key)
        if found is not None:
            return found
        if not isinstance(width, int):
            taken = self._taken_body(rows, np.asarray(width).view(np.ndarray))
            if taken is not None:
                self.bodies[key] = taken
                return taken
        self.bodies_evaluated += 1
        d = Dims.of(self.endpoint, self.model, rows, width, 0)  # the body reads no logits width
        segments = self.segments(self.body_specs(d), n)
        inputs = microbatch_inputs(d, self.model)
        if inputs:
            table = size_table([(shape, DTYPE_BYTES[dtype]) for _, shape, dtype in inputs], n)
            allocated, reserved = rounded(table, d.allocator)
            category = np.full(len(inputs), CATEGORY_INDEX["transient"], dtype=np.int64)
            names = [name for name, _, _ in inputs]
            segments[INPUTS_SETUP] = ("forward", names.__getitem__, LaneStats.of_steps(allocated, reserved, category))
            release = LaneStats.of_steps(-allocated, -reserved, category)
            segments[INPUTS_RELEASE] = (self.release_phase, names.__getitem__, release)
        head = frozenset(slot for slot in self.distinct if slot not in segments)
        runs = [
            LaneStats.sequence([segments[slot][2] for slot in run.slots], run.index)
            for run in self.runs(head, bool(inputs))
            if not run.head
        ]
        if len(self.bodies) >= MAX_BODIES:
            self.bodies.clear()
            self.body_lanes.clear()
        found = self.bodies[key] = BodyBlock(segments, runs)
        if not isinstance(width, int) and n > 1:
            for lane, value in enumerate(np.asarray(width).view(np.ndarray).tolist()):
                self.body_lanes[(rows, value)] = (key, lane)
        return found

    def _taken_body(self, rows: int, widths: np.ndarray) -> BodyBlock | None:
        """The body of ``widths`` as lanes of one block body already computed for all of them (None if there is
        none): the same integers, without building and walking the graphs again."""
        found = [self.body_lanes.get((rows, value)) for value in widths.tolist()]
        if not found or any(f is None for f in found):
            return None
        keys = {f[0] for f in found if f is not None}
        parent = self.bodies.get(next(iter(keys))) if len(keys) == 1 else None
        if parent is None:
            return None
        return parent.take(np.array([f[1] for f in found if f is not None], dtype=np.int64))

    def segments(self, specs: list[Any], n: int) -> dict[Any, SegmentDetail]:
        """Each spec's phase, step labels and lane totals, by slot."""
        tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        out: dict[Any, SegmentDetail] = {}
        for spec in specs:
            graph: Graph = spec.graph
            if id(graph) not in tables:
                tables[id(graph)] = rounded(size_table(graph.size_shapes(), n), graph.allocator)
            allocated, reserved = tables[id(graph)]
            plan = self.plans.compile(graph, spec.recipes)
            sign = plan.sign[None, :]
            # np.take keeps lanes-first (C) order, so running sums run along contiguous memory (fancy indexing would not)
            steps_allocated = np.take(allocated, plan.positions, axis=1) * sign
            steps_reserved = np.take(reserved, plan.positions, axis=1) * sign
            stats = LaneStats.of_steps(steps_allocated, steps_reserved, plan.category)
            out[spec.slot] = (spec.phase, plan_label(plan.specs), stats)
        return out

    def runs(self, head: frozenset[Any], inputs: bool) -> list[Run]:
        """The micro-batch's positions (the held inputs' setup first and release last when there are some) cut into
        runs of body and of head segments, each with its own slot list."""
        found = self._runs.get((head, inputs))
        if found is None:
            slots = [*self.distinct, *([INPUTS_SETUP, INPUTS_RELEASE] if inputs else [])]
            index = self.index.tolist()
            if inputs:
                index = [len(slots) - 2, *index, len(slots) - 1]
            found = []
            start = 0
            for end in range(1, len(index) + 1):
                is_head = slots[index[start]] in head
                if end < len(index) and (slots[index[end]] in head) == is_head:
                    continue
                part = index[start:end]
                used = sorted(set(part))
                local = {position: i for i, position in enumerate(used)}
                found.append(Run(is_head, [slots[i] for i in used], np.array([local[i] for i in part], dtype=np.int64)))
                start = end
            self._runs[(head, inputs)] = found
        return found


def plan_label(specs: list[Any]) -> Callable[[int], str]:
    """Step ``i``'s op name of a compiled plan."""
    return lambda i: specs[i].op


def rounded(table: np.ndarray, rule: AllocatorRule) -> tuple[np.ndarray, np.ndarray]:
    """A [lanes, sizes] table of byte sizes (``memory_graph.size_table``) rounded to allocated and reserved bytes by the
    device's allocator rule."""
    if table.size and (table.min() < 0 or table.max() >= EXACT // MAX_STEPS):
        raise OverflowError("a tensor size is outside the range whose sums stay exact")
    return rule.rounded_arrays(table)

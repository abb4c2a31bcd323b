"""Each micro-batch shape's whole walk as one allocator ``Effect``, per endpoint: the lanes of ``fast.memory_lanes``
evaluated a tile of widths at a time and kept.

A run meets thousands of micro-batch shapes that differ only in their width (and rows); the first shape of a tile
of widths evaluates the whole tile (``fast.memory_lanes``: the walk's own builders over ``Lanes``), and the other
shapes of the tile are then answered from it. What is kept, each a ``BoundedCache``: the effects made so far (and
the evaluated tiles their lanes still point into, which go when it starts over), the bodies of the tiles (shared by
the logits widths that come with one set of widths) and the micro-batch's stretches of body and head positions.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from skyrl_sim.api import Endpoint, ModelArch
from skyrl_sim_plugins.sim.bound.cache import BoundedCache
from skyrl_sim_plugins.sim.fast.memory_lanes import (
    INPUTS_SETUP,
    BodyTile,
    Diverged,
    LaneResult,
    Lanes,
    LaneSlot,
    SpecsOf,
    Stretch,
    TileDetail,
    TileEffects,
    body_tile,
    position_stretches,
    tile_segments,
    tile_total,
)
from skyrl_sim_plugins.sim.fast.width_tile import WIDTH_TILE, tile_first
from skyrl_sim_plugins.sim.reference.memory_graph import PlanSource
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, microbatch_inputs, reads_row_tokens

EffectKey = tuple[int, int, int, tuple[int, ...]]
"""A micro-batch shape as its effect is kept: rows, width, logits width, its rows' shortfalls (``segments.short_rows``)."""
MAX_EFFECTS = 1 << 20
"""Effects (made, and evaluated but not made yet) kept per endpoint before the cache starts over."""
MAX_BODIES = 256
"""Tile bodies kept per endpoint before that cache starts over (about 150 kB each)."""
MAX_BODY_LANES = MAX_BODIES * WIDTH_TILE
"""Widths whose body is a lane of a kept tile body (each body holds at most a tile of them)."""


class MicroBatchEffects:
    """Per endpoint and pass: each micro-batch shape's walk (its held inputs, embedding, layers, LM head, backward) as
    one ``Effect``, keyed by (rows, width, logits width, rows' shortfalls) as ``segments.microbatch_dims`` reads a
    micro-batch, and computed a tile of widths at a time.

    ``distinct``/``index`` say which segment runs at each position (``segments.SegmentLayout``); ``body_specs``
    gives one shape's segments without the LM head, ``head_specs`` the LM head's (``segments.segment_specs``),
    ``plans`` their compiled plans. Only the head reads the logits width, so the body of a tile (its layers: most of
    the work) is computed once for the widths and shared by every logits width that comes with them (a call's logits
    width is its longest row, a few tokens below its width rounded up to TP). A tile's effects are made lane by lane
    as their shapes come.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        model: ModelArch,
        body_specs: SpecsOf,
        head_specs: SpecsOf,
        distinct: list[Any],
        index: np.ndarray,
        plans: PlanSource,
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
        self.row_tokens = reads_row_tokens(endpoint)  # the head reads each row's tokens: ``get``'s ``short``
        # Each evaluated tile's effects and detail, named by position in ``pending`` (pairs of ints hold nothing for
        # the garbage collector to walk); they go when the effects start over.
        self.evaluated: list[tuple[TileEffects, TileDetail]] = []
        # Evaluated lanes whose effect is not made yet: part of the effects cache, counted against its bound and
        # emptied with it (an entry moves to ``effects`` when its shape comes).
        self.pending: dict[EffectKey, LaneSlot] = {}
        # The callback holds the two containers, not ``self``: no reference cycle keeps the effects past the run.
        forget = partial(forget_tiles, self.pending, self.evaluated)
        self.effects: BoundedCache[EffectKey, LaneResult] = BoundedCache(MAX_EFFECTS, forget)
        # each width of a tile body computed for several widths: (rows, width) -> (that body's key, its lane); a tile
        # whose LM head diverged is evaluated again group by group, and each group's body is taken from it
        self.body_lanes: BoundedCache[tuple[int, int], tuple[tuple[Any, ...], int]] = BoundedCache(MAX_BODY_LANES)
        self.bodies: BoundedCache[tuple[Any, ...], BodyTile] = BoundedCache(MAX_BODIES, self.body_lanes.clear)
        self._stretches: BoundedCache[tuple[frozenset[Any], bool], list[Stretch]] = BoundedCache(16)
        self.tiles = 0  # tiles evaluated (lane arithmetic)
        self.bodies_evaluated = 0  # of them, tiles whose body was computed (not shared with another logits width)
        self.single_lanes = 0  # lanes that fell back to plain integers

    def get(self, rows: int, width: int, logits_width: int, short: tuple[int, ...] = ()) -> LaneResult:
        """The effect of the micro-batch shape (rows, width, logits width, and how many tokens each row is short of
        the width where the head reads it: ``segments.short_rows``), its tile's detail and its lane."""
        key = (rows, width, logits_width, short)
        found = self.effects.get(key)
        if found is not None:
            return found
        slot = self.pending.pop(key, None)
        if slot is None and len(set(short)) > 1:  # rows of different lengths: evaluated alone (``alone``)
            self.effects.make_room(len(self.pending) + 1)
            slot = self.alone(rows, width, logits_width, short)
        if slot is None:
            self.effects.make_room(len(self.pending) + 1)
            widths, logits = self.lanes_with(width, logits_width, short)
            lanes = self.evaluate(rows, widths, logits, short)
            for w, lw, lane in zip(widths.tolist(), logits.tolist(), lanes, strict=True):
                self.pending[(rows, w, lw, short)] = lane
            slot = self.pending.pop(key)
        index, lane = slot
        tile, detail = self.evaluated[index]
        found = self.effects[key] = (tile.effect(lane), detail, lane)  # moved from ``pending``: room was made
        return found

    def alone(self, rows: int, width: int, logits_width: int, short: tuple[int, ...]) -> LaneSlot:
        """A micro-batch whose rows fall short of its width by different amounts, evaluated as one lane of plain
        integers: such rows' sizes do not scale together across a tile of widths (its lanes would decide differently
        at nearly every step), and calls rarely repeat them, so a tile would be evaluated for one lane anyway."""
        self.single_lanes += 1
        return self.lanes(rows, width, logits_width, 1, short)[0]

    def lanes_with(self, width: int, logits_width: int, short: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The (width, logits width) lanes evaluated with this shape: its tile of widths, each with the logits width
        at the same distance below (a single micro-batch: its longest row, below its width rounded up to TP) or above
        (the call's global width). A single micro-batch's distance is below TP, and a tile meets every such
        distance as calls come, so all of them are evaluated at once: they share the tile's body, and one head
        evaluation of a few more lanes costs less than one per distance. Rows ``short`` of the width are as many
        tokens short in every lane (a lane whose width leaves a row no token is left out); where the head reads them,
        only the distances that leave every row within the logits width are evaluated (no call has another)."""
        widths = self.tile(width)
        if logits_width == 0:
            logits = np.zeros_like(widths)
        else:
            distance = width - logits_width
            distances = range(self.step) if 0 <= distance < self.step else (distance,)
            if self.row_tokens:  # a row is never longer than the logits width: distance <= the least shortfall
                distances = [d for d in distances if d <= min(short, default=0)] or [distance]
            logits = np.concatenate([widths - d for d in distances])
            widths = np.tile(widths, len(distances))
            keep = logits > 0
            widths, logits = widths[keep], logits[keep]
        if short:
            keep = widths > max(short)
            widths, logits = widths[keep], logits[keep]
        return widths, logits

    def tile(self, width: int) -> np.ndarray:
        """The widths evaluated with ``width``: the WIDTH_TILE multiples of the TP size around it (widths are rounded
        up to TP), or ``width`` alone when it is not such a multiple."""
        step = self.step
        if width % step:
            return np.array([width], dtype=np.int64)
        first = tile_first(width, step)
        return step * np.arange(max(1, first), first + WIDTH_TILE, dtype=np.int64)

    def evaluate(self, rows: int, widths: np.ndarray, logits: np.ndarray, short: tuple[int, ...] = ()) -> list[LaneSlot]:
        """Each lane's result; lanes that decide differently somewhere are evaluated group by group."""
        try:
            self.tiles += 1
            return self.lanes(rows, Lanes.of(widths), Lanes.of(logits), len(widths), short)
        except Diverged as split:
            if len(split.groups) < 2:
                raise RuntimeError("lanes diverged into a single group") from None
            out: list[LaneSlot | None] = [None] * len(widths)
            for group in split.groups:
                results = self.evaluate(rows, widths[group], logits[group], short)
                for i, result in zip(group.tolist(), results, strict=True):
                    out[i] = result
            return [result for result in out if result is not None]
        except (TypeError, ValueError):
            if len(widths) == 1:
                return self.lanes(rows, int(widths[0]), int(logits[0]), 1, short)
            self.single_lanes += len(widths)
            pairs = zip(widths.tolist(), logits.tolist(), strict=True)
            return [self.lanes(rows, w, lw, 1, short)[0] for w, lw in pairs]

    def lanes(self, rows: int, width: Any, logits_width: Any, n: int, short: tuple[int, ...] = ()) -> list[LaneSlot]:
        """The micro-batch's effect for ``n`` lanes (``width`` and ``logits_width``: Lanes, or ints for one lane;
        ``short``: how many tokens each row is short of the width, the same in every lane)."""
        if isinstance(width, int):
            body = self.body(rows, width, 1)
        else:  # the body of each distinct width, once (lanes of one width and several logits widths share it)
            values = np.asarray(width).view(np.ndarray)
            distinct, where = np.unique(values, return_inverse=True)
            body = self.body(rows, Lanes.of(distinct), len(distinct))
            if len(distinct) < n or not np.array_equal(distinct, values):
                body = body.take(where)
        head_dims = Dims.of(self.endpoint, self.model, rows, width, logits_width, self.rl, short_rows=short)
        head = tile_segments(self.head_specs(head_dims), n, self.plans)
        stretches = self.stretches(frozenset(head), INPUTS_SETUP in body.segments)
        total, detail = tile_total(body, head, stretches, self.distinct)
        self.evaluated.append((total.columns(), detail))
        index = len(self.evaluated) - 1
        return [(index, lane) for lane in range(n)]

    def body(self, rows: int, width: Any, n: int) -> BodyTile:
        """The body of a tile (every segment but the LM head, and the body stretches' totals), kept per rows and widths:
        the logits widths that come with the same widths share it."""
        key = (rows, width) if isinstance(width, int) else (rows, n, np.asarray(width).tobytes())
        found = self.bodies.get(key)
        if found is not None:
            return found
        if not isinstance(width, int):
            taken = self._taken_body(rows, np.asarray(width).view(np.ndarray))
            if taken is not None:
                return self.bodies.put(key, taken)
        self.bodies_evaluated += 1
        d = Dims.of(self.endpoint, self.model, rows, width, 0)  # the body reads no logits width
        segments = tile_segments(self.body_specs(d), n, self.plans)
        inputs = microbatch_inputs(d, self.model)
        body = self.bodies.put(key, body_tile(segments, inputs, d, n, self.release_phase, self.stretches, self.distinct))
        if not isinstance(width, int) and n > 1:
            values = np.asarray(width).view(np.ndarray).tolist()
            self.body_lanes.put_many([((rows, value), (key, lane)) for lane, value in enumerate(values)])
        return body

    def _taken_body(self, rows: int, widths: np.ndarray) -> BodyTile | None:
        """The body of ``widths`` as lanes of one tile body already computed for all of them (None if there is none):
        the same integers, without building and walking the graphs again."""
        found = [self.body_lanes.get((rows, value)) for value in widths.tolist()]
        if not found or any(f is None for f in found):
            return None
        keys = {f[0] for f in found if f is not None}
        parent = self.bodies.get(next(iter(keys))) if len(keys) == 1 else None
        if parent is None:
            return None
        return parent.take(np.array([f[1] for f in found if f is not None], dtype=np.int64))

    def stretches(self, head: frozenset[Any], inputs: bool) -> list[Stretch]:
        """The micro-batch's positions cut into stretches of body and of head segments (``position_stretches``), kept per set
        of head slots and whether there are held inputs."""
        key = (head, inputs)
        return self._stretches.get_or_make(key, lambda: position_stretches(self.distinct, self.index, head, inputs))


def forget_tiles(pending: dict[EffectKey, LaneSlot], evaluated: list[tuple[TileEffects, TileDetail]]) -> None:
    """What goes with the effects when their cache starts over: the lanes not made yet and the tiles they point into."""
    pending.clear()
    evaluated.clear()

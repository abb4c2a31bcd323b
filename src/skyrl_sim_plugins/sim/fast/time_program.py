"""The time model's fast path: a micro-batch's cost as one compiled program, and tiles of widths evaluated at once.

A run asks for thousands of calls, so the training path is compiled. Every op the training passes list declares how
its cost scales (``layer_ops.Scaling``); where all of them are affine in a micro-batch's tokens, attention pairs and
logit slots, the layers, the LM head's passes and the embedding of a pass kind become one ``MicroBatchProgram``
(numpy arrays, evaluated in a dozen array operations), and a padded micro-batch's cost is read from its tile of
widths, evaluated at once (``WidthTile``). ``AffinePass.build`` refuses (``NotAffine``) a pass with an op that does
not declare itself affine, or whose value at a check point is not what its probes predict: the bound model then
prices that pass op by op, by the reference.

The meaning of every number here is ``reference.time_model.TimeReference``: the program equals its ``microbatch``
bit for bit where ``MicroBatchProgram.exact`` says so, which ``tests/test_timing_fast_path.py`` holds it to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from skyrl_sim_plugins.sim.description.layer_ops import AFFINE, CAUSAL_FRACTION, Unit, Work
from skyrl_sim_plugins.sim.fast.width_tile import WIDTH_TILE
from skyrl_sim_plugins.sim.reference.time_model import (
    Cost,
    Fields,
    Listing,
    Roofline,
    TimeReference,
    ring_passes,
    ring_terms,
)

CHECK_POINT = (3.0, 5.0, 7.0)
"""Where ``AffinePass.build`` checks its probes' prediction against the pass itself (small integers: an affine op's
value there is exact in either form, a non-affine one's differs)."""
CHECK_TOLERANCE = 1e-9
"""The relative difference the check allows (coefficients that are not binary fractions round in the last bits)."""


class NotAffine(ValueError):
    """A pass the affine form cannot price: an op or collective that does not declare itself affine, another op
    list at another probe point, or a value at the check point the probes do not predict."""


@dataclass(frozen=True)
class AffineOp:
    """An op run ``count`` times whose FLOPs and bytes are affine in the pass's variables: ``flops`` and ``bytes``
    hold the constant first, then one coefficient per variable (``c + t x per_token + p x per_pair`` for a layer
    pass over t tokens and p attention pairs)."""

    unit: Unit
    count: float
    flops: tuple[float, ...]
    bytes: tuple[float, ...]


@dataclass(frozen=True)
class AffineCollective:
    """A collective run ``count`` times over a tensor whose size is affine in the pass's variables (as ``AffineOp``)."""

    kind: str
    count: float
    bytes: tuple[float, ...]


@dataclass(frozen=True)
class AffinePass:
    """A pass's ops and collectives as affine functions of its variables: built once, evaluated per micro-batch."""

    ops: tuple[AffineOp, ...]
    collectives: tuple[AffineCollective, ...]

    @classmethod
    def build(cls, direct: Callable[..., Listing], variables: int = 3) -> AffinePass:
        """Probe ``direct`` at the origin and at each variable's unit point (``(0, 0, 0)``, ``(1, 0, 0)``, ...),
        after checking that every op and collective it lists declares itself affine; then check the result at
        ``CHECK_POINT``. Raises ``NotAffine`` where any of that fails, so no op is ever priced as affine that is not."""
        zero = direct(*(0.0,) * variables)
        declared_affine(zero)
        units = [direct(*(float(i == j) for j in range(variables))) for i in range(variables)]
        for unit in units:
            if len(unit[0]) != len(zero[0]) or len(unit[1]) != len(zero[1]):
                raise NotAffine("the pass lists other ops at another probe point: it is not affine")
        ops = tuple(
            AffineOp(
                z.unit,
                count,
                (z.flops, *(unit[0][k][0].flops - z.flops for unit in units)),
                (z.bytes, *(unit[0][k][0].bytes - z.bytes for unit in units)),
            )
            for k, (z, count) in enumerate(zero[0])
        )
        collectives = tuple(
            AffineCollective(z.kind, count, (z.bytes, *(unit[1][k][0].bytes - z.bytes for unit in units)))
            for k, (z, count) in enumerate(zero[1])
        )
        built = cls(ops, collectives)
        built.check(direct(*CHECK_POINT[:variables]), CHECK_POINT[:variables])
        return built

    def check(self, listed: Listing, point: tuple[float, ...]) -> None:
        """Raise ``NotAffine`` unless every op's FLOPs and bytes and every collective's size in ``listed`` (the pass
        at ``point``) are what the affine form predicts there."""
        if len(listed[0]) != len(self.ops) or len(listed[1]) != len(self.collectives):
            raise NotAffine("the pass lists other ops at the check point: it is not affine")
        expected = [(op.name, (op.flops, op.bytes), affine) for (op, _), affine in zip(listed[0], self.ops, strict=True)]
        expected += [(c.name, (c.bytes,), affine) for (c, _), affine in zip(listed[1], self.collectives, strict=True)]
        for name, values, affine in expected:
            forms = (affine.flops, affine.bytes) if isinstance(affine, AffineOp) else (affine.bytes,)
            for value, form in zip(values, forms, strict=True):
                predicted = form[0] + sum(c * x for c, x in zip(form[1:], point, strict=True))
                if abs(predicted - value) > CHECK_TOLERANCE * max(abs(value), abs(predicted), 1.0):
                    raise NotAffine(f"op {name} is not affine: {value} at {point}, its probes predict {predicted}")


def declared_affine(listed: Listing) -> None:
    """Raise ``NotAffine`` naming the first op or collective of ``listed`` that does not declare itself affine."""
    for item in [op for op, _ in listed[0]] + [c for c, _ in listed[1]]:
        if item.scaling != AFFINE:
            raise NotAffine(f"op {item.name} is {item.scaling}, not affine: the pass is priced op by op")


PARTS = ("layers", "head_forward", "head_backward", "embedding")
"""The parts of a micro-batch's cost, in the order the reference adds them (a forward's head backward is empty)."""
PART_FIELDS = ("matmul_s", "attention_s", "memory_s", "comm_s", "flops", "bytes")
"""What a micro-batch program sums per part (the fixed seconds and the op count do not depend on the shape)."""
UNIT_SLOT: dict[str, int] = {"matmul": 0, "attention": 1, "memory": 2}
COMM_SLOT, FLOPS_SLOT, BYTES_SLOT = 3, 4, 5
VARIABLE_GRAIN = 2.0
"""The program's variables must be multiples of 1 / VARIABLE_GRAIN: token counts are integers, attention pairs
halves of integers (``CAUSAL_FRACTION``)."""
MAX_COEFFICIENT_BITS = 30
"""The finest coefficient grain a program looks for: multiples of 2^-30 (a coefficient that is none is not exact)."""


@dataclass(frozen=True, eq=False)
class MicroBatchProgram:
    """One micro-batch's whole cost as numpy arrays: built once per endpoint and pass kind, evaluated per micro-batch.

    The cost of a micro-batch is the sum of its **parts**, each an ``AffinePass`` over (tokens, pairs, logits):
    the layers of one stage (forward, recompute, backward), the LM head's forward, its backward, the embedding. Each
    row of ``affine`` is an op's FLOPs, an op's bytes or a collective's size before its count; one evaluation
    computes every op's roofline seconds and every collective's ring time in a few array operations, and
    ``np.bincount`` (a sequential loop over the rows in order) sums them per part and field. The result is bit
    for bit ``TimeReference.microbatch``'s where ``exact`` says so:

    - **the affine part is exact.** The reference evaluates each row by the description's direct formulas
      (``layer_ops``: products, quotients by TP and sums of the widths, the dtype sizes, the tokens, the pairs and
      the logits). When the coefficients are non-negative multiples of ``2^-k``, the formulas' constants integers
      or binary fractions (TP a power of two, the vocabulary shard an integer: ``exact_constants``), the variables
      halves of integers and every row below ``2^(51-k)``, each product, quotient and partial sum of either form is
      representable (a multiple of ``2^-(k+1)``, or an even integer below ``2^54`` before a division by TP), so no
      step rounds, and one matrix-vector product gives the same numbers in any order;
    - **the rest is the reference's arithmetic in its order:** times the op's count, divided by the rate, ``max`` of
      FLOP time and byte time; a ring's ``(share x size) / link + latency`` times ``passes x count`` (a factor of 1 or
      2 scales exactly, so ``count x (2 x steps)`` and ``(2 count) x steps`` round the same product);
    - **the sums are sequential:** a part's field is its rows' values added one at a time from 0.0 in op order
      (``Cost.add``, ``sequential_sum``), and the micro-batch's field ``((layers + head forward) + head backward) +
      embedding`` (``Cost.add`` in the reference's order); an empty part adds 0.0.

    Elsewhere (a vocabulary TP does not divide, context parallel splitting a micro-batch into fractions, contexts
    so long the values pass ``2^(51-k)``) the caller takes the reference.
    """

    affine: np.ndarray
    scale: np.ndarray
    divisor: np.ndarray
    ring_latency: float
    ring_factor: np.ndarray
    bins: np.ndarray
    op_rows: int
    fixed_s: float
    ops: int
    coefficient_bound: tuple[float, float, float, float]
    exact_below: float

    @classmethod
    def build(cls, parts: list[AffinePass], roofline: Roofline, constants: Cost, integral: bool) -> MicroBatchProgram:
        """The program of ``parts`` (``PARTS``, three-variable passes: tokens, pairs, logits) on ``roofline``.

        ``constants`` gives the fixed seconds and the op count (shape-independent: the reference's at any shape);
        ``integral`` whether the formulas' constants are exact (``exact_constants``; if not, ``exact`` is always
        false)."""
        if len(parts) != len(PARTS):
            raise ValueError(f"a micro-batch program has the parts {PARTS}, got {len(parts)}")
        ops = [(index, op) for index, part in enumerate(parts) for op in part.ops]
        collectives = [(index, c) for index, part in enumerate(parts) for c in part.collectives]
        share, latency = ring_terms(roofline.tp, roofline.latency)
        in_ring = roofline.tp > 1  # ``Roofline.ring``: a group of one sends nothing
        rows = [op.flops for _, op in ops] + [op.bytes for _, op in ops] + [c.bytes for _, c in collectives]
        affine = np.array(rows, dtype=np.float64).reshape(len(rows), 1 + 3)
        width = len(PART_FIELDS)
        rate = [roofline.attention if op.unit == "attention" else roofline.matmul for _, op in ops]
        bins = (
            [index * width + FLOPS_SLOT for index, _ in ops]
            + [index * width + BYTES_SLOT for index, _ in ops]
            + [index * width + UNIT_SLOT[op.unit] for index, op in ops]
            + [index * width + COMM_SLOT for index, _ in collectives]
        )
        bits = coefficient_bits(affine) if integral else None
        return cls(
            affine=affine,
            scale=np.array(
                [op.count for _, op in ops] * 2 + [share if in_ring else 0.0] * len(collectives), dtype=np.float64
            ),
            divisor=np.array(rate + [roofline.memory] * len(ops) + [roofline.link] * len(collectives), dtype=np.float64),
            ring_latency=latency,
            ring_factor=np.array(
                [ring_passes(c.kind) * c.count if in_ring else 0.0 for _, c in collectives], dtype=np.float64
            ),
            bins=np.array(bins, dtype=np.intp),
            op_rows=len(ops),
            fixed_s=constants.fixed_s,
            ops=constants.ops,
            coefficient_bound=tuple(affine.max(axis=0, initial=0.0).tolist()),  # type: ignore[arg-type]
            exact_below=0.0 if bits is None else 2.0 ** (51 - bits),
        )

    def exact(self, tokens: float, pairs: float, logits: float) -> bool:
        """Whether every row's affine part is exact at these variables (see the class doc)."""
        grain = VARIABLE_GRAIN
        if not ((tokens * grain).is_integer() and (pairs * grain).is_integer() and (logits * grain).is_integer()):
            return False
        if tokens < 0.0 or pairs < 0.0 or logits < 0.0:
            return False
        c, per_token, per_pair, per_logit = self.coefficient_bound
        return c + per_token * tokens + per_pair * pairs + per_logit * logits < self.exact_below

    def exact_lanes(self, tokens: np.ndarray, pairs: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """``exact`` for every lane of float64 arrays at once (the same tests, the bound summed in the same order)."""
        grain = VARIABLE_GRAIN
        whole = np.ones(tokens.shape, dtype=bool)
        for values in (tokens, pairs, logits):
            scaled = values * grain
            whole &= (scaled == np.floor(scaled)) & (values >= 0.0)
        c, per_token, per_pair, per_logit = self.coefficient_bound
        return whole & (c + per_token * tokens + per_pair * pairs + per_logit * logits < self.exact_below)

    def evaluate_lanes(self, tokens: np.ndarray, pairs: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """``evaluate``'s shape-dependent fields (``PART_FIELDS``, one row per lane) for every lane of float64
        arrays at once, bit for bit: the affine part is exact (the caller checks ``exact_lanes``), the rest is
        elementwise, and each part's field is its rows added one at a time from 0.0 in row order, as
        ``np.bincount`` adds them for one lane. ``fields_of`` makes a lane's ``Fields``."""
        n = self.op_rows
        variables = np.vstack((np.ones_like(tokens), tokens, pairs, logits))
        values = (self.affine @ variables) * self.scale[:, None]
        rated = values / self.divisor[:, None]
        weights = np.concatenate(
            (
                values[: 2 * n],
                np.maximum(rated[:n], rated[n : 2 * n]),
                (rated[2 * n :] + self.ring_latency) * self.ring_factor[:, None],
            )
        )
        s = np.zeros((len(PARTS) * len(PART_FIELDS), len(tokens)))
        for row, slot in enumerate(self.bins.tolist()):
            s[slot] += weights[row]
        width = len(PART_FIELDS)
        # ((layers + head forward) + head backward) + embedding, field by field: [lanes, PART_FIELDS]
        return (((s[:width] + s[width : 2 * width]) + s[2 * width : 3 * width]) + s[3 * width :]).T.copy()

    def fields_of(self, part_fields: list[float]) -> Fields:
        """A micro-batch's ``Fields`` from its summed ``PART_FIELDS`` (one lane of ``evaluate_lanes``)."""
        matmul, attention, memory, comm, flops, moved = part_fields
        return (matmul, attention, memory, comm, self.fixed_s, flops, moved, self.ops)

    def evaluate(self, tokens: float, pairs: float, logits: float) -> Fields:
        """The micro-batch's cost fields at (tokens, pairs, logits); bit for bit the reference's where ``exact``."""
        n = self.op_rows
        values = self.affine.dot(np.array((1.0, tokens, pairs, logits))) * self.scale
        rated = values / self.divisor
        weights = np.concatenate(
            (
                values[: 2 * n],
                np.maximum(rated[:n], rated[n : 2 * n]),
                (rated[2 * n :] + self.ring_latency) * self.ring_factor,
            )
        )
        s = np.bincount(self.bins, weights=weights, minlength=len(PARTS) * len(PART_FIELDS)).tolist()
        # ((layers + head forward) + head backward) + embedding, field by field (PARTS x PART_FIELDS).
        return (
            ((s[0] + s[6]) + s[12]) + s[18],
            ((s[1] + s[7]) + s[13]) + s[19],
            ((s[2] + s[8]) + s[14]) + s[20],
            ((s[3] + s[9]) + s[15]) + s[21],
            self.fixed_s,
            ((s[4] + s[10]) + s[16]) + s[22],
            ((s[5] + s[11]) + s[17]) + s[23],
            self.ops,
        )


def coefficient_bits(coefficients: np.ndarray) -> int | None:
    """The smallest k for which every coefficient is a non-negative multiple of 2^-k (None: a negative one, or one
    finer than ``MAX_COEFFICIENT_BITS``)."""
    if (coefficients < 0).any():
        return None
    for bits in range(MAX_COEFFICIENT_BITS + 1):
        scaled = coefficients * 2.0**bits  # scaling by a power of two is exact
        if (scaled == np.floor(scaled)).all():
            return bits
    return None


def microbatch_program(reference: TimeReference, kind: str) -> MicroBatchProgram:
    """The ``MicroBatchProgram`` of a pass kind (``reference.time_model.pass_kind``: a forward, a forward_backward,
    or one on SkyRL's RL path) of ``reference``'s endpoint. Raises ``NotAffine`` when an op of the pass is not
    affine (the caller prices such a pass by the reference)."""
    backward = kind != "forward"

    def layers(t: float, p: float, logits: float) -> Listing:
        return reference.layers_direct(Work(t, p), backward)

    def head_part(part: int) -> Callable[[float, float, float], Listing]:
        def listed(t: float, p: float, logits: float) -> Listing:
            return reference.head_direct(kind, Work(t, p), logits)[part]

        return listed

    parts = [AffinePass.build(layers), AffinePass.build(head_part(0)), AffinePass.build(head_part(1))]
    parts.append(AffinePass.build(head_part(2)))
    constants = reference.microbatch(kind, 0.0, 0.0, 0.0)
    return MicroBatchProgram.build(parts, reference.roofline, constants, exact_constants(reference))


def exact_constants(reference: TimeReference) -> bool:
    """Whether the description's formulas have exact constants on this endpoint: TP a power of two (every share
    ``x / tp`` a binary fraction) and the vocabulary divided by it (``LMHead.integral``)."""
    tp = reference.tp
    return tp & (tp - 1) == 0 and reference.head.integral(reference.setup)


MAX_TILE_PAIRS = 2**62
"""A tile whose largest rows x width^2 reaches this is not evaluated (its micro-batches are costed one at a time):
a tile's variables are made in int64, and this keeps them far from wrapping."""


@dataclass(frozen=True)
class WidthTile:
    """The costs of a tile of padded micro-batches of one kind and row count: the widths ``first`` to ``first +
    WIDTH_TILE - 1`` times TP, each with the logits widths 0 to TP - 1 below it; lane ``(w - first) x TP + d`` is
    width ``w`` x TP with logits width d below it. ``fields`` holds each lane's summed ``PART_FIELDS``, valid
    where ``exact`` (elsewhere the micro-batch is costed alone, by the reference)."""

    first: int  # the first lane's width, in multiples of TP
    program: MicroBatchProgram  # the program the tile was evaluated with (its fixed seconds and op count)
    fields: np.ndarray  # [lanes, PART_FIELDS]
    exact: list[bool]



def evaluate_width_tile(program: MicroBatchProgram, tp: int, rows: int, first: int) -> WidthTile:
    """A tile of ``rows``-row padded micro-batches: widths ``first`` to ``first + WIDTH_TILE - 1`` times TP, each
    with the logits widths 0 to TP - 1 below it, in that order, evaluated at once."""
    start = max(first, 1)
    widths = np.repeat(tp * np.arange(start, first + WIDTH_TILE, dtype=np.int64), tp)
    logits_widths = widths - np.tile(np.arange(tp, dtype=np.int64), len(widths) // tp)
    # The variables as ``microbatch_variables`` and ``BoundRoofline.call_fields`` make them: integer products, then
    # floats.
    tokens = (rows * widths).astype(np.float64)
    pairs = (rows * widths * widths).astype(np.float64) * CAUSAL_FRACTION
    logits = (rows * logits_widths).astype(np.float64)
    exact = program.exact_lanes(tokens, pairs, logits) & (logits_widths > 0)
    return WidthTile(start, program, program.evaluate_lanes(tokens, pairs, logits), exact.tolist())

"""Roofline time model of backend calls: FLOPs and bytes per op over a hardware profile, plus collectives and overheads.

What it covers, per device of one tensor-parallel group (all numbers per device):

- **Ops.** Every decoder layer is the list of ops its description gives (``layer_ops.DecoderLayer.forward``, the
  description the memory walk builds its graphs from): the base linears (frozen: forward, and in backward only the input
  gradient), the LoRA adapters on the targeted linears (forward, and in backward both gradients), the attention core
  (full attention: quadratic in each sequence's length, causal half; gated DeltaNet: linear in length, chunked), and
  the elementwise work (norms, residuals, SwiGLU, RoPE, gates). An op takes ``max(flops / achieved FLOP/s, bytes /
  achieved bandwidth)`` plus a launch overhead: small ops are bound by streaming their weights, big ones by FLOPs.
- **Passes.** ``forward_backward`` = forward, the recompute the endpoint configures (full: every layer's forward again;
  selective: the attention cores; block: the first ``num_layers`` layers), and backward. ``forward`` = forward only.
  The LM head and log-prob run once per micro-batch: fused (chunked from hidden states) or materialised logits with
  the fp32 upcast and the re-expansion to the global width.
- **Collectives.** Tensor parallel: with sequence parallel, an all-gather before and a reduce-scatter after each of
  the two blocks of a layer (mirrored in backward and repeated by recompute); without it, an all-reduce after each
  block. The LoRA adapters' rank-sized all-reduces. Ring cost ``(tp-1)/tp x bytes / bandwidth + (tp-1) x latency``
  (doubled for all-reduce). Data parallel ranks run their micro-batches side by side; the LoRA gradients are
  all-reduced at the end of a forward_backward.
- **Fixed costs.** Per op, per micro-batch, per call and per datum row (the engine's own costs, the 100 ms iteration
  sleep, the 50 ms result poll and each submission, are the engine loop's and the clients', not this model's).
- **Sampling.** vLLM: prefill as a forward over the prompts, then one decode step per generated token, memory-bound
  on weights, KV cache and DeltaNet state; a fixed cost per sample call.
- **Singles.** optim_step streams the LoRA parameters and Adam state; checkpoint saves and loads move bytes over
  storage; ``create_model`` loads the base weights; each has a fixed part from the profile.

Speed: a run asks for thousands of calls, so the training path is compiled. Every op's FLOPs and bytes are affine in
a micro-batch's tokens, attention pairs and logit slots; per endpoint and pass kind the layers, the LM head's passes
and the embedding become one ``MicroBatchProgram`` (numpy arrays, evaluated in a dozen array operations); a padded
micro-batch's cost is read from its block of widths, evaluated at once (``WidthBlock``), other micro-batch costs are
kept by their variables, and call costs move as plain tuples. The op-by-op pricing stays as the reference
(``microbatch_reference``, ``call_reference``, ``layers_reference``) and the fast path equals it bit for bit.

Not covered: pipeline-parallel schedules beyond the classic bubble, context-parallel communication, MoE all-to-all,
compute/communication overlap. Coefficients are calibration inputs: the hardware profile's efficiencies and
overheads (``skyrl_sim.schema.hardware``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from skyrl_sim.engine.request import Request
from skyrl_sim.engine.shapes import CallShape, MicroBatch, round_up
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.hardware import HardwareProfile, load_profile
from skyrl_sim_plugins.sim.layer_ops import (
    CAUSAL_FRACTION,
    FP32,
    Collective,
    LayerWork,
    Op,
    Role,
    Setup,
    Unit,
    Work,
    decoder_layer,
    lm_head,
)
from skyrl_sim_plugins.sim.width_block import WIDTH_BLOCK, block_first

ADAM_BYTES_PER_PARAM = 28
"""optim_step traffic per trainable parameter: read fp32 param, grad, m, v (16 B), write param, m, v (12 B)."""
ADAM_STATE_BYTES_PER_PARAM = 12
"""A full checkpoint holds the fp32 master weight and both Adam moments besides the weight itself."""

ATTENTION_BACKWARD_FACTOR = 2.5
"""Attention-core backward vs forward FLOPs (flash attention recomputes the scores: 5 products against 2)."""
BACKWARD_FACTOR: dict[Role, float] = {"frozen": 1.0, "lora": 2.0, "core": ATTENTION_BACKWARD_FACTOR, "elementwise": 2.0}
"""Backward cost of an op relative to its forward: frozen linears need only the input gradient, adapters both."""


def layer_signature(model: ModelArch, index: int) -> tuple[str, bool]:
    """Layers with equal signatures cost the same: their kind and whether their MLP is MoE."""
    return model.layer_types[index], model.is_moe_layer(index)


def backward_of(forward: LayerWork) -> LayerWork:
    """Backward ops from forward ones by role; the collectives mirror forward's (gather <-> scatter)."""
    mirror = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "all_reduce"}
    out = LayerWork()
    for op in forward.ops:
        factor = BACKWARD_FACTOR[op.role]
        moved = op.bytes * factor if op.backward_bytes is None else op.backward_bytes
        out.ops.append(Op(f"{op.name}.grad", op.flops * factor, moved, op.unit, op.role))
    out.collectives = [Collective(f"{c.name}.grad", mirror[c.kind], c.bytes) for c in forward.collectives]  # type: ignore[arg-type]
    return out


FEATURES = ("matmul_s", "attention_s", "memory_s", "comm_s", "fixed_s")
"""The time terms a call's duration is the sum of: what ``calibrate`` fits one coefficient each for. Each op's
roofline time (``max`` of its FLOP time and its byte time) goes to its kind: GEMMs, attention cores, elementwise."""
UNIT_FEATURE: dict[str, str] = {"matmul": "matmul_s", "attention": "attention_s", "memory": "memory_s"}


Fields = tuple[float, float, float, float, float, float, float, int]
"""A ``Cost``'s values as a plain tuple, in ``FIELDS`` order (the hot path adds tuples, not dataclasses)."""
FIELDS = (*FEATURES, "flops", "bytes", "ops")
"""``Cost``'s fields in declaration order: the features first, so ``fields[:5]`` are the time terms."""
NO_COST: Fields = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)


def feature_weights(coefficients: dict[str, float]) -> tuple[float, ...]:
    """The calibrated coefficient of each feature, in ``FEATURES`` order (1 where none is given)."""
    return tuple(coefficients.get(name, 1.0) for name in FEATURES)


def weighted_seconds(weights: tuple[float, ...], fields: Fields) -> float:
    """A duration: each feature times its coefficient, summed in ``FEATURES`` order."""
    # One after the other, as ``sequential_sum`` (0.0 + x is x exactly).
    return (
        weights[0] * fields[0]
        + weights[1] * fields[1]
        + weights[2] * fields[2]
        + weights[3] * fields[3]
        + weights[4] * fields[4]
    )


def sequential_sum(values: Iterable[float]) -> float:
    """``values`` added one at a time from 0.0, in order: what every sum of seconds here means, and what the fast
    path reproduces (Python's own ``sum`` of floats compensates rounding from 3.12 on)."""
    total = 0.0
    for value in values:
        total += value
    return total


def total_seconds(fields: Fields) -> float:
    """The uncalibrated duration: the features summed in ``FEATURES`` order."""
    return fields[0] + fields[1] + fields[2] + fields[3] + fields[4]


def add_fields(total: Fields, one: Fields) -> Fields:
    """``total`` plus ``one`` field by field (``Cost.add`` with ``times`` 1)."""
    return (
        total[0] + one[0],
        total[1] + one[1],
        total[2] + one[2],
        total[3] + one[3],
        total[4] + one[4],
        total[5] + one[5],
        total[6] + one[6],
        total[7] + one[7],
    )


@dataclass
class Cost:
    """Seconds split by what bounds them (the ``FEATURES``), and the work behind them."""

    matmul_s: float = 0.0
    attention_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    fixed_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    ops: int = 0

    @property
    def total_s(self) -> float:
        return total_seconds(self.fields())

    def add(self, other: Cost, times: float = 1.0) -> Cost:
        self.matmul_s += other.matmul_s * times
        self.attention_s += other.attention_s * times
        self.memory_s += other.memory_s * times
        self.comm_s += other.comm_s * times
        self.fixed_s += other.fixed_s * times
        self.flops += other.flops * times
        self.bytes += other.bytes * times
        self.ops += round(other.ops * times)
        return self

    def features(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FEATURES}

    def seconds(self, coefficients: dict[str, float]) -> float:
        """The duration with calibrated coefficients per feature (1 where none is given)."""
        return weighted_seconds(feature_weights(coefficients), self.fields())

    def fields(self) -> Fields:
        """The values in ``FIELDS`` order."""
        return (self.matmul_s, self.attention_s, self.memory_s, self.comm_s, self.fixed_s, self.flops, self.bytes, self.ops)

    def as_dict(self) -> dict[str, float]:
        return {"total_s": self.total_s, **self.features(), "flops": self.flops, "bytes": self.bytes}


Runs = tuple[list[tuple[Op, float]], list[tuple[Collective, float]]]
"""Ops and collectives of a pass, each with how many times it runs (layers x recompute; may be fractional)."""


def once(layer: LayerWork) -> Runs:
    """A layer's ops and collectives, each run once (the LM head's passes, the embedding)."""
    return [(op, 1.0) for op in layer.ops], [(c, 1.0) for c in layer.collectives]


@dataclass(frozen=True)
class AffineOp:
    """An op run ``runs`` times whose FLOPs and bytes are affine in the pass's variables: ``flops`` and ``bytes``
    hold the constant first, then one coefficient per variable (``c + t x per_token + p x per_pair`` for a layer
    pass over t tokens and p attention pairs)."""

    unit: Unit
    runs: float
    flops: tuple[float, ...]
    bytes: tuple[float, ...]


@dataclass(frozen=True)
class AffineCollective:
    """A collective run ``runs`` times over a tensor whose size is affine in the pass's variables (as ``AffineOp``)."""

    kind: str
    runs: float
    bytes: tuple[float, ...]


@dataclass(frozen=True)
class AffinePass:
    """A pass's ops and collectives as affine functions of its variables: built once, evaluated per micro-batch."""

    ops: tuple[AffineOp, ...]
    collectives: tuple[AffineCollective, ...]

    @classmethod
    def build(cls, direct: Callable[..., Runs], variables: int = 2) -> AffinePass:
        """Probe ``direct`` at the origin and at each variable's unit point (``(0, 0)``, ``(1, 0)`` and ``(0, 1)``
        for two): exact for op lists whose FLOPs and bytes are affine in the variables."""
        zero = direct(*(0.0,) * variables)
        units = [direct(*(float(i == j) for j in range(variables))) for i in range(variables)]
        for unit in units:
            if len(unit[0]) != len(zero[0]) or len(unit[1]) != len(zero[1]):
                raise ValueError("the pass lists other ops at another probe point: it is not affine")
        ops = tuple(
            AffineOp(
                z.unit,
                runs,
                (z.flops, *(unit[0][k][0].flops - z.flops for unit in units)),
                (z.bytes, *(unit[0][k][0].bytes - z.bytes for unit in units)),
            )
            for k, (z, runs) in enumerate(zero[0])
        )
        collectives = tuple(
            AffineCollective(z.kind, runs, (z.bytes, *(unit[1][k][0].bytes - z.bytes for unit in units)))
            for k, (z, runs) in enumerate(zero[1])
        )
        return cls(ops, collectives)

    def cost(self, tokens: float, pairs: float, roofline: Roofline) -> Cost:
        """The pass's cost at ``tokens`` and ``pairs`` (a two-variable pass), op by op."""
        cost = Cost()
        launches = 0.0
        for op in self.ops:
            f0, ft, fp = op.flops
            b0, bt, bp = op.bytes
            flops = (f0 + ft * tokens + fp * pairs) * op.runs
            moved = (b0 + bt * tokens + bp * pairs) * op.runs
            seconds = roofline.seconds(op.unit, flops, moved)
            if op.unit == "matmul":
                cost.matmul_s += seconds
            elif op.unit == "attention":
                cost.attention_s += seconds
            else:
                cost.memory_s += seconds
            cost.flops += flops
            cost.bytes += moved
            launches += op.runs
        cost.ops = round(launches)
        cost.fixed_s = roofline.op_s * launches
        cost.comm_s = sequential_sum(
            c.runs * roofline.ring(c.kind, c.bytes[0] + c.bytes[1] * tokens + c.bytes[2] * pairs, roofline.tp)
            for c in self.collectives
        )
        return cost


class Roofline:
    """Times ops and collectives on one device of a profile."""

    def __init__(self, profile: HardwareProfile, devices: int, tp: int) -> None:
        share = profile.share(devices)
        self.matmul = profile.flops_matmul * share
        self.attention = profile.flops_attention * share
        self.memory = profile.bytes_memory * share
        self.link = profile.bytes_interconnect
        self.latency = profile.interconnect_latency_s
        self.op_s = profile.overheads.op_s
        self.tp = tp

    def seconds(self, unit: str, flops: float, moved: float) -> float:
        """An op's roofline time: its FLOP time or its byte time, whichever is longer."""
        return max(flops / (self.attention if unit == "attention" else self.matmul), moved / self.memory)

    def op(self, op: Op) -> Cost:
        cost = Cost(flops=op.flops, bytes=op.bytes, ops=1, fixed_s=self.op_s)
        setattr(cost, UNIT_FEATURE[op.unit], self.seconds(op.unit, op.flops, op.bytes))
        return cost

    def ring(self, kind: str, size: float, group: int) -> float:
        """Ring collective over ``group`` ranks of a ``size``-byte tensor."""
        if group <= 1:
            return 0.0
        share, latency = ring_terms(group, self.latency)
        steps = share * size / self.link + latency
        return ring_passes(kind) * steps

    def work(self, layer: LayerWork) -> Cost:
        """The layer's ops (``op`` of each, added one at a time: a feature the op does not have adds 0.0, which
        changes nothing) and its collectives' ring times."""
        matmul_s = attention_s = memory_s = fixed_s = flops = moved = 0.0
        for op in layer.ops:
            seconds = self.seconds(op.unit, op.flops, op.bytes)
            if op.unit == "matmul":
                matmul_s += seconds
            elif op.unit == "attention":
                attention_s += seconds
            else:
                memory_s += seconds
            fixed_s += self.op_s
            flops += op.flops
            moved += op.bytes
        comm_s = sequential_sum(self.ring(c.kind, c.bytes, self.tp) for c in layer.collectives)
        return Cost(matmul_s, attention_s, memory_s, comm_s, fixed_s, flops, moved, len(layer.ops))


def ring_terms(group: int, latency: float) -> tuple[float, float]:
    """A ring step's share of the tensor each rank sends, ``(group - 1) / group``, and the latency of its
    ``group - 1`` hops."""
    return (group - 1) / group, (group - 1) * latency


def ring_passes(kind: str) -> int:
    """How many times the ring goes round: an all-reduce is a reduce-scatter then an all-gather."""
    return 2 if kind == "all_reduce" else 1


SEGMENTS = ("layers", "head_forward", "head_backward", "embedding")
"""The parts of a micro-batch's cost, in the order the reference adds them (a forward's head backward is empty)."""
SEGMENT_FIELDS = ("matmul_s", "attention_s", "memory_s", "comm_s", "flops", "bytes")
"""What a micro-batch program sums per segment (the fixed seconds and the op count do not depend on the shape)."""
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

    The cost of a micro-batch is the sum of its **segments**, each an ``AffinePass`` over (tokens, pairs, logits):
    the layers of one stage (forward, recompute, backward), the LM head's forward, its backward, the embedding. Each
    row of ``affine`` is an op's FLOPs, an op's bytes or a collective's size before its run count; one evaluation
    computes every op's roofline seconds and every collective's ring time in a few array operations, and
    ``np.bincount`` (a sequential loop over the rows in order) sums them per segment and field. The result is bit
    for bit ``_EndpointModel.microbatch_reference``'s where ``exact`` says so:

    - **the affine part is exact.** The reference evaluates each row as ``((c + c_t t) + c_p p) + c_l l`` (the
      layers' ``AffinePass.cost``) or by the head's direct formulas (``LMHead.passes``: products and sums of the
      widths, the dtype sizes, the tokens and the logits). When the coefficients are non-negative multiples of
      ``2^-k``, the head's constants integers (``LMHead.integral``), the variables halves of integers and every row
      below ``2^(51-k)``, each product and partial sum of either form is a multiple of ``2^-(k+1)`` below ``2^(52-k)``:
      representable, so no step rounds, and one matrix-vector product gives the same numbers in any order;
    - **the rest is the reference's arithmetic in its order:** times the run count, divided by the rate, ``max`` of
      FLOP time and byte time; a ring's ``(share x size) / link + latency`` times ``passes x runs`` (a factor of 1 or
      2 scales exactly, so ``runs x (2 x steps)`` and ``(2 runs) x steps`` round the same product);
    - **the sums are sequential:** a segment's field is its rows' values added one at a time from 0.0 in op order
      (``Cost.add``, ``sequential_sum``), and the micro-batch's field ``((layers + head forward) + head backward) +
      embedding`` (``Cost.add`` in the reference's order); an empty segment adds 0.0.

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
    def build(cls, segments: list[AffinePass], roofline: Roofline, constants: Cost, integral: bool) -> MicroBatchProgram:
        """The program of ``segments`` (``SEGMENTS``, three-variable passes: tokens, pairs, logits) on ``roofline``.

        ``constants`` gives the fixed seconds and the op count (shape-independent: the reference's at any shape);
        ``integral`` whether the head's formulas have integer constants (if not, ``exact`` is always false)."""
        if len(segments) != len(SEGMENTS):
            raise ValueError(f"a micro-batch program has the segments {SEGMENTS}, got {len(segments)}")
        ops = [(index, op) for index, segment in enumerate(segments) for op in segment.ops]
        collectives = [(index, c) for index, segment in enumerate(segments) for c in segment.collectives]
        share, latency = ring_terms(roofline.tp, roofline.latency)
        in_ring = roofline.tp > 1  # ``Roofline.ring``: a group of one sends nothing
        rows = [op.flops for _, op in ops] + [op.bytes for _, op in ops] + [c.bytes for _, c in collectives]
        affine = np.array(rows, dtype=np.float64).reshape(len(rows), 1 + 3)
        width = len(SEGMENT_FIELDS)
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
                [op.runs for _, op in ops] * 2 + [share if in_ring else 0.0] * len(collectives), dtype=np.float64
            ),
            divisor=np.array(rate + [roofline.memory] * len(ops) + [roofline.link] * len(collectives), dtype=np.float64),
            ring_latency=latency,
            ring_factor=np.array(
                [ring_passes(c.kind) * c.runs if in_ring else 0.0 for _, c in collectives], dtype=np.float64
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
        """``evaluate``'s shape-dependent fields (``SEGMENT_FIELDS``, one row per lane) for every lane of float64
        arrays at once, bit for bit: the affine part is exact (the caller checks ``exact_lanes``), the rest is
        elementwise, and each segment's field is its rows added one at a time from 0.0 in row order, as
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
        s = np.zeros((len(SEGMENTS) * len(SEGMENT_FIELDS), len(tokens)))
        for row, slot in enumerate(self.bins.tolist()):
            s[slot] += weights[row]
        width = len(SEGMENT_FIELDS)
        # ((layers + head forward) + head backward) + embedding, field by field: [lanes, SEGMENT_FIELDS]
        return (((s[:width] + s[width : 2 * width]) + s[2 * width : 3 * width]) + s[3 * width :]).T.copy()

    def fields_of(self, segment_fields: list[float]) -> Fields:
        """A micro-batch's ``Fields`` from its summed ``SEGMENT_FIELDS`` (one lane of ``evaluate_lanes``)."""
        matmul, attention, memory, comm, flops, moved = segment_fields
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
        s = np.bincount(self.bins, weights=weights, minlength=len(SEGMENTS) * len(SEGMENT_FIELDS)).tolist()
        # ((layers + head forward) + head backward) + embedding, field by field (SEGMENTS x SEGMENT_FIELDS).
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


def recomputed_layers(endpoint: Endpoint, layers: int) -> int:
    """Layers whose forward runs again in backward (full recompute); selective recompute is handled per op."""
    recompute = endpoint.trainer.recompute
    if recompute.granularity != "full":
        return 0
    if recompute.method == "block":
        return min(recompute.num_layers, layers)
    return layers


def microbatch_variables(mb: MicroBatch, tp: int) -> tuple[float, float]:
    """A micro-batch's token slots and its attention pairs (per packed row, or per padded row)."""
    if mb.packed:
        pairs = sum(round_up(t, tp) ** 2 for t in mb.all_row_tokens) * CAUSAL_FRACTION
    else:
        pairs = mb.rows * mb.width**2 * CAUSAL_FRACTION
    return float(mb.slots), float(pairs)


def microbatch_work(mb: MicroBatch, tp: int) -> Work:
    """A micro-batch's work for each layer: its token slots, and its attention pairs (per packed row, or per padded row)."""
    return Work(*microbatch_variables(mb, tp))


RL_KIND = "forward_backward_rl"
"""The pass kind of a forward_backward on SkyRL's RL path (``CallShape.rl_path``): its head adds the entropy."""


def pass_kind(shape: CallShape) -> str:
    """What the time model prices a call's micro-batches as: ``forward``, ``forward_backward`` or ``RL_KIND``."""
    return RL_KIND if shape.rl_path else shape.kind


MICROBATCH_CACHE_SIZE = 65536
"""Micro-batch costs an endpoint model keeps (a few hundred bytes each); past it the cache starts over."""
SAMPLE_CACHE_SIZE = 4096
"""Sample-call durations an endpoint model keeps; past it the cache starts over."""
MAX_WIDTH_BLOCKS = 256
"""Blocks an endpoint model keeps (about 25 kB each); past it the cache starts over."""
MAX_BLOCK_PAIRS = 2**62
"""A block whose largest rows x width^2 reaches this is not evaluated (its micro-batches are costed one at a time):
a block's variables are made in int64, and this keeps them far from wrapping."""


@dataclass(frozen=True)
class WidthBlock:
    """The costs of a block of padded micro-batches of one kind and row count: the widths ``first`` to ``first +
    WIDTH_BLOCK - 1`` times TP, each with the logits widths 0 to TP - 1 below it; lane ``(w - first) x TP + d`` is
    width ``w`` x TP with logits width d below it. ``fields`` holds each lane's summed ``SEGMENT_FIELDS``, valid
    where ``exact`` (elsewhere the micro-batch is costed alone, by the reference)."""

    first: int  # the first lane's width, in multiples of TP
    program: MicroBatchProgram  # the program the block was evaluated with (its fixed seconds and op count)
    fields: np.ndarray  # [lanes, SEGMENT_FIELDS]
    exact: list[bool]


class _EndpointModel:
    """The time model bound to one endpoint and model: layer costs grouped by signature, micro-batch costs cached."""

    def __init__(self, endpoint: Endpoint, model: ModelArch) -> None:
        self.endpoint = endpoint
        self.model = model
        self.profile = load_profile(endpoint.hardware.profile)
        self.setup = Setup.of(endpoint, model=model)
        p = endpoint.parallelism
        self.tp, self.pp, self.cp, self.dp = p.tp, p.pp, p.cp, p.dp
        self.roofline = Roofline(self.profile, endpoint.hardware.devices, p.tp)
        counts: dict[tuple[str, bool], tuple[int, int]] = {}
        for index in range(model.num_layers):
            sig = layer_signature(model, index)
            first, n = counts.get(sig, (index, 0))
            counts[sig] = (first, n + 1)
        self.layer_groups = [(first, n / p.pp) for first, n in counts.values()]
        self.layer_kinds = [decoder_layer(model, first) for first, _ in self.layer_groups]
        self.head = lm_head(model)
        self._sampler_setups: dict[bool, Setup] = {}
        self._singles: dict[str, float] = {}
        self._samples: dict[tuple[tuple[int, int, int, bool], ...], float] = {}
        self.recompute_fraction = recomputed_layers(endpoint, model.num_layers) / model.num_layers
        self._programs: dict[bool, AffinePass] = {}
        self._microbatch_programs: dict[str, MicroBatchProgram] = {}
        self._microbatches: dict[tuple[str, float, float, float], Fields] = {}
        self._width_blocks: dict[tuple[str, int, int], WidthBlock] = {}
        self.lora_params = lora_parameter_count(model, endpoint)
        self.weights = feature_weights(self.profile.time_coefficients)
        over = self.profile.overheads
        self.call_fixed = (over.call_s, over.row_s)
        grads = self.lora_params / p.tp * FP32
        self.gradient_all_reduce_s = self.roofline.ring("all_reduce", grads, p.dp)

    def _split_cp(self, work: Work) -> Work:
        cp = self.endpoint.parallelism.cp
        if cp == 1:
            return work
        return Work(work.tokens / cp, work.pairs / cp, work.decode, work.sequences, work.context)

    def layers(self, work: Work, backward: bool) -> Cost:
        """Forward (and recompute and backward) of every layer of one pipeline stage over ``work`` (fast path).

        Every training op's FLOPs and bytes are affine in the micro-batch's tokens and attention pairs, so the op
        lists are built once per endpoint (``AffinePass``) and each micro-batch only evaluates them.
        """
        program = self._programs.get(backward)
        if program is None:
            program = self._programs[backward] = AffinePass.build(
                lambda tokens, pairs: self.layers_direct(Work(tokens, pairs), backward)
            )
        return program.cost(work.tokens, work.pairs, self.roofline)

    def layers_direct(self, work: Work, backward: bool) -> Runs:
        """Every op and collective of one stage's layers over ``work``, each with how many times it runs."""
        ops: list[tuple[Op, float]] = []
        collectives: list[tuple[Collective, float]] = []
        selective = self.endpoint.trainer.recompute.granularity == "selective"
        for layer, (_, count) in zip(self.layer_kinds, self.layer_groups, strict=True):
            fwd = layer.forward(work, self.setup)
            runs = count * (1 + (self.recompute_fraction if backward else 0.0))
            ops += [(op, runs) for op in fwd.ops]
            collectives += [(c, runs) for c in fwd.collectives]
            if backward:
                bwd = backward_of(fwd)
                ops += [(op, count) for op in bwd.ops]
                collectives += [(c, count) for c in bwd.collectives]
                if selective:
                    ops += [(op, count) for op in fwd.ops if op.role == "core"]
        return ops, collectives

    def layers_reference(self, work: Work, backward: bool) -> Cost:
        """The same cost as ``layers``, op by op (slow; the fast path is tested against it)."""
        total = Cost()
        selective = self.endpoint.trainer.recompute.granularity == "selective"
        for layer, (_, count) in zip(self.layer_kinds, self.layer_groups, strict=True):
            fwd = layer.forward(work, self.setup)
            fwd_cost = self.roofline.work(fwd)
            total.add(fwd_cost, count)
            if backward:
                total.add(self.roofline.work(backward_of(fwd)), count)
                total.add(fwd_cost, count * self.recompute_fraction)
                if selective:
                    core = LayerWork([op for op in fwd.ops if op.role == "core"])
                    total.add(self.roofline.work(core), count)
        return total

    def microbatch_reference(self, kind: str, tokens: float, pairs: float, logits_tokens: float) -> Cost:
        """One micro-batch: the layers (``layers``), the LM head's passes and the embedding priced op by op from
        their descriptions, the per-micro-batch overhead. The meaning of a micro-batch's cost; ``microbatch_fields``
        is the fast path, bit for bit equal to it."""
        work = self._split_cp(Work(tokens, pairs))
        backward = kind != "forward"
        cost = self.layers(work, backward)
        head = lm_head(self.model)
        fused = self.endpoint.trainer.fused_lm_head_logprob
        fwd, bwd = head.passes(work, logits_tokens, self.setup, fused, entropy=kind == RL_KIND)
        cost.add(self.roofline.work(fwd))
        if backward:
            cost.add(self.roofline.work(bwd))
        cost.add(self.roofline.op(head.embedding(work, self.setup)))
        cost.fixed_s += self.profile.overheads.microbatch_s
        return cost

    def microbatch_program(self, kind: str) -> MicroBatchProgram:
        """The ``MicroBatchProgram`` of a pass kind (``pass_kind``: a forward, a forward_backward, or one on SkyRL's
        RL path), built on first use."""
        program = self._microbatch_programs.get(kind)
        if program is None:
            head = self.head
            fused = self.endpoint.trainer.fused_lm_head_logprob
            backward, entropy = kind != "forward", kind == RL_KIND

            def head_pass(direction: int) -> Callable[[float, float, float], Runs]:
                def passes(t: float, p: float, logits: float) -> Runs:
                    return once(head.passes(Work(t, p), logits, self.setup, fused, entropy=entropy)[direction])

                return passes

            segments = [
                AffinePass.build(lambda t, p, logits: self.layers_direct(Work(t, p), backward), 3),
                AffinePass.build(head_pass(0), 3),
                AffinePass.build(head_pass(1) if backward else lambda t, p, logits: ([], []), 3),
                AffinePass.build(lambda t, p, logits: ([(head.embedding(Work(t, p), self.setup), 1.0)], []), 3),
            ]
            constants = self.microbatch_reference(kind, 0.0, 0.0, 0.0)
            integral = head.integral(self.setup)
            program = MicroBatchProgram.build(segments, self.roofline, constants, integral)
            self._microbatch_programs[kind] = program
        return program

    def microbatch_fields(self, kind: str, tokens: float, pairs: float, logits_tokens: float) -> Fields:
        """One micro-batch's cost (``microbatch_reference``'s, bit for bit), cached by its variables."""
        key = (kind, tokens, pairs, logits_tokens)
        fields = self._microbatches.get(key)
        if fields is None:
            cp = self.cp
            split_tokens, split_pairs = (tokens, pairs) if cp == 1 else (tokens / cp, pairs / cp)
            program = self._microbatch_programs.get(kind)
            if program is None:
                program = self.microbatch_program(kind)
            if program.exact(split_tokens, split_pairs, logits_tokens):
                fields = program.evaluate(split_tokens, split_pairs, logits_tokens)
            else:
                fields = self.microbatch_reference(kind, tokens, pairs, logits_tokens).fields()
            if len(self._microbatches) >= MICROBATCH_CACHE_SIZE:
                self._microbatches.clear()
            self._microbatches[key] = fields
        return fields

    def padded_fields(self, kind: str, rows: int, width: int, logits_width: int) -> Fields | None:
        """The cost of a padded micro-batch (``rows`` rows of ``width`` slots, logits over ``logits_width`` each) whose
        logits width is less than TP below its width (a call's longest row, below its width rounded up to TP): bit
        for bit ``microbatch_fields`` of its variables, read from its block of widths (``WidthBlock``: every such
        logits width of WIDTH_BLOCK widths), which is evaluated whole on first use. None where no block applies
        (context parallel, another logits width, a width that is not a multiple of TP, a block past
        ``MAX_BLOCK_PAIRS``, a lane the program is not exact on): cost it alone. A call's other micro-batches take
        the call's global width as their logits width, a distance that rarely repeats; a block evaluated for one of
        them would cost more than the micro-batch alone."""
        tp = self.tp
        distance = width - logits_width
        if self.cp != 1 or width % tp or width <= 0 or not 0 <= distance < tp:
            return None
        first = block_first(width, tp)
        key = (kind, rows, first)
        block = self._width_blocks.get(key)
        if block is None:
            widest = tp * (first + WIDTH_BLOCK - 1)
            if rows * widest * widest >= MAX_BLOCK_PAIRS:
                return None
            if len(self._width_blocks) >= MAX_WIDTH_BLOCKS:
                self._width_blocks.clear()
            block = self._width_blocks[key] = self._width_block(kind, rows, first)
        lane = (width // tp - block.first) * tp + distance
        if not block.exact[lane]:
            return None
        return block.program.fields_of(block.fields[lane].tolist())

    def _width_block(self, kind: str, rows: int, first: int) -> WidthBlock:
        """Evaluate a block: widths ``first`` to ``first + WIDTH_BLOCK - 1`` times TP, each with the logits widths 0
        to TP - 1 below it, in that order."""
        program = self.microbatch_program(kind)
        tp = self.tp
        start = max(first, 1)
        widths = np.repeat(tp * np.arange(start, first + WIDTH_BLOCK, dtype=np.int64), tp)
        logits_widths = widths - np.tile(np.arange(tp, dtype=np.int64), len(widths) // tp)
        # The variables as ``microbatch_variables`` and ``call_fields`` make them: integer products, then floats.
        tokens = (rows * widths).astype(np.float64)
        pairs = (rows * widths * widths).astype(np.float64) * CAUSAL_FRACTION
        logits = (rows * logits_widths).astype(np.float64)
        exact = program.exact_lanes(tokens, pairs, logits) & (logits_widths > 0)
        return WidthBlock(start, program, program.evaluate_lanes(tokens, pairs, logits), exact.tolist())

    def call_fields(self, shape: CallShape) -> Fields:
        """A call's cost: the slowest data-parallel rank's micro-batches (one stage's, plus the pipeline bubble), the
        call and row overheads, the LoRA gradients' all-reduce over DP after a forward_backward."""
        kind, logits_width, tp, pp = pass_kind(shape), shape.logits_width, self.tp, self.pp
        # Each rank's micro-batches in call order, added one after the other (``Cost.add`` from zero; a rank's first
        # is taken as it is: 0.0 + x is x, and no cost is negative).
        ranks = [NO_COST] * self.dp
        longest = [0.0] * self.dp
        for mb in shape.microbatches:
            one = None if mb.packed or not logits_width else self.padded_fields(kind, mb.rows, mb.width, logits_width)
            if one is None:
                tokens, pairs = microbatch_variables(mb, tp)
                logits = float(mb.rows * logits_width) if logits_width and not mb.packed else tokens
                one = self.microbatch_fields(kind, tokens, pairs, logits)
            rank = mb.dp_rank
            so_far = ranks[rank]
            ranks[rank] = one if so_far is NO_COST else add_fields(so_far, one)
            if pp > 1:
                longest[rank] = max(longest[rank], total_seconds(one))
        slowest, slowest_s = NO_COST, 0.0
        for rank, rank_cost in enumerate(ranks):
            if pp > 1:
                # Costs above are one stage's; the classic 1F1B bubble adds (pp - 1) slots of the longest micro-batch.
                bubble = rank_cost[4] + (pp - 1) * longest[rank]
                rank_cost = (*rank_cost[:4], bubble, *rank_cost[5:])  # type: ignore[assignment]
            rank_s = total_seconds(rank_cost)
            if rank_s >= slowest_s:
                slowest, slowest_s = rank_cost, rank_s
        matmul_s, attention_s, memory_s, comm_s, fixed_s, flops, moved, ops = slowest
        if kind != "forward" and self.dp > 1:
            comm_s += self.gradient_all_reduce_s
        call_s, row_s = self.call_fixed
        return (matmul_s, attention_s, memory_s, comm_s, fixed_s + (call_s + row_s * shape.rows), flops, moved, ops)

    def call(self, shape: CallShape) -> Cost:
        return Cost(*self.call_fields(shape))

    def call_reference(self, shape: CallShape) -> Cost:
        """The same cost as ``call``, from ``Cost`` objects and ``microbatch_reference`` (slow; the fast path is
        tested against it)."""
        p = self.endpoint.parallelism
        slowest = Cost()
        for rank in range(p.dp):
            rank_cost = Cost()
            longest = 0.0
            for mb in shape.microbatches_of_rank(rank):
                work = microbatch_work(mb, p.tp)
                logits = mb.rows * shape.logits_width if shape.logits_width and not mb.packed else work.tokens
                one = self.microbatch_reference(pass_kind(shape), work.tokens, work.pairs, float(logits))
                rank_cost.add(one)
                longest = max(longest, one.total_s)
            if p.pp > 1:
                rank_cost.fixed_s += (p.pp - 1) * longest
            if rank_cost.total_s >= slowest.total_s:
                slowest = rank_cost
        over = self.profile.overheads
        slowest.fixed_s += over.call_s + over.row_s * shape.rows
        if shape.kind == "forward_backward" and p.dp > 1:
            grads = self.lora_params / p.tp * FP32
            slowest.comm_s += self.roofline.ring("all_reduce", grads, p.dp)
        return slowest

    def call_seconds(self, shape: CallShape) -> float:
        """A call's duration with the profile's calibrated coefficients."""
        return weighted_seconds(self.weights, self.call_fields(shape))

    def sample(self, requests: list[Request]) -> Cost:
        with_lora = any(r.checkpoint for r in requests)
        setup = self._sampler_setups.get(with_lora)
        if setup is None:
            # vLLM: tensor parallel, no sequence parallel, its own fused attention kernels whatever the trainer's.
            setup = Setup.of(self.endpoint, lora=with_lora, model=self.model)
            setup = self._sampler_setups[with_lora] = replace(setup, sequence_parallel=False, unfused_attention=False)
        cost = Cost(fixed_s=self.profile.overheads.sample_call_s)
        prompts = [r.prompt_tokens for r in requests]
        prefill = Work(float(sum(prompts)), float(sum(p * p for p in prompts) * CAUSAL_FRACTION))
        # prompt log-probs (compute_logprobs): vLLM computes the logits of every prompt position, not just the last
        scored = float(sum(r.prompt_tokens - 1 for r in requests if r.prompt_logprobs))
        cost.add(self._sampler_pass(prefill, setup, float(len(requests)) + scored))
        if scored:
            cost.add(self.roofline.op(self.head.prompt_log_softmax(scored)))
        steps = max((r.max_tokens for r in requests), default=0)
        sequences = sum(r.num_samples for r in requests)
        if steps and sequences:
            context = sequential_sum(r.num_samples * (r.prompt_tokens + r.max_tokens / 2) for r in requests) / sequences
            step = Work(float(sequences), 0.0, decode=True, sequences=sequences, context=context)
            cost.add(self._sampler_pass(step, setup, float(sequences)), steps)
        return cost

    def sample_seconds(self, requests: list[Request]) -> float:
        """A sample call's duration, kept by what ``sample`` reads of its requests, in order (a service's sample calls
        repeat a few prompt and generation lengths)."""
        key = tuple((r.prompt_tokens, r.max_tokens, r.num_samples, bool(r.checkpoint), r.prompt_logprobs) for r in requests)
        seconds = self._samples.get(key)
        if seconds is None:
            if len(self._samples) >= SAMPLE_CACHE_SIZE:
                self._samples.clear()
            seconds = self._samples[key] = self.sample(requests).seconds(self.profile.time_coefficients)
        return seconds

    def _sampler_pass(self, work: Work, vllm: Setup, logits_rows: float) -> Cost:
        """One vLLM forward over ``work`` with the sampler's setup; logits only for each sequence's last token."""
        cost = Cost()
        for layer, (_, count) in zip(self.layer_kinds, self.layer_groups, strict=True):
            cost.add(self.roofline.work(layer.forward(work, vllm)), count * self.pp)
        cost.add(self.roofline.op(self.head.last_token_logits(logits_rows, vllm)))
        return cost

    def single_seconds(self, request: Request) -> float:
        """A single request's duration: it depends on the request's type only, so it is kept per type."""
        seconds = self._singles.get(request.type)
        if seconds is None:
            seconds = self._singles[request.type] = self.single(request).seconds(self.profile.time_coefficients)
        return seconds

    def single(self, request: Request) -> Cost:
        """A single request's cost (what it reads of the request: its type)."""
        over = self.profile.overheads
        cost = Cost(fixed_s=over.single(request.type))
        lora = self.lora_params
        d = self.setup.dtype
        storage = self.profile.storage_bandwidth
        if request.type == "optim_step":
            cost.add(self.roofline.op(Op("adam", 0.0, lora * ADAM_BYTES_PER_PARAM, "memory", "elementwise")))
        elif request.type == "save_weights_for_sampler":
            cost.memory_s += lora * d / storage
        elif request.type in ("save_weights", "load_weights"):
            cost.memory_s += lora * (d + ADAM_STATE_BYTES_PER_PARAM) / storage
        elif request.type == "create_model":
            params = self.model.parameter_count()
            if not self.endpoint.trainer.language_model_only:
                params += self.model.vision_params
            cost.memory_s += params * d / self.endpoint.parallelism.tp / storage
        return cost


def lora_parameter_count(model: ModelArch, endpoint: Endpoint) -> int:
    """Trainable adapter parameters: rank x (in + out) for every adapted linear of every layer."""
    r, targets = endpoint.lora.rank, endpoint.adapted_targets(model)
    return sum(
        copies * linear.adapter_parameters(r)
        for index in range(model.num_layers)
        for linear, copies in decoder_layer(model, index).adapted_linears(targets)
    )


class RooflineTimeModel:
    """``TimeModel`` from FLOPs, bytes and collectives over the endpoint's hardware profile (see the module doc)."""

    def __init__(self) -> None:
        self._bound: dict[tuple[str, ModelArch], _EndpointModel] = {}
        self._last: tuple[Endpoint, ModelArch, _EndpointModel] | None = None

    def bind(self, endpoint: Endpoint, model: ModelArch) -> _EndpointModel:
        """The model for one endpoint (cached: a run asks about the same endpoint thousands of times).

        The same endpoint object as the last call is answered at once (a run holds one endpoint and does not change
        it while it runs); any other is looked up by its settings.
        """
        last = self._last
        if last is not None and last[0] is endpoint and last[1] is model:
            return last[2]
        key = (endpoint.model_dump_json(), model)
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = _EndpointModel(endpoint, model)
        self._last = (endpoint, model, bound)
        return bound

    def call_cost(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> Cost:
        return self.bind(endpoint, model).call(shape)

    def features(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> dict[str, float]:
        """A pass call's time terms in seconds on the uncalibrated profile (``calibrate`` fits a factor for each)."""
        return self.call_cost(shape, endpoint, model).features()

    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        return self.bind(endpoint, model).call_seconds(shape)

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        return self.bind(endpoint, model).sample_seconds(requests)

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        return self.bind(endpoint, model).single_seconds(request)


def default_time_model() -> RooflineTimeModel:
    return RooflineTimeModel()

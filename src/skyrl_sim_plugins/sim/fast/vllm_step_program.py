"""The price of vLLM engine steps, fast: a step's ops compiled once per endpoint into affine rows over its variables
(``StepProgram``), so any number of steps are priced in a few array operations, and a run of decode steps in closed
form (``DecodeRun``).

Every op's FLOPs and bytes are affine in the step's variables (``reference.vllm_step_cost.VARIABLES``), so the ops
become two matrices once per endpoint (``StepProgram.build``, which checks the fit) and a step is priced with a
few array operations (``StepPrices.seconds``); a run of decode steps between two scheduler events is priced at once
(``StepPrices.decode``: each op's FLOP and byte times are lines in the step index, and the sum of their maxima has
a closed form). Held to the reference pricing op by op (``reference.vllm_step_cost.StepReference``) and a decode
run to its steps priced one by one by ``tests/test_vllm_model.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from skyrl_sim.api import Endpoint, ModelArch, load_profile
from skyrl_sim_plugins.sim.reference.time_model import FEATURES, Roofline, ring_passes, ring_terms
from skyrl_sim_plugins.sim.reference.vllm_step_cost import UNIT_INDEX, VARIABLES, step_listing, vllm_setup

AFFINE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class StepProgram:
    """One engine step's ops as affine rows over ``(1, *VARIABLES)``: FLOPs, bytes, the rate each op's unit runs at
    and its feature; collectives as affine sizes. Built once per endpoint, evaluated per run of steps."""

    flops: np.ndarray  # [ops, 1 + variables]
    bytes: np.ndarray  # [ops, 1 + variables]
    runs: np.ndarray  # [ops]
    rate: np.ndarray  # [ops] FLOP/s of each op's unit
    unit: np.ndarray  # [ops] 0 matmul, 1 attention, 2 memory
    memory_rate: float
    collective_sizes: np.ndarray  # [collectives, 1 + variables]
    collective_weight: np.ndarray  # [collectives] runs x passes x share / link
    collective_latency: np.ndarray  # [collectives] runs x passes x latency
    fixed_s: float  # the launch overheads of every op plus the step's own

    @classmethod
    def build(cls, endpoint: Endpoint, model: ModelArch) -> StepProgram:
        """Probe the step's listing at a base point and one step along each variable (the decode attention needs a
        sequence, so the base point is 1 everywhere, not 0), and check the fit at another point."""
        inference = endpoint.inference
        profile = load_profile(endpoint.hardware.profile)
        tp = inference.tensor_parallel_size
        roofline = Roofline(profile, inference.num_engines * tp, tp)
        listing = step_listing(model, vllm_setup(endpoint, model))
        n = len(VARIABLES)
        base = np.ones(n)
        points = [base] + [base + np.eye(n)[i] for i in range(n)]
        probes = [listing(*p.tolist()) for p in points]
        ops0, coll0 = probes[0]
        for ops, coll in probes[1:]:
            if len(ops) != len(ops0) or len(coll) != len(coll0):
                raise ValueError("the vLLM step lists other ops at another probe point: it is not affine")

        def affine(values: list[np.ndarray]) -> np.ndarray:
            slopes = np.stack([v - values[0] for v in values[1:]], axis=1)  # [rows, n]
            constant = values[0] - slopes.sum(axis=1)
            return np.column_stack([constant, slopes])

        flops = affine([np.array([op.flops for op, _ in ops]) for ops, _ in probes])
        moved = affine([np.array([op.bytes for op, _ in ops]) for ops, _ in probes])
        sizes = (
            affine([np.array([c.bytes for c, _ in coll]) for _, coll in probes])
            if coll0
            else np.zeros((0, n + 1))
        )
        check = np.array([2.0, 3.0, 5.0, 7.0, 11.0, 13.0])
        ops_check, _ = listing(*check.tolist())
        row = np.concatenate([[1.0], check])
        expected = np.array([op.flops for op, _ in ops_check]) + np.array([op.bytes for op, _ in ops_check])
        got = flops @ row + moved @ row
        if not np.allclose(got, expected, rtol=AFFINE_TOLERANCE, atol=1e-6):
            raise ValueError("the vLLM step's ops are not affine in its variables")
        units = np.array([UNIT_INDEX[op.unit] for op, _ in ops0])
        rates = np.where(units == 1, roofline.attention, roofline.matmul)
        runs = np.array([r for _, r in ops0], dtype=float)
        share, latency = ring_terms(tp, roofline.latency) if tp > 1 else (0.0, 0.0)
        coll_runs = np.array([r * ring_passes(c.kind) for c, r in coll0], dtype=float)
        weight = coll_runs * share / roofline.link if tp > 1 else np.zeros(len(coll0))
        lat = coll_runs * latency if tp > 1 else np.zeros(len(coll0))
        fixed = roofline.op_s * float(runs.sum()) + profile.overheads.vllm_step_s
        return cls(flops, moved, runs, rates, units, roofline.memory, sizes, weight, lat, fixed)

    def bind(self, weights: np.ndarray) -> StepPrices:
        """Prices with the calibrated factor of each feature (``step_weights``)."""
        return StepPrices(self, weights)

    def features(self, variables: np.ndarray) -> np.ndarray:
        """``[steps, len(FEATURES)]`` seconds of each step whose variables are the rows of ``variables`` (``[steps,
        len(VARIABLES)]``)."""
        x = np.column_stack([np.ones(len(variables)), variables])
        seconds = np.maximum((x @ self.flops.T) / self.rate, (x @ self.bytes.T) / self.memory_rate) * self.runs
        out = np.zeros((len(variables), len(FEATURES)))
        for unit in range(3):
            out[:, unit] = seconds[:, self.unit == unit].sum(axis=1)
        if len(self.collective_weight):
            sizes = x @ self.collective_sizes.T
            out[:, 3] = (sizes * self.collective_weight + self.collective_latency).sum(axis=1)
        out[:, 4] = self.fixed_s
        return out


def sum_of_max(p1: float, q1: float, p2: float, q2: float, n: int) -> float:
    """``sum(max(p1 + q1 j, p2 + q2 j) for j in range(n))`` in closed form: the two lines cross at most once."""
    if n <= 0:
        return 0.0
    dq = q1 - q2
    if dq == 0:
        return _series(p1, q1, 0, n) if p1 >= p2 else _series(p2, q2, 0, n)
    # where the lines cross, held to [-1, n]: a tiny slope difference puts it past any step (or at infinity)
    root = min(float(n), max(-1.0, (p2 - p1) / dq))
    if dq > 0:  # the first line is the larger from the root on: the second up to ``split``, the first after
        split = min(n, max(0, math.ceil(root)))
        low_p, low_q, high_p, high_q = p2, q2, p1, q1
    else:  # the first line is the larger up to the root
        split = min(n, max(0, math.floor(root) + 1))
        low_p, low_q, high_p, high_q = p1, q1, p2, q2
    # ``_series(low, 0, split) + _series(high, split, n)``, written out (this runs on every scheduler event)
    total = split * low_p + low_q * split * (split - 1) / 2 if split > 0 else 0.0
    count = n - split
    return total + (count * high_p + high_q * count * (split + n - 1) / 2 if count > 0 else 0.0)


def _series(p: float, q: float, start: int, stop: int) -> float:
    """``sum(p + q j for j in range(start, stop))``."""
    count = stop - start
    if count <= 0:
        return 0.0
    return count * p + q * count * (start + stop - 1) / 2


class DecodeRun:
    """The step times of a run of decode steps of ``seqs`` sequences whose KV context grows by ``seqs`` tokens a
    step: ``elapsed(n)``, the seconds of the first ``n`` steps, in closed form (no step is priced one by one)."""

    __slots__ = ("constant", "lines", "_terms")

    def __init__(self, constant: float, lines: list[tuple[float, float, float, float, float]]) -> None:
        self.constant = constant
        self.lines = lines  # per context-dependent op: weight, FLOP-time line (p, q), byte-time line (p, q)
        self._terms = [split_lines(*line) for line in lines]

    def step(self, j: int) -> float:
        """The seconds of step ``j``."""
        return self.constant + sum(w * max(p1 + q1 * j, p2 + q2 * j) for w, p1, q1, p2, q2 in self.lines)

    def elapsed(self, n: int) -> float:
        """``n`` steps' seconds: per line pair ``sum_of_max``, with where the lines cross found once per run (the same
        arithmetic, so the same result; a segment asks this at its planning and again where an arrival cuts it)."""
        total = 0
        for w, cut, low_p, low_q, high_p, high_q in self._terms:
            if n <= 0:
                total += w * 0.0
                continue
            split = n if cut > n else cut
            low = split * low_p + low_q * split * (split - 1) / 2 if split > 0 else 0.0
            count = n - split
            total += w * (low + (count * high_p + high_q * count * (split + n - 1) / 2 if count > 0 else 0.0))
        return n * self.constant + total


def split_lines(
    w: float, p1: float, q1: float, p2: float, q2: float
) -> tuple[float, int | float, float, float, float, float]:
    """``sum_of_max`` of two lines prepared for any number of steps: the weight, the step from which the other line is
    the larger (``split = min(n, cut)``; ``inf``: never), and the lines below and above that step. ``sum_of_max(p1,
    q1, p2, q2, n)`` is ``series(low, 0, split) + series(high, split, n)``, as it computes it."""
    dq = q1 - q2
    if dq == 0:
        p, q = (p1, q1) if p1 >= p2 else (p2, q2)
        return w, 0, p, q, p, q
    root = max(-1.0, (p2 - p1) / dq)  # held to >= -1 here and to <= n in ``elapsed`` (``min(n, cut)``)
    if dq > 0:  # the first line is the larger from the root on
        cut = math.inf if root == math.inf else max(0, math.ceil(root))
        return w, cut, p2, q2, p1, q1
    cut = math.inf if root == math.inf else max(0, math.floor(root) + 1)
    return w, cut, p1, q1, p2, q2


class StepPrices:
    """A ``StepProgram`` with calibrated feature weights: one step's seconds (``seconds``), or a decode run's
    (``decode``), the part of a decode step that does not depend on the context kept per batch size."""

    def __init__(self, program: StepProgram, weights: np.ndarray) -> None:
        self.program = program
        self.weights = weights
        self.op_weight = weights[program.unit] * program.runs
        self.comm_weight = float(weights[3])
        self.fixed = float(weights[4]) * program.fixed_s
        context = VARIABLES.index("decode_context") + 1
        self.context_ops = np.nonzero((program.flops[:, context] != 0) | (program.bytes[:, context] != 0))[0]
        self.other_ops = np.setdiff1d(np.arange(len(program.runs)), self.context_ops)
        self._ops = len(program.runs)
        self._both = np.vstack([program.flops, program.bytes])
        self._both_rate = np.concatenate([program.rate, np.full(self._ops, program.memory_rate)])
        self._decode_shape: dict[int, tuple[float, list[tuple[float, ...]]]] = {}

    def seconds(self, tokens: float, prefill: float, pairs: float, seqs: float, context: float, rows: float) -> float:
        """One step's seconds at its variables."""
        p = self.program
        row = np.array((1.0, tokens, prefill, pairs, seqs, context, rows))
        times = (self._both @ row) / self._both_rate  # the FLOP times, then the byte times
        count = self._ops
        total = float(np.maximum(times[:count], times[count:]) @ self.op_weight) + self.fixed
        if len(p.collective_weight):
            sizes = p.collective_sizes @ row
            total += self.comm_weight * float((sizes * p.collective_weight + p.collective_latency).sum())
        return total

    def decode(self, seqs: int, context: float) -> DecodeRun:
        """The decode steps of ``seqs`` sequences holding ``context`` KV tokens in all at the first step."""
        shape = self._decode_shape.get(seqs)
        if shape is None:
            shape = self._decode_shape[seqs] = self._shape(seqs)
        constant, terms = shape
        lines = [
            (w, (f0 + fc * context) / rate, q1, (b0 + bc * context) / memory, q2)
            for w, f0, fc, rate, q1, b0, bc, memory, q2 in terms
        ]
        return DecodeRun(constant, lines)

    def _shape(self, seqs: int) -> tuple[float, list[tuple[float, ...]]]:
        """What a decode run of ``seqs`` sequences owes to their number, whatever their context: the seconds of the
        ops that do not read the KV context, and per op that does its weight, FLOP and byte lines' intercepts
        before the context, their slopes in it and its rates (``decode`` adds the context)."""
        p = self.program
        row = np.array([1.0, seqs, 0.0, 0.0, seqs, 0.0, seqs])
        ops = self.other_ops
        times = np.maximum((p.flops[ops] @ row) / p.rate[ops], (p.bytes[ops] @ row) / p.memory_rate)
        constant = float(times @ self.op_weight[ops]) + self.fixed
        if len(p.collective_weight):
            sizes = p.collective_sizes @ row
            constant += self.comm_weight * float((sizes * p.collective_weight + p.collective_latency).sum())
        c = VARIABLES.index("decode_context") + 1
        memory = float(p.memory_rate)
        terms = []
        for op in self.context_ops.tolist():
            f, b = p.flops[op].tolist(), p.bytes[op].tolist()
            rate = float(p.rate[op])
            terms.append(
                (
                    float(self.op_weight[op]),
                    f[0] + seqs * (f[1] + f[4] + f[6]),
                    f[c],
                    rate,
                    f[c] * seqs / rate,
                    b[0] + seqs * (b[1] + b[4] + b[6]),
                    b[c],
                    memory,
                    b[c] * seqs / memory,
                )
            )
        return constant, terms

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

Not covered: pipeline-parallel schedules beyond the classic bubble, context-parallel communication, MoE all-to-all,
compute/communication overlap. Coefficients are calibration inputs: the hardware profile's efficiencies and
overheads (``skyrl_sim.schema.hardware``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from skyrl_sim.engine.shapes import CallShape, MicroBatch, round_up
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.hardware import HardwareProfile, load_profile
from skyrl_sim.schema.scenario import Request
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
        return self.matmul_s + self.attention_s + self.memory_s + self.comm_s + self.fixed_s

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
        return sum(coefficients.get(name, 1.0) * value for name, value in self.features().items())

    def as_dict(self) -> dict[str, float]:
        return {"total_s": self.total_s, **self.features(), "flops": self.flops, "bytes": self.bytes}


Runs = tuple[list[tuple[Op, float]], list[tuple[Collective, float]]]
"""Ops and collectives of a pass, each with how many times it runs (layers x recompute; may be fractional)."""


@dataclass(frozen=True)
class AffineOp:
    """An op run ``runs`` times whose FLOPs and bytes are ``c + t x per_token + p x per_pair`` for t tokens and p
    attention pairs."""

    unit: Unit
    runs: float
    flops: tuple[float, float, float]
    bytes: tuple[float, float, float]


@dataclass(frozen=True)
class AffinePass:
    """A pass's ops and collectives as affine functions of (tokens, pairs): built once, evaluated per micro-batch."""

    ops: tuple[AffineOp, ...]
    collectives: tuple[tuple[str, float, float, float], ...]

    @classmethod
    def build(cls, direct: Callable[[Work], Runs]) -> AffinePass:
        """Probe ``direct`` at (0, 0), (1, 0) and (0, 1): exact for op lists that are affine in tokens and pairs."""
        zero, token, pair = direct(Work(0.0, 0.0)), direct(Work(1.0, 0.0)), direct(Work(0.0, 1.0))
        ops = tuple(
            AffineOp(
                z.unit,
                runs,
                (z.flops, t.flops - z.flops, p.flops - z.flops),
                (z.bytes, t.bytes - z.bytes, p.bytes - z.bytes),
            )
            for (z, runs), (t, _), (p, _) in zip(zero[0], token[0], pair[0], strict=True)
        )
        collectives = tuple(
            (z.kind, runs, z.bytes, t.bytes - z.bytes) for (z, runs), (t, _) in zip(zero[1], token[1], strict=True)
        )
        return cls(ops, collectives)

    def cost(self, tokens: float, pairs: float, roofline: Roofline) -> Cost:
        cost = Cost()
        matmul, attention, memory = roofline.matmul, roofline.attention, roofline.memory
        launches = 0.0
        for op in self.ops:
            f0, ft, fp = op.flops
            b0, bt, bp = op.bytes
            flops = (f0 + ft * tokens + fp * pairs) * op.runs
            moved = (b0 + bt * tokens + bp * pairs) * op.runs
            seconds = max(flops / (attention if op.unit == "attention" else matmul), moved / memory)
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
        cost.comm_s = sum(
            runs * roofline.ring(kind, b0 + bt * tokens, roofline.tp) for kind, runs, b0, bt in self.collectives
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

    def op(self, op: Op) -> Cost:
        flops_rate = self.attention if op.unit == "attention" else self.matmul
        compute = op.flops / flops_rate
        memory = op.bytes / self.memory
        cost = Cost(flops=op.flops, bytes=op.bytes, ops=1, fixed_s=self.op_s)
        setattr(cost, UNIT_FEATURE[op.unit], max(compute, memory))
        return cost

    def ring(self, kind: str, size: float, group: int) -> float:
        """Ring collective over ``group`` ranks of a ``size``-byte tensor."""
        if group <= 1:
            return 0.0
        steps = (group - 1) / group * size / self.link + (group - 1) * self.latency
        return 2 * steps if kind == "all_reduce" else steps

    def work(self, layer: LayerWork) -> Cost:
        cost = Cost()
        for op in layer.ops:
            cost.add(self.op(op))
        cost.comm_s += sum(self.ring(c.kind, c.bytes, self.tp) for c in layer.collectives)
        return cost


def recomputed_layers(endpoint: Endpoint, layers: int) -> int:
    """Layers whose forward runs again in backward (full recompute); selective recompute is handled per op."""
    recompute = endpoint.trainer.recompute
    if recompute.granularity != "full":
        return 0
    if recompute.method == "block":
        return min(recompute.num_layers, layers)
    return layers


def microbatch_work(mb: MicroBatch, tp: int) -> Work:
    """A micro-batch's work for each layer: its token slots, and its attention pairs (per packed row, or per padded row)."""
    if mb.packed:
        pairs = sum(round_up(t, tp) ** 2 for t in mb.row_tokens) * CAUSAL_FRACTION
    else:
        pairs = mb.rows * mb.width**2 * CAUSAL_FRACTION
    return Work(float(mb.slots), float(pairs))


class _EndpointModel:
    """The time model bound to one endpoint and model: layer costs grouped by signature, micro-batch costs cached."""

    def __init__(self, endpoint: Endpoint, model: ModelArch) -> None:
        self.endpoint = endpoint
        self.model = model
        self.profile = load_profile(endpoint.hardware.profile)
        self.setup = Setup.of(endpoint)
        p = endpoint.parallelism
        self.roofline = Roofline(self.profile, endpoint.hardware.devices, p.tp)
        counts: dict[tuple[str, bool], tuple[int, int]] = {}
        for index in range(model.num_layers):
            sig = layer_signature(model, index)
            first, n = counts.get(sig, (index, 0))
            counts[sig] = (first, n + 1)
        self.layer_groups = [(first, n / p.pp) for first, n in counts.values()]
        self.recompute_fraction = recomputed_layers(endpoint, model.num_layers) / model.num_layers
        self.microbatch_seconds = lru_cache(maxsize=4096)(self._microbatch)
        self._programs: dict[bool, AffinePass] = {}
        self.lora_params = lora_parameter_count(model, endpoint)

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
            program = self._programs[backward] = AffinePass.build(lambda w: self.layers_direct(w, backward))
        return program.cost(work.tokens, work.pairs, self.roofline)

    def layers_direct(self, work: Work, backward: bool) -> Runs:
        """Every op and collective of one stage's layers over ``work``, each with how many times it runs."""
        ops: list[tuple[Op, float]] = []
        collectives: list[tuple[Collective, float]] = []
        selective = self.endpoint.trainer.recompute.granularity == "selective"
        for index, count in self.layer_groups:
            fwd = decoder_layer(self.model, index).forward(work, self.setup)
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
        for index, count in self.layer_groups:
            fwd = decoder_layer(self.model, index).forward(work, self.setup)
            fwd_cost = self.roofline.work(fwd)
            total.add(fwd_cost, count)
            if backward:
                total.add(self.roofline.work(backward_of(fwd)), count)
                total.add(fwd_cost, count * self.recompute_fraction)
                if selective:
                    core = LayerWork([op for op in fwd.ops if op.role == "core"])
                    total.add(self.roofline.work(core), count)
        return total

    def _microbatch(self, kind: str, tokens: float, pairs: float, logits_tokens: float) -> Cost:
        work = self._split_cp(Work(tokens, pairs))
        backward = kind == "forward_backward"
        cost = self.layers(work, backward)
        head = lm_head(self.model)
        fwd, bwd = head.passes(work, logits_tokens, self.setup, self.endpoint.trainer.fused_lm_head_logprob)
        cost.add(self.roofline.work(fwd))
        if backward:
            cost.add(self.roofline.work(bwd))
        cost.add(self.roofline.op(head.embedding(work, self.setup)))
        cost.fixed_s += self.profile.overheads.microbatch_s
        return cost

    def call(self, shape: CallShape) -> Cost:
        p = self.endpoint.parallelism
        slowest = Cost()
        for rank in range(p.dp):
            rank_cost = Cost()
            longest = 0.0
            mbs = shape.microbatches_of_rank(rank)
            for mb in mbs:
                work = microbatch_work(mb, p.tp)
                logits = mb.rows * shape.logits_width if shape.logits_width and not mb.packed else work.tokens
                one = self.microbatch_seconds(shape.kind, work.tokens, work.pairs, float(logits))
                rank_cost.add(one)
                longest = max(longest, one.total_s)
            if p.pp > 1:
                # Costs above are one stage's; the classic 1F1B bubble adds (pp - 1) slots of the longest micro-batch.
                rank_cost.fixed_s += (p.pp - 1) * longest
            if rank_cost.total_s >= slowest.total_s:
                slowest = rank_cost
        over = self.profile.overheads
        slowest.fixed_s += over.call_s + over.row_s * shape.rows
        if shape.kind == "forward_backward" and p.dp > 1:
            grads = self.lora_params / p.tp * FP32
            slowest.comm_s += self.roofline.ring("all_reduce", grads, p.dp)
        return slowest

    def sample(self, requests: list[Request]) -> Cost:
        with_lora = any(r.checkpoint for r in requests)
        setup = Setup.of(self.endpoint, lora=with_lora)
        cost = Cost(fixed_s=self.profile.overheads.sample_call_s)
        prompts = [r.prompt_tokens for r in requests]
        prefill = Work(float(sum(prompts)), float(sum(p * p for p in prompts) * CAUSAL_FRACTION))
        cost.add(self._sampler_pass(prefill, setup, float(len(requests))))
        steps = max((r.max_tokens for r in requests), default=0)
        sequences = sum(r.num_samples for r in requests)
        if steps and sequences:
            context = sum(r.num_samples * (r.prompt_tokens + r.max_tokens / 2) for r in requests) / sequences
            step = Work(float(sequences), 0.0, decode=True, sequences=sequences, context=context)
            cost.add(self._sampler_pass(step, setup, float(sequences)), steps)
        return cost

    def _sampler_pass(self, work: Work, setup: Setup, logits_rows: float) -> Cost:
        """One vLLM forward (tensor parallel, no sequence parallel, vLLM's own fused attention kernels whatever the
        trainer's); logits only for each sequence's last token."""
        vllm = replace(setup, sequence_parallel=False, unfused_attention=False)
        cost = Cost()
        for index, count in self.layer_groups:
            layer = decoder_layer(self.model, index).forward(work, vllm)
            cost.add(self.roofline.work(layer), count * self.endpoint.parallelism.pp)
        cost.add(self.roofline.op(lm_head(self.model).last_token_logits(logits_rows, vllm)))
        return cost

    def single(self, request: Request) -> Cost:
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
    r, targets = endpoint.lora.rank, endpoint.lora.targets
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
        bound = self.bind(endpoint, model)
        return bound.call(shape).seconds(bound.profile.time_coefficients)

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        bound = self.bind(endpoint, model)
        return bound.sample(requests).seconds(bound.profile.time_coefficients)

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        bound = self.bind(endpoint, model)
        return bound.single(request).seconds(bound.profile.time_coefficients)


def default_time_model() -> RooflineTimeModel:
    return RooflineTimeModel()

"""The time model's reference: every op of a call priced one by one on a hardware profile (a roofline), plus
collectives and overheads.

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

This module is the meaning of a call's duration: ``TimeReference`` prices the description's ops (``layer_ops``) op
by op, with no cache and no compiled form. The fast paths (``fast.time_program``: the micro-batch program and the
tiles of widths) are held to it bit for bit, and the bound model (``bound.timing``) answers from them where they
are exact and from this reference elsewhere.

Not covered: pipeline-parallel schedules beyond the classic bubble, context-parallel communication, MoE all-to-all,
compute/communication overlap. Coefficients are calibration inputs: the hardware profile's efficiencies and
overheads (``skyrl_sim.schema.hardware``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from skyrl_sim.api import CallShape, Endpoint, HardwareProfile, MicroBatch, ModelArch, Request, load_profile, round_up
from skyrl_sim_plugins.sim.description.layer_ops import (
    CAUSAL_FRACTION,
    FP32,
    Collective,
    LayerWork,
    Op,
    Role,
    Setup,
    Work,
    decoder_layer,
    lm_head,
    lora_parameter_count,
)
from skyrl_sim_plugins.sim.description.trainers import trainer_of, trainer_traffic

ADAM_BYTES_PER_PARAM = 28
"""optim_step traffic per trainable parameter: read fp32 param, grad, m, v (16 B), write param, m, v (12 B)."""
ADAM_STATE_BYTES_PER_PARAM = 12
"""A full checkpoint holds the fp32 master weight and both Adam moments besides the weight itself."""

ATTENTION_BACKWARD_FACTOR = 2.5
"""Attention-core backward vs forward FLOPs (flash attention recomputes the scores: 5 products against 2)."""
BACKWARD_FACTOR: dict[Role, float] = {
    "frozen": 1.0,
    "trained": 2.0,
    "lora": 2.0,
    "core": ATTENTION_BACKWARD_FACTOR,
    "elementwise": 2.0,
}
"""Backward cost of an op relative to its forward: frozen linears need only the input gradient, trained ones (full
fine-tuning) and adapters both."""


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
        out.ops.append(Op(f"{op.name}.grad", op.flops * factor, moved, op.unit, op.role, scaling=op.scaling))
    out.collectives = [
        Collective(f"{c.name}.grad", mirror[c.kind], c.bytes, scaling=c.scaling)  # type: ignore[arg-type]
        for c in forward.collectives
    ]
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


Listing = tuple[list[tuple[Op, float]], list[tuple[Collective, float]]]
"""Ops and collectives of a pass, each with its count: how many times it runs (layers x recompute; may be
fractional)."""


def once(layer: LayerWork) -> Listing:
    """A layer's ops and collectives, each run once (the LM head's passes, the embedding)."""
    return [(op, 1.0) for op in layer.ops], [(c, 1.0) for c in layer.collectives]



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


class TimeReference:
    """The time model of one endpoint and model, op by op: what a micro-batch, a call, a sample call and a single
    request cost. Holds only what the endpoint fixes (the profile, the layer kinds, the rates); keeps no cache."""

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
        self.recompute_fraction = recomputed_layers(endpoint, model.num_layers) / model.num_layers
        self.lora_params = lora_parameter_count(model, endpoint)
        self.weights = feature_weights(self.profile.time_coefficients)
        over = self.profile.overheads
        self.call_fixed = (over.call_s, over.row_s)
        grads = self.lora_params / p.tp * FP32
        self.traffic = trainer_traffic(model, endpoint, self.lora_params)  # the trainer's own collectives
        if trainer_of(endpoint).key == "megatron-lora":  # the adapters' gradients all-reduced over DP
            self.gradient_all_reduce_s = self.roofline.ring("all_reduce", grads, p.dp)
        else:
            self.gradient_all_reduce_s = sequential_sum(self.roofline.ring(*c) for c in self.traffic.call)
        self.unit_forward_s = sequential_sum(self.roofline.ring(*c) for c in self.traffic.microbatch_forward)
        self.unit_backward_s = sequential_sum(self.roofline.ring(*c) for c in self.traffic.microbatch_backward)
        self.optim_step_comm_s = sequential_sum(self.roofline.ring(*c) for c in self.traffic.optim_step)

    def split_cp(self, work: Work) -> Work:
        """The share of ``work`` one context-parallel rank computes."""
        cp = self.cp
        if cp == 1:
            return work
        return Work(work.tokens / cp, work.pairs / cp, work.decode, work.sequences, work.context)

    def layers_direct(self, work: Work, backward: bool) -> Listing:
        """Every op and collective of one stage's layers over ``work``, each with how many times it runs."""
        ops: list[tuple[Op, float]] = []
        collectives: list[tuple[Collective, float]] = []
        selective = self.endpoint.trainer.recompute.granularity == "selective"
        for layer, (_, count) in zip(self.layer_kinds, self.layer_groups, strict=True):
            fwd = layer.forward(work, self.setup)
            repeats = count * (1 + (self.recompute_fraction if backward else 0.0))
            ops += [(op, repeats) for op in fwd.ops]
            collectives += [(c, repeats) for c in fwd.collectives]
            if backward:
                bwd = backward_of(fwd)
                ops += [(op, count) for op in bwd.ops]
                collectives += [(c, count) for c in bwd.collectives]
                if selective:
                    ops += [(op, count) for op in fwd.ops if op.role == "core"]
        return ops, collectives

    def head_direct(self, kind: str, work: Work, logits_tokens: float) -> tuple[Listing, Listing, Listing]:
        """The LM head's forward, its backward (empty in a forward) and the embedding over ``work``, each op once."""
        fused = self.endpoint.trainer.fused_lm_head_logprob
        fwd, bwd = self.head.passes(work, logits_tokens, self.setup, fused, entropy=kind == RL_KIND)
        backward = once(bwd) if kind != "forward" else ([], [])
        return once(fwd), backward, ([(self.head.embedding(work, self.setup), 1.0)], [])

    def priced(self, listing: Listing) -> Cost:
        """Ops and collectives, each run its count of times: an op's FLOPs and bytes times its count, its roofline
        time, the per-op overhead per launch; the collectives' ring times, added one at a time."""
        cost = Cost()
        launches = 0.0
        roofline = self.roofline
        for op, count in listing[0]:
            flops = op.flops * count
            moved = op.bytes * count
            seconds = roofline.seconds(op.unit, flops, moved)
            if op.unit == "matmul":
                cost.matmul_s += seconds
            elif op.unit == "attention":
                cost.attention_s += seconds
            else:
                cost.memory_s += seconds
            cost.flops += flops
            cost.bytes += moved
            launches += count
        cost.ops = round(launches)
        cost.fixed_s = roofline.op_s * launches
        cost.comm_s = sequential_sum(count * roofline.ring(c.kind, c.bytes, roofline.tp) for c, count in listing[1])
        return cost

    def layers(self, work: Work, backward: bool) -> Cost:
        """Forward (and recompute and backward) of every layer of one pipeline stage over ``work``, op by op."""
        return self.priced(self.layers_direct(work, backward))

    def microbatch(self, kind: str, tokens: float, pairs: float, logits_tokens: float) -> Cost:
        """One micro-batch: the layers, the LM head's passes and the embedding priced op by op from their
        descriptions, the per-micro-batch overhead. The meaning of a micro-batch's cost."""
        work = self.split_cp(Work(tokens, pairs))
        backward = kind != "forward"
        cost = self.layers(work, backward)
        fused = self.endpoint.trainer.fused_lm_head_logprob
        fwd, bwd = self.head.passes(work, logits_tokens, self.setup, fused, entropy=kind == RL_KIND)
        cost.add(self.roofline.work(fwd))
        if backward:
            cost.add(self.roofline.work(bwd))
        cost.add(self.roofline.op(self.head.embedding(work, self.setup)))
        cost.fixed_s += self.profile.overheads.microbatch_s
        return cost

    def call(self, shape: CallShape) -> Cost:
        """A call's cost: the slowest data-parallel rank's micro-batches (one stage's, plus the classic pipeline
        bubble), the call and row overheads, the LoRA gradients' all-reduce over DP after a forward_backward."""
        p = self.endpoint.parallelism
        slowest = Cost()
        for rank in range(p.dp):
            rank_cost = Cost()
            longest = 0.0
            for mb in shape.microbatches_of_rank(rank):
                work = microbatch_work(mb, p.tp)
                logits = mb.rows * shape.logits_width if shape.logits_width and not mb.packed else work.tokens
                one = self.microbatch(pass_kind(shape), work.tokens, work.pairs, float(logits))
                rank_cost.add(one)
                longest = max(longest, one.total_s)
            if p.pp > 1:
                rank_cost.fixed_s += (p.pp - 1) * longest
            if rank_cost.total_s >= slowest.total_s:
                slowest = rank_cost
        over = self.profile.overheads
        slowest.fixed_s += over.call_s + over.row_s * shape.rows
        if shape.kind == "forward_backward" and p.dp > 1:
            slowest.comm_s += self.gradient_all_reduce_s
        slowest.comm_s += self.unit_collectives_s(shape)
        return slowest

    def unit_collectives_s(self, shape: CallShape) -> float:
        """FSDP's all-gathers and reduce-scatters of its units (``trainers.trainer_traffic``): each micro-batch of the
        busiest rank gathers every unit in forward, and in a training pass again with its gradients' reduction (0.0
        for Megatron, whose collectives are the layer description's)."""
        per_mb = self.unit_forward_s + (self.unit_backward_s if shape.kind != "forward" else 0.0)
        if not per_mb:
            return 0.0
        most = max(len(shape.microbatches_of_rank(rank)) for rank in range(self.dp))
        return most * per_mb

    def sampler_setup(self, with_lora: bool) -> Setup:
        """vLLM's setup: tensor parallel, no sequence parallel, its own fused attention kernels whatever the
        trainer's."""
        setup = Setup.of(self.endpoint, lora=with_lora, model=self.model)
        return replace(setup, sequence_parallel=False, unfused_attention=False, train_base=False)

    def sample(self, requests: list[Request], setup: Setup | None = None) -> Cost:
        """A sample call's cost: prefill as a forward over the prompts, then one decode step per generated token
        (``setup``: the sampler's, ``sampler_setup``, made here when not given)."""
        if setup is None:
            setup = self.sampler_setup(any(r.checkpoint for r in requests))
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

    def _sampler_pass(self, work: Work, vllm: Setup, logits_rows: float) -> Cost:
        """One vLLM forward over ``work`` with the sampler's setup; logits only for each sequence's last token."""
        cost = Cost()
        for layer, (_, count) in zip(self.layer_kinds, self.layer_groups, strict=True):
            cost.add(self.roofline.work(layer.forward(work, vllm)), count * self.pp)
        cost.add(self.roofline.op(self.head.last_token_logits(logits_rows, vllm)))
        return cost

    def single(self, request: Request) -> Cost:
        """A single request's cost (what it reads of the request: its type)."""
        over = self.profile.overheads
        cost = Cost(fixed_s=over.single(request.type))
        lora = self.lora_params
        d = self.setup.dtype
        storage = self.profile.storage_bandwidth
        if request.type == "optim_step":  # Adam on what the rank updates; the distributed optimizer's param gather
            updated = self.traffic.updated_params
            adam = Op("adam", 0.0, updated * ADAM_BYTES_PER_PARAM, "memory", "elementwise", scaling="affine")
            cost.add(self.roofline.op(adam))
            cost.comm_s += self.optim_step_comm_s
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

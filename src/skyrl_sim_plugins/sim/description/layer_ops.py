"""The one description of a decoder layer that the memory walk and the time model both read.

A decoder layer is an attention block (full or sliding-window attention, multi-latent attention, or gated DeltaNet)
and an MLP block (dense SwiGLU or MoE, with or without shared experts), each framed by a pre-norm and a residual
add. ``decoder_layer`` describes one layer of a model: its blocks, every linear
(name, tensor-parallel split, widths, whether LoRA may wrap it), the attention geometry and which optional ops exist
(q/k norms, rotary embedding, output gate, shared expert); ``lm_head`` describes the model's two ends (the embedding
lookup and the vocab-parallel output layer with its log-probs). From that one description:

* the **memory walk** (``memory_ops``) builds each block's graph: the description's widths give the tensor shapes,
  its flags the ops; the walk adds only what is memory-specific (which tensors are saved for backward, workspaces,
  views, per-rank rounding);
* the **time model** (``time_model``) prices the ops listed here (``DecoderLayer.forward``): FLOPs and bytes per op on
  one device and the tensor-parallel collectives of each block, from a micro-batch's ``Work`` and the endpoint's
  ``Setup``; it adds only what is time-specific (rates, backward factors, recompute, passes);
* the adapter parameter counts (static memory, the time model's gradient all-reduce and optimizer traffic) sum the
  adapted ``Linear``s of the same description.

A change to a layer (a new op, another width, another LoRA target) is made here once.

Known gaps of the time model, visible here as ops the memory walk builds and no cost prices: the q/k norms, the
unfused attention's K/V repeats, the MoE dispatch and combine; its head
prices the fp32 upcast whatever ``trainer.fp32_output`` says and one log-prob path whatever ``trainer.logprob_kernel``
says. The two block norms and residual adds are priced together (``DecoderLayer.norms_residuals``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from skyrl_sim.api import DTYPE_BYTES, Endpoint, LinearAttentionDims, MlaDims, ModelArch, profile_device

FP32 = 4
CAUSAL_FRACTION = 0.5
"""A causal attention kernel computes about half of the (query, key) pairs of a sequence."""
DELTANET_CHUNK = 64
"""Chunk length of the chunked gated delta rule kernels (FLA's ``chunk_gated_delta_rule``, ``chunk_size=64``, the
fused intra-chunk path): intra-chunk work and the per-chunk states."""

Workspace = tuple[str, tuple[Any, ...], str]
"""A named tensor by shape and dtype (the memory walk's workspace)."""


@dataclass(frozen=True)
class KernelTensors:
    """What a kernel makes beyond its inputs and output, as the memory walk places it: ``kept`` for backward (made
    in forward), ``forward`` (live while the forward runs), ``backward`` (live while the backward runs, beside the
    input gradients it returns)."""

    kept: tuple[Workspace, ...]
    forward: tuple[Workspace, ...]
    backward: tuple[Workspace, ...]

Parallel = Literal["column", "row"]
Unit = Literal["matmul", "attention", "memory"]
Role = Literal["frozen", "trained", "lora", "core", "elementwise"]
Scaling = Literal["affine", "nonlinear"]
"""How an op's FLOPs and bytes (a collective's size) change with the work it is built from (a micro-batch's tokens,
attention pairs and logit slots; a decode step's sequences and context). ``affine``: a constant plus a coefficient per
variable, so a few probes give it everywhere (the time model's compiled program, ``fast.time_program``, relies on
it); ``nonlinear``: anything else (a product of two variables, a ceiling, a maximum), priced op by op only. An op
that does not say is ``nonlinear``: the fast path refuses it rather than extrapolate."""
AFFINE: Scaling = "affine"
NONLINEAR: Scaling = "nonlinear"


@dataclass(frozen=True)
class Op:
    """One kernel's work on one device."""

    name: str
    flops: float
    bytes: float
    unit: Unit
    role: Role
    backward_bytes: float | None = None  # when the backward's traffic is not the role's factor of the forward's
    scaling: Scaling = NONLINEAR  # how flops and bytes change with the work (``Scaling``)


@dataclass(frozen=True)
class Collective:
    """One tensor-parallel collective over a tensor of ``bytes`` (the full, gathered size)."""

    name: str
    kind: Literal["all_gather", "reduce_scatter", "all_reduce"]
    bytes: float
    scaling: Scaling = NONLINEAR  # how the size changes with the work (``Scaling``)


@dataclass(frozen=True)
class Work:
    """What one micro-batch asks of each layer.

    ``tokens``: token slots the linears compute; ``pairs``: (query, key) pairs the full-attention core computes;
    ``decode``: one new token per sequence over a cache of ``context`` tokens (sampling), ``sequences`` of them.
    """

    tokens: float
    pairs: float
    decode: bool = False
    sequences: int = 0
    context: float = 0.0


def sequence_parallel(endpoint: Endpoint) -> bool:
    """Whether activations are sharded over the sequence between the blocks: asked for and TP > 1 (Megatron ignores
    the flag without tensor parallelism)."""
    return endpoint.parallelism.sequence_parallel and endpoint.parallelism.tp > 1


@dataclass(frozen=True)
class Setup:
    """The endpoint settings a layer's costs depend on."""

    tp: int
    sequence_parallel: bool
    dtype: int
    lora_rank: int
    lora_targets: frozenset[str]
    unfused_attention: bool = False
    cuda: bool = True  # CUDA kernels (the softmax backward's extra pass)
    # every weight trained (full fine-tuning): a base linear's backward makes its weight's gradient too
    train_base: bool = False
    # bytes per element of the base linears' weights when not ``dtype``: 1 for an FP8 vLLM checkpoint (the weights a
    # GEMM streams; its activations stay at ``dtype``, its FLOPs at the dtype's peak); 0: ``dtype``
    weight_dtype: int = 0

    @property
    def base_role(self) -> Role:
        """A base linear's role: ``trained`` (input and weight gradients in backward) or ``frozen`` (input only)."""
        return "trained" if self.train_base else "frozen"

    @classmethod
    def of(cls, endpoint: Endpoint, lora: bool = True, model: ModelArch | None = None) -> Setup:
        """The setup of ``endpoint``; ``unfused_attention`` is the trainer's attention kernel (``trainer.attention``,
        the same fact the memory walk reads); the LoRA targets are ``Endpoint.adapted_targets`` of ``model``."""
        tp = endpoint.parallelism.tp
        return cls(
            tp=tp,
            sequence_parallel=sequence_parallel(endpoint),
            dtype=DTYPE_BYTES[endpoint.trainer.params_dtype],
            lora_rank=endpoint.lora.rank if lora else 0,
            lora_targets=endpoint.adapted_targets(model) if lora else frozenset(),
            unfused_attention=endpoint.trainer.attention_kernel == "unfused",
            cuda=profile_device(endpoint.hardware.profile) == "cuda",
            train_base=endpoint.full_fine_tune,
        )


@dataclass
class LayerWork:
    """A layer's ops and collectives for one pass direction."""

    ops: list[Op] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)


def unfused_score_bytes(dtype: int, cuda: bool) -> tuple[float, float]:
    """Bytes moved per element of the ``[b * heads, s, s]`` score matrix by megatron-core's unfused attention, in a
    forward pass and in its backward: the elementwise kernels ``memory_ops.unfused_core_attention`` walks.

    16-bit activations (softmax in fp32): forward: the scores' write, the fp32 copy (read, write), the in-place
    causal mask (read, write), the softmax (read, write), the cast back (read, write) and the context product's read;
    backward: the probabilities' gradient (write) and the probabilities' read for the values' gradient, its fp32 cast,
    the softmax backward (on CUDA first ``grad * output``, then the kernel), the mask's gradient, the cast back and
    two reads by the scores' products. fp32: no casts; the in-place mask on a view costs CopySlices' three copies.
    """
    softmax_backward = 24.0 if cuda else 12.0
    if dtype < 4:
        forward = 4 * dtype + 20.0
        backward = 6 * dtype + 16.0 + softmax_backward
    else:
        forward = 24.0
        backward = 36.0 + softmax_backward
    return forward, backward


@dataclass(frozen=True)
class Linear:
    """A tensor-parallel linear: column-parallel (output sharded by TP) or row-parallel (input sharded).

    ``name`` is the module's name in its block (``linear_qkv``) and the LoRA target that selects it; ``adaptable``
    is false where SkyRL never wraps the linear (the output layer, the router).
    """

    name: str
    parallel: Parallel
    n_in: int
    n_out: int
    adaptable: bool = True

    def adapted(self, targets: Collection[str]) -> bool:
        """Whether LoRA (Megatron-Bridge's adapter) wraps this linear under ``lora.targets``."""
        return self.adaptable and self.name in targets

    def ops(self, work: Work, setup: Setup, prefix: str = "") -> list[Op]:
        """The base GEMM (weights, input and output streamed) and, when adapted, the adapter's two GEMMs and the
        scaled copy plus sum of its output. Column-parallel: A ``[r, in]`` replicated, B ``[out/tp, r]`` sharded;
        row-parallel: A ``[r, in/tp]`` sharded, B ``[out, r]``."""
        t, tp, d = work.tokens, setup.tp, setup.dtype
        n_in, n_out, name = self.n_in, self.n_out, prefix + self.name
        in_local = n_in if self.parallel == "column" else n_in / tp
        out_local = n_out / tp if self.parallel == "column" else n_out
        if setup.weight_dtype:  # an FP8 checkpoint's linear: one byte a weight, activations at the model's dtype
            weights_io = setup.weight_dtype * n_in * n_out / tp + d * (t * in_local + t * out_local)
        else:
            weights_io = d * (n_in * n_out / tp + t * in_local + t * out_local)
        ops = [Op(name, 2 * t * n_in * n_out / tp, weights_io, "matmul", setup.base_role, scaling=AFFINE)]
        if self.adapted(setup.lora_targets) and setup.lora_rank:
            r = setup.lora_rank
            flops = 2 * t * r * (in_local + out_local)
            weights = r * (in_local + out_local)
            ops.append(
                Op(
                    f"{name}.lora",
                    flops,
                    d * (weights + t * in_local + t * r + t * out_local),
                    "matmul",
                    "lora",
                    scaling=AFFINE,
                )
            )
            ops.append(Op(f"{name}.lora_add", 0.0, d * 4 * t * out_local, "memory", "elementwise", scaling=AFFINE))
        return ops

    def adapter_parameters(self, rank: int) -> int:
        """Adapter parameters over the whole TP group: A ``[r, in]`` and B ``[out, r]``."""
        return rank * (self.n_in + self.n_out)

    def adapter_parameters_per_rank(self, rank: int, tp: int) -> int:
        """Adapter parameters on one TP rank (Megatron-Bridge's ParallelLinearAdapter): column-parallel base: A
        column-parallel over the rank ``[r/tp, in]``, B ``[out/tp, r]``; row-parallel base: A ``[r, in/tp]``, B
        column-parallel ``[out/tp, r]``."""
        a = -(-rank // tp) * self.n_in if self.parallel == "column" else rank * -(-self.n_in // tp)
        return a + -(-self.n_out // tp) * rank


def block_collectives(name: str, work: Work, hidden: int, setup: Setup) -> list[Collective]:
    """Tensor-parallel traffic around one column-then-row block (attention or MLP) in forward: with sequence
    parallel the norm's all-gather and the row linear's reduce-scatter, without it the row linear's all-reduce."""
    if setup.tp == 1:
        return []
    size = work.tokens * hidden * setup.dtype
    if setup.sequence_parallel:
        return [
            Collective(f"{name}.all_gather", "all_gather", size, scaling=AFFINE),
            Collective(f"{name}.reduce_scatter", "reduce_scatter", size, scaling=AFFINE),
        ]
    return [Collective(f"{name}.all_reduce", "all_reduce", size, scaling=AFFINE)]


def lora_collectives(linear: Linear, work: Work, setup: Setup) -> list[Collective]:
    """A row-parallel adapter all-reduces its rank-sized intermediate in forward (column ones do it in backward)."""
    if setup.tp == 1 or not setup.lora_rank or not linear.adapted(setup.lora_targets):
        return []
    return [
        Collective(
            f"{linear.name}.lora_all_reduce", "all_reduce", work.tokens * setup.lora_rank * setup.dtype, scaling=AFFINE
        )
    ]


@dataclass(frozen=True)
class FullAttention:
    """Full attention with grouped-query heads: the fused qkv projection (with the output gate's half of the query
    when ``output_gate``), optional q/k norms and rotary embedding, the core attention, the gate, the output
    projection. Head counts are the whole model's; a TP rank holds ``1/tp`` of them."""

    qkv: Linear
    proj: Linear
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    rotary: bool
    output_gate: bool
    window: int = 0
    """Sliding-window attention: each query attends to its last ``window`` keys (0: full causal attention). A flash
    kernel computes only those pairs; megatron-core's unfused attention computes every pair and masks the rest."""
    sinks: bool = False
    """A learned sink logit per head joins the softmax (gpt-oss; megatron-core's ``softmax_type="learnable"``):
    ``heads`` parameters, no tensor of the sequence's size."""

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.proj)

    def computed_pairs(self, work: Work, setup: Setup) -> float:
        """The (query, key) pairs the core attention computes: every pair of the rows under the unfused kernel, the
        causal ones under a flash kernel, at most ``window`` per token in a window layer (an upper bound that is
        exact once a row outgrows the window by much)."""
        if setup.unfused_attention:
            return work.pairs / CAUSAL_FRACTION
        if self.window:
            return min(work.pairs, work.tokens * self.window)
        return work.pairs

    def forward(self, work: Work, setup: Setup, hidden: int) -> LayerWork:
        """FLOPs and bytes of the block's ops and its collectives, in forward, on one device."""
        t, tp, d = work.tokens, setup.tp, setup.dtype
        heads, hd, kv_width = self.heads, self.head_dim, self.kv_heads * self.head_dim
        out = LayerWork()
        out.ops += self.qkv.ops(work, setup)
        if self.rotary:
            out.ops.append(
                Op("rope", 0.0, d * 2 * t * (heads * hd + kv_width) / tp, "memory", "elementwise", scaling=AFFINE)
            )
        if work.decode:
            context = min(work.context, self.window) if self.window else work.context
            flops = 4 * work.sequences * context * heads / tp * hd
            cache = work.sequences * context * 2 * kv_width / tp * d
            # Sequences x context: a product of two of the decode step's variables, not affine in either.
            moved = cache + d * t * 2 * heads * hd / tp
            out.ops.append(Op("core_attention", flops, moved, "attention", "core", scaling=NONLINEAR))
        else:
            pairs = self.computed_pairs(work, setup)
            moved = d * t * (2 * heads * hd + 2 * kv_width) / tp
            # a window caps each token's pairs (a minimum of two of the work's variables): not affine
            scaling = NONLINEAR if self.window and not setup.unfused_attention else AFFINE
            out.ops.append(Op("core_attention", 4 * pairs * heads / tp * hd, moved, "attention", "core", scaling=scaling))
            if setup.unfused_attention:
                elements = pairs * heads / tp  # the full score matrix: no causal skipping
                forward, backward = unfused_score_bytes(d, setup.cuda)
                scores = Op(
                    "core_attention.scores",
                    0.0,
                    forward * elements,
                    "attention",
                    "core",
                    backward * elements,
                    scaling=AFFINE,
                )
                out.ops.append(scores)
        if self.output_gate:
            out.ops.append(Op("output_gate", 0.0, d * 3 * t * heads * hd / tp, "memory", "elementwise", scaling=AFFINE))
        out.ops += self.proj.ops(work, setup)
        out.collectives += block_collectives("attention", work, hidden, setup)
        out.collectives += lora_collectives(self.proj, work, setup)
        return out


@dataclass(frozen=True)
class LatentAttention:
    """Multi-latent attention as megatron-core 0.16.1 builds it (``MLASelfAttention``, local spec): the query's down
    projection ``linear_q_down_proj`` (hidden -> ``q_lora_rank``), its norm and up projection ``linear_q_up_proj``
    (-> heads x ``q_head_dim``; without a ``q_lora_rank``, one ``linear_q_proj``), the kv down projection
    ``linear_kv_down_proj`` (hidden -> ``kv_lora_rank + qk_rope_head_dim``: the latent and the shared rotary key),
    the kv norm and ``linear_kv_up_proj`` (-> heads x (``qk_nope_head_dim + v_head_dim``)), rotary embedding of the
    query's and the key's rotary parts, the core attention (q and k ``q_head_dim`` wide, v ``v_head_dim``), and
    ``linear_proj``. Every projection is column-parallel (the down projections' outputs are gathered back to their
    full width under TP), ``linear_proj`` row-parallel. SkyRL 0.4.0's ``all-linear`` names none of the q/kv
    projections (``megatron_worker.configure_lora``: ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``,
    ``in_proj``, ``out_proj``), so on MLA only ``linear_proj`` is adapted unless ``lora.targets`` lists them."""

    q_down: Linear | None
    q_up: Linear
    kv_down: Linear
    kv_up: Linear
    proj: Linear
    heads: int
    dims: MlaDims

    @property
    def linears(self) -> tuple[Linear, ...]:
        down = (self.q_down,) if self.q_down is not None else ()
        return (*down, self.q_up, self.kv_down, self.kv_up, self.proj)

    def forward(self, work: Work, setup: Setup, hidden: int) -> LayerWork:
        """FLOPs and bytes of the block's ops and its collectives, in forward, on one device. Decoding (vLLM) reads
        the cached latent: per sequence and context token one ``kv_lora_rank + qk_rope_head_dim`` vector, with the
        up projections absorbed into the query and the output (``MLACommonImpl``'s decode path)."""
        m, t, tp, d = self.dims, work.tokens, setup.tp, setup.dtype
        heads = self.heads / tp
        out = LayerWork()
        for linear in self.linears[:-1]:
            out.ops += linear.ops(work, setup)
        norms = m.kv_lora_rank + (m.q_lora_rank if self.q_down is not None else 0)
        out.ops.append(Op("latent_norms", 0.0, d * 2 * t * norms, "memory", "elementwise", scaling=AFFINE))
        out.ops.append(
            Op("rope", 0.0, d * 2 * t * (heads + 1) * m.qk_rope_head_dim, "memory", "elementwise", scaling=AFFINE)
        )
        if work.decode:
            latent = m.kv_lora_rank + m.qk_rope_head_dim
            flops = 2 * work.sequences * work.context * heads * (latent + m.kv_lora_rank)
            cache = work.sequences * work.context * latent * d
            out.ops.append(Op("core_attention", flops, cache, "attention", "core", scaling=NONLINEAR))
        else:
            pairs = work.pairs / CAUSAL_FRACTION if setup.unfused_attention else work.pairs
            flops = 2 * pairs * heads * (m.q_head_dim + m.v_head_dim)
            moved = d * t * heads * (3 * m.q_head_dim + m.v_head_dim)
            out.ops.append(Op("core_attention", flops, moved, "attention", "core", scaling=AFFINE))
            if setup.unfused_attention:
                elements = pairs * heads
                forward, backward = unfused_score_bytes(d, setup.cuda)
                scores = Op(
                    "core_attention.scores", 0.0, forward * elements, "attention", "core", backward * elements,
                    scaling=AFFINE,
                )
                out.ops.append(scores)
        out.ops += self.proj.ops(work, setup)
        out.collectives += block_collectives("attention", work, hidden, setup)
        if tp > 1:  # the column-parallel down projections' outputs gathered to their full width
            width = m.latent_width + (m.q_lora_rank if self.q_down is not None else 0)
            out.collectives.append(Collective("latent.all_gather", "all_gather", t * width * d, scaling=AFFINE))
        out.collectives += lora_collectives(self.proj, work, setup)
        return out


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated-DeltaNet linear attention: one input projection (q, k, v, the gate z, beta and the decay), a causal
    short convolution over q, k, v, the chunked gated delta rule, the gated norm and the output projection. Both
    projections are LoRA targets (``in_proj``, ``out_proj``): SkyRL 0.4.0's ``all-linear`` adapts them (where the
    checkpoint allows ``in_proj``), the seed's revision's ``all-linear`` does not."""

    in_proj: Linear
    out_proj: Linear
    dims: LinearAttentionDims

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.in_proj, self.out_proj)

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q, k and v."""
        return 2 * self.dims.qk_width + self.dims.v_width

    def kernel_tensors(self, rows: int, seq: Any, tp: int, act: str) -> KernelTensors:
        """FLA's chunked gated delta rule (``fla/ops/gated_delta_rule/chunk.py``) on one TP rank, over ``rows`` x
        ``seq`` tokens (``seq`` may be a tile of widths), megatron-core having repeated q and k to the value heads:

        * kept for backward (``ChunkGatedDeltaRuleFunction.forward``'s ``save_for_backward``, beside its inputs q, k,
          v and beta): the chunk-local cumulative gates (``chunk_local_cumsum``, fp32 ``[b, s, hv]``) and the solved
          intra-chunk matrix ``A`` (``chunk_gated_delta_rule_fwd_intra``: ``[b, s, hv, 64]`` in the keys' dtype);
        * live in forward (``chunk_gated_delta_rule_fwd``): ``w`` and ``u`` (``recompute_w_u_fwd``), the state
          entering each chunk ``h`` (``chunk_gated_delta_rule_fwd_h``: ``[b, ceil(s / 64), hv, dk, dv]`` in the keys'
          dtype) and ``v_new``;
        * live in backward (``chunk_gated_delta_rule_bwd``, all its locals until it returns): ``w``, ``u``, ``h`` and
          ``v_new`` recomputed, the state gradients ``dh`` (``chunk_gated_delta_rule_bwd_dhu``, ``h``'s shape) and
          ``dv2``, ``dw`` and the fp32 ``dg`` (``chunk_bwd_dqkwg``), ``dk2`` and the fp32 ``dg2``
          (``prepare_wy_repr_bwd``); beside them the gradients it returns (q, k, v, the gates, beta), which the walk
          counts as the inputs' gradients. The intra-chunk ``dv`` is freed when ``dv2`` replaces it."""
        la = self.dims
        hv = -(-la.num_value_heads // tp)
        dk, dv = la.key_head_dim, la.value_head_dim
        chunks = -(-seq // DELTANET_CHUNK)
        keys, values, gates = (rows, seq, hv, dk), (rows, seq, hv, dv), (rows, seq, hv)
        states = (rows, chunks, hv, dk, dv)
        made = (("w", keys, act), ("u", values, act), ("h", states, act), ("v_new", values, act))
        return KernelTensors(
            kept=(("gate_cumsum", gates, "fp32"), ("chunk_a", (rows, seq, hv, DELTANET_CHUNK), act)),
            forward=made,
            backward=(
                *made,
                ("dh", states, act),
                ("dv2", values, act),
                ("dw", keys, act),
                ("dg", gates, "fp32"),
                ("dk2", keys, act),
                ("dg2", gates, "fp32"),
            ),
        )

    def forward(self, work: Work, setup: Setup, hidden: int) -> LayerWork:
        """FLOPs and bytes of the block's ops and its collectives, in forward, on one device.

        The core is linear in length: per token and value head, the state read and update (``4 dk dv``) and the
        intra-chunk products (``2 C (dk + dv)``). Its traffic follows FLA's three forward kernels
        (``chunk_gated_delta_rule_fwd``): the intra-chunk pass reads k, v and the gates and writes ``A``, ``w`` and
        ``u``; the state pass reads k, ``w`` and ``u`` and writes ``v_new`` and a state per chunk; the output pass
        reads q, k, ``v_new`` and the states and writes the output (``kernel_tensors`` names them). Before it: the
        contiguous copies and l2 norms of q and k, their repeat to the value heads, the contiguous v, z, beta and a,
        the fp32 decay and beta's sigmoid.
        """
        la = self.dims
        t, tp, d = work.tokens, setup.tp, setup.dtype
        nv, nk = la.num_value_heads / tp, la.num_key_heads / tp
        dk, dv = la.key_head_dim, la.value_head_dim
        conv = self.conv_channels
        out = LayerWork()
        out.ops += self.in_proj.ops(work, setup)
        out.ops.append(
            Op("conv1d", 2 * t * conv / tp * la.conv_kernel, d * 2 * t * conv / tp, "memory", "elementwise", scaling=AFFINE)
        )
        if work.decode:
            state = work.sequences * nv * dk * dv * FP32 * 2
            moved = state + d * t * conv / tp
            out.ops.append(Op("deltanet_core", t * nv * 4 * dk * dv, moved, "attention", "core", scaling=AFFINE))
        else:
            # q and k: a contiguous copy and the l2 norm (read, write each), the repeat to the value heads (write);
            # v and z: a contiguous copy; beta and a: copies, the fp32 decay (four passes), the sigmoid
            prep = d * t * (nk * dk * 2 * 4 + nv * dk * 2 + nv * dv * 2 * 2) + t * nv * (d * 4 + FP32 * 4 + d * 2)
            out.ops.append(Op("deltanet_prep", 0.0, prep, "memory", "elementwise", scaling=AFFINE))
            flops = t * nv * (4 * dk * dv + 2 * DELTANET_CHUNK * (dk + dv))
            tokens = d * t * nv * (5 * dk + 5 * dv + DELTANET_CHUNK) + FP32 * t * nv * 2
            states = d * 2 * t / DELTANET_CHUNK * nv * dk * dv  # each chunk's state written, then read
            out.ops.append(Op("deltanet_core", flops, tokens + states, "attention", "core", scaling=AFFINE))
        out.ops.append(Op("gated_norm", 0.0, d * 3 * t * la.v_width / tp, "memory", "elementwise", scaling=AFFINE))
        out.ops += self.out_proj.ops(work, setup)
        out.collectives += block_collectives("attention", work, hidden, setup)
        return out


@dataclass(frozen=True)
class SwiGLU:
    """A SwiGLU MLP: the fused gate+up ``linear_fc1`` (``2 x ffn`` wide), the SwiGLU, ``linear_fc2``.

    ``label`` prefixes the time model's op names (``expert.``, ``shared.``; empty for a dense MLP)."""

    fc1: Linear
    fc2: Linear
    ffn: int
    label: str = ""

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.fc1, self.fc2)

    def ops(self, work: Work, setup: Setup) -> list[Op]:
        """The two linears (with their adapters) and the activation: read both halves, write the product."""
        ops = self.fc1.ops(work, setup, self.label) + self.fc2.ops(work, setup, self.label)
        swiglu = setup.dtype * 3 * work.tokens * self.ffn / setup.tp
        return [*ops, Op(f"{self.label}swiglu", 0.0, swiglu, "memory", "elementwise", scaling=AFFINE)]


def swiglu_mlp(hidden: int, ffn: int, label: str = "") -> SwiGLU:
    """The SwiGLU MLP of ``ffn`` intermediate width over ``hidden``-wide tokens."""
    return SwiGLU(Linear("linear_fc1", "column", hidden, 2 * ffn), Linear("linear_fc2", "row", ffn, hidden), ffn, label)


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP: the fp32 router ``[hidden -> experts]``, top-k routing, ``num_experts`` SwiGLU
    experts each token visits ``top_k`` of, and an optional shared expert every token visits."""

    num_experts: int
    top_k: int
    experts: SwiGLU
    shared: SwiGLU | None
    shared_gate: bool = False
    """Qwen's gate on the shared expert (``MoeDims.shared_expert_gate``): ``sigmoid(x @ w) * shared(x)``."""

    def forward(self, work: Work, setup: Setup, hidden: int) -> LayerWork:
        """FLOPs and bytes of the router, the routed experts (``tokens x top_k`` visits), the shared expert and its
        gate."""
        t, d, e = work.tokens, setup.dtype, self.num_experts
        out = LayerWork(
            [Op("router", 2 * t * hidden * e, d * (hidden * e + t * hidden), "matmul", setup.base_role, scaling=AFFINE)]
        )
        out.ops += self.experts.ops(Work(t * self.top_k, 0.0), setup)
        if self.shared is not None:
            out.ops += self.shared.ops(work, setup)
        if self.shared is not None and self.shared_gate:
            out.ops.append(self.gate_op(work, setup, hidden))
        return out

    def gate_op(self, work: Work, setup: Setup, hidden: int) -> Op:
        """The shared expert's gate (megatron-core's ``SharedExpertMLP.forward`` with ``moe_shared_expert_gate``):
        ``F.linear(x, gate_weight)`` (a ``[tokens, hidden] x [hidden, 1]`` product: reads the tokens, writes one
        logit each), the sigmoid (read, write), and the product with the shared expert's output (reads it and the
        score, writes the gated output). The weight is replicated, not split over TP: each rank gates its
        sequence-parallel shard, or every token without sequence parallelism. Memory-bound (one output column), so
        priced as an elementwise pass."""
        t = work.tokens / setup.tp if setup.sequence_parallel else work.tokens
        flops = t * (2 * hidden + 4 + hidden)
        moved = setup.dtype * t * (hidden + 1 + 2 + hidden + 1 + hidden)
        return Op("shared.gate", flops, moved, "memory", "elementwise", scaling=AFFINE)


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer: ``norm -> attention -> residual add -> norm -> MLP -> residual add``."""

    hidden: int
    attention: FullAttention | LatentAttention | GatedDeltaNet
    mlp: SwiGLU | MoE

    def adapted_linears(self, targets: Collection[str], ep: int = 1) -> Iterator[tuple[Linear, int]]:
        """Every linear LoRA wraps under ``targets``, with how many copies an expert-parallel rank of ``ep`` holds
        (MoE: one per local expert; ``ep=1``: the whole layer's). A shared expert's linears are adapted like a dense
        MLP's, one copy on every rank: Megatron-Bridge's LoRA matches ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``
        by their names (SkyRL 0.4.0 backports Megatron-Bridge PR #6089 for their TP reduce:
        ``patches/megatron/patch_shared_expert_lora_tp.py``), as the real backend's ``attach_lora`` does."""
        for linear in self.attention.linears:
            if linear.adapted(targets):
                yield linear, 1
        mlp, copies = (self.mlp, 1)
        if isinstance(self.mlp, MoE):
            for linear in self.mlp.shared.linears if self.mlp.shared is not None else ():
                if linear.adapted(targets):
                    yield linear, 1
            mlp, copies = self.mlp.experts, -(-self.mlp.num_experts // ep)
        for linear in mlp.linears:
            if linear.adapted(targets):
                yield linear, copies

    def norms_residuals(self, work: Work, setup: Setup) -> Op:
        """The two RMSNorms (read + write) and the two residual adds (two reads + a write) over the hidden states,
        on the sequence-parallel shard."""
        norm_tokens = work.tokens / setup.tp if setup.sequence_parallel else work.tokens
        return Op(
            "norms_residuals",
            0.0,
            setup.dtype * norm_tokens * self.hidden * (2 * 2 + 2 * 3),
            "memory",
            "elementwise",
            scaling=AFFINE,
        )

    def forward(self, work: Work, setup: Setup) -> LayerWork:
        """Every op and collective of the layer in forward over ``work``, on one device."""
        attention = self.attention.forward(work, setup, self.hidden)
        out = LayerWork([self.norms_residuals(work, setup)])
        out.ops += attention.ops
        if isinstance(self.mlp, MoE):
            mlp_ops = self.mlp.forward(work, setup, self.hidden).ops
            row = self.mlp.experts.fc2
        else:
            mlp_ops, row = self.mlp.ops(work, setup), self.mlp.fc2
        out.ops += mlp_ops
        out.collectives += attention.collectives + block_collectives("mlp", work, self.hidden, setup)
        out.collectives += lora_collectives(row, work, setup)
        return out


@dataclass(frozen=True)
class LMHead:
    """The ends of the model: the embedding lookup and the output layer, a vocab-parallel ``[hidden -> vocab]`` GEMM
    (column-parallel, never LoRA-adapted) followed by the log-probs. The memory walk's head graph
    (``memory_ops.head_graph``) takes the vocabulary width from ``output``."""

    output: Linear

    def integral(self, setup: Setup) -> bool:
        """Whether every constant of the head's formulas is an integer: the widths and dtype sizes are; the vocabulary
        shard ``n_out / tp`` is when TP divides the vocabulary. The head's FLOPs and bytes over integer tokens and
        logits are then integer arithmetic, exact below 2^53 whatever the order of its products and sums (the time
        model's affine form of the head relies on it)."""
        return self.output.n_out % setup.tp == 0

    def embedding(self, work: Work, setup: Setup) -> Op:
        """The lookup writes one hidden vector per token."""
        return Op("embedding", 0.0, setup.dtype * work.tokens * self.output.n_in, "memory", "elementwise", scaling=AFFINE)

    def passes(
        self, work: Work, logits_tokens: float, setup: Setup, fused: bool, entropy: bool = False
    ) -> tuple[LayerWork, LayerWork]:
        """Output layer and log-prob, forward and backward.

        Fused: logits are built chunk by chunk in fp32 and never kept; backward recomputes each chunk. Not fused: bf16
        logits, the fp32 upcast, the re-expansion to the global width (``logits_tokens`` slots: a zero tensor and a
        row copy), the chunked log-softmax; backward writes the fp32 logit gradient, concatenates it, slices it back.
        ``entropy`` (SkyRL's RL path, ``entropy_ops``): the entropy metric over the action logits in forward.
        """
        t, tp, d = work.tokens, setup.tp, setup.dtype
        h, v = self.output.n_in, self.output.n_out / tp
        gemm = Op("output_layer", 2 * t * h * v, d * (h * v + t * h), "matmul", "frozen", scaling=AFFINE)
        fwd, bwd = LayerWork(), LayerWork()
        if fused:
            fwd.ops += [gemm, Op("fused_logprob", 0.0, FP32 * 2 * t * v, "memory", "elementwise", scaling=AFFINE)]
            bwd.ops += [gemm, gemm, Op("fused_logprob.grad", 0.0, FP32 * 3 * t * v, "memory", "elementwise", scaling=AFFINE)]
            if setup.train_base:  # the output layer's weight gradient
                bwd.ops.append(gemm)
        else:
            fwd.ops += [
                Op("output_layer", gemm.flops, gemm.bytes + d * t * v, "matmul", "frozen", scaling=AFFINE),
                Op("fp32_upcast", 0.0, (d + FP32) * t * v, "memory", "elementwise", scaling=AFFINE),
                Op("recover_global_width", 0.0, FP32 * (logits_tokens + 2 * t) * v, "memory", "elementwise", scaling=AFFINE),
                Op("logprob_chunks", 0.0, FP32 * 2 * logits_tokens * v, "memory", "elementwise", scaling=AFFINE),
            ]
            bwd.ops += [
                Op("logprob_grad", 0.0, FP32 * 3 * logits_tokens * v, "memory", "elementwise", scaling=AFFINE),
                Op("unexpand_downcast", 0.0, (FP32 + d) * t * v, "memory", "elementwise", scaling=AFFINE),
                Op("output_layer.grad_input", gemm.flops, gemm.bytes + d * t * v, "matmul", "frozen", scaling=AFFINE),
            ]
            if setup.train_base:  # the output layer's weight gradient ``[v, h]`` from the logits' gradient and its input
                moved = gemm.bytes + d * t * v
                bwd.ops.append(Op("output_layer.grad_weight", gemm.flops, moved, "matmul", "frozen", scaling=AFFINE))
        if tp > 1:
            gathered = (
                [Collective("final_hidden.all_gather", "all_gather", t * h * d, scaling=AFFINE)]
                if setup.sequence_parallel
                else []
            )
            # Vocab-parallel softmax: the max and the sum of exponentials over the shards.
            reduce = Collective("vocab_parallel.all_reduce", "all_reduce", 2 * FP32 * logits_tokens, scaling=AFFINE)
            fwd.collectives += [*gathered, reduce]
            bwd.collectives += [*gathered]
        if entropy:
            ops, collectives = self.entropy_ops(logits_tokens, setup, fused)
            fwd.ops += ops
            fwd.collectives += collectives
        return fwd, bwd

    def entropy_ops(self, logits_tokens: float, setup: Setup, fused: bool) -> tuple[list[Op], list[Collective]]:
        """The RL path's entropy metric over the action logits (about ``logits_tokens`` positions: the longest
        response is the width less one). Not fused (``vocab_parallel_entropy``): the max read, the shifted copy
        written, exponentiated and divided in place, and the product with the logits reduced (six fp32 passes over
        the action logits). Fused (``_fused_vocab_parallel_entropy_from_hidden``): each chunk's logits recomputed by
        the output GEMM, then the fp32 cast, shift and exponential, softmax and product (eight fp32 passes). Its
        three vocab-parallel all-reduces move one fp32 value per position each."""
        a, tp, d = logits_tokens, setup.tp, setup.dtype
        h, v = self.output.n_in, self.output.n_out / tp
        ops = []
        if fused:
            ops.append(
                Op("entropy.output_layer", 2 * a * h * v, d * (h * v + a * h + a * v), "matmul", "frozen", scaling=AFFINE)
            )
            ops.append(Op("entropy", 0.0, FP32 * 8 * a * v, "memory", "elementwise", scaling=AFFINE))
        else:
            ops.append(Op("entropy", 0.0, FP32 * 6 * a * v, "memory", "elementwise", scaling=AFFINE))
        collectives = [Collective("entropy.all_reduce", "all_reduce", 3 * FP32 * a, scaling=AFFINE)] if tp > 1 else []
        return ops, collectives

    def prompt_log_softmax(self, positions: float) -> Op:
        """vLLM's prompt log-probs (``_get_prompt_logprobs_dict``): the logits of ``positions`` prompt positions over
        the whole vocabulary (gathered over TP), cast to fp32, their log-softmax, and the target's rank among them
        (about four fp32 passes)."""
        return Op("prompt_logprobs", 0.0, FP32 * 4 * positions * self.output.n_out, "memory", "elementwise", scaling=AFFINE)

    def last_token_logits(self, rows: float, setup: Setup) -> Op:
        """A sampler's output layer: logits for each sequence's last token only, bound by streaming the weights."""
        h, v = self.output.n_in, self.output.n_out / setup.tp
        return Op("output_layer", 2 * rows * h * v, setup.dtype * h * v, "matmul", "frozen", scaling=AFFINE)


def lm_head(model: ModelArch) -> LMHead:
    """The embedding and output layer of ``model``."""
    return LMHead(Linear("output_layer", "column", model.hidden_size, model.vocab_size, adaptable=False))


def full_attention(model: ModelArch, window: int = 0) -> FullAttention:
    """The full-attention block of ``model`` (a sliding-window one over ``window`` tokens when given): q/k norms
    unless ``model.extra['qk_layernorm']`` is false, rotary unless ``model.extra['position_embedding']`` is
    ``none``."""
    h = model.hidden_size
    return FullAttention(
        qkv=Linear("linear_qkv", "column", h, model.qkv_width),
        proj=Linear("linear_proj", "row", model.attention_out_width, h),
        heads=model.num_attention_heads,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        qk_norm=bool(model.extra.get("qk_layernorm", True)),
        rotary=model.extra.get("position_embedding", "rope") == "rope",
        output_gate=model.attention_output_gate,
        window=window,
        sinks=model.attention_sinks,
    )


def latent_attention(model: ModelArch) -> LatentAttention:
    """The multi-latent attention block of ``model`` (megatron-core ``MLASelfAttention.__init__``'s linears)."""
    m = model.mla
    if m is None:
        raise ValueError(f"model '{model.name}' has no multi-latent attention dimensions")
    h, heads = model.hidden_size, model.num_attention_heads
    q_out = heads * m.q_head_dim
    if m.q_lora_rank:
        q_down: Linear | None = Linear("linear_q_down_proj", "column", h, m.q_lora_rank)
        q_up = Linear("linear_q_up_proj", "column", m.q_lora_rank, q_out)
    else:
        q_down, q_up = None, Linear("linear_q_proj", "column", h, q_out)
    return LatentAttention(
        q_down=q_down,
        q_up=q_up,
        kv_down=Linear("linear_kv_down_proj", "column", h, m.latent_width),
        kv_up=Linear("linear_kv_up_proj", "column", m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
        proj=Linear("linear_proj", "row", heads * m.v_head_dim, h),
        heads=heads,
        dims=m,
    )


def attention_block(model: ModelArch, kind: str) -> FullAttention | LatentAttention | GatedDeltaNet:
    """The attention block of ``model``'s layers of ``kind``: gated DeltaNet, multi-latent attention, or softmax
    attention (over a sliding window in a ``sliding_attention`` layer)."""
    if kind == "linear_attention":
        return gated_deltanet(model)
    if model.mla is not None:
        return latent_attention(model)
    return full_attention(model, model.sliding_window if kind == "sliding_attention" else 0)


def gated_deltanet(model: ModelArch) -> GatedDeltaNet:
    """The gated-DeltaNet block of ``model``."""
    la = model.linear_attention
    if la is None:
        raise ValueError(f"model '{model.name}' has no linear-attention dimensions")
    h = model.hidden_size
    return GatedDeltaNet(Linear("in_proj", "column", h, la.in_proj_width), Linear("out_proj", "row", la.v_width, h), la)


def moe_block(model: ModelArch) -> MoE:
    """The MoE MLP of ``model``'s MoE layers."""
    moe = model.moe
    if moe is None:
        raise ValueError(f"model '{model.name}' has no MoE layers")
    h, shared = model.hidden_size, moe.shared_expert_ffn_hidden_size
    experts = swiglu_mlp(h, moe.expert_ffn_hidden_size, "expert.")
    shared_mlp = swiglu_mlp(h, shared, "shared.") if shared else None
    return MoE(moe.num_experts, moe.top_k, experts, shared_mlp, moe.shared_expert_gate and shared_mlp is not None)


def layer_kind(model: ModelArch, kind: str, moe: bool) -> DecoderLayer:
    """The description of ``model``'s layers of ``kind`` (``full_attention`` / ``sliding_attention`` /
    ``linear_attention``), with an MoE MLP when ``moe``."""
    attention = attention_block(model, kind)
    mlp = moe_block(model) if moe else swiglu_mlp(model.hidden_size, model.ffn_hidden_size)
    return DecoderLayer(model.hidden_size, attention, mlp)


def decoder_layer(model: ModelArch, index: int) -> DecoderLayer:
    """The description of ``model``'s decoder layer ``index``."""
    return layer_kind(model, model.layer_types[index], model.is_moe_layer(index))


def lora_parameter_count(model: ModelArch, endpoint: Endpoint) -> int:
    """Trainable adapter parameters: rank x (in + out) for every adapted linear of every layer."""
    r, targets = endpoint.lora.rank, endpoint.adapted_targets(model)
    return sum(
        copies * linear.adapter_parameters(r)
        for index in range(model.num_layers)
        for linear, copies in decoder_layer(model, index).adapted_linears(targets)
    )

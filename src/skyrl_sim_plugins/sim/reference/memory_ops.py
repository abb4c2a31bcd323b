"""Per-op tensor sizes of one micro-batch on one rank: the graphs of the embedding, each decoder layer kind and the
LM head with its log-prob, as Megatron-core (with Megatron-Bridge LoRA and SkyRL's log-prob code) runs them.

Layout is Megatron's ``[s, b, n]``; ``s`` is the micro-batch's width (after trimming) divided by context parallelism,
and sequence-parallel tensors hold ``ceil(s / tp)`` of it. Every size is per tensor-parallel rank. A decoder layer's
blocks, linears (split, widths, LoRA targets) and optional ops are read from the layer description the time model
prices too (``layer_ops.layer_kind``); what is added here is memory-specific: the tensors each op makes, views, what
is kept for backward, workspaces. Which tensors exist and which are kept follows the endpoint's settings:

* ``layer_spec``: ``transformer_engine`` fuses each norm with the next column-parallel linear (and its rotary
  kernel makes no tables); ``local`` runs separate norms and megatron-core's unfused rotary embedding.
* ``trainer.attention`` (``Trainer.attention_kernel``, the fact the time model reads too) decides the core
  attention: ``flash`` keeps nothing quadratic; ``unfused`` (Megatron's dot-product attention) keeps the softmax
  probabilities ``[b * heads, s, s]`` (and repeated K/V for grouped-query attention), and holds the scores-sized
  input buffer of its ``baddbmm`` while it runs.
* LoRA (``lora.targets``, Megatron-Bridge's adapters) on a column-parallel linear adds A ``[s, b, r]``, B
  ``[s, b, out]``, a scaled copy and the sum, and pins the (sequence-parallel gathered) input for A's weight
  gradient; on a row-parallel linear B's output is gathered to the full width and split back to the sequence shard.
  Frozen base linears keep nothing; ``train_base_weights`` keeps every linear's input.
* ``bias_activation_fusion``: fused SwiGLU keeps only its input; unfused keeps the fc1 output, silu(x1), the linear
  half plus megatron-core's ``glu_linear_offset`` (a new tensor) and the product.
* MoE layers (``moe_mlp_block``): megatron-core's MoE layer op by op (router, all-gather dispatch and
  permutation, each expert of the local spec's ``SequentialMLP`` or TransformerEngine's grouped GEMM, unpermutation,
  shared expert), every size from ``moe_routes.moe_layer_dims``.
* Hybrid models: full-attention layers (GQA, optional output gate, q/k norms unless ``model.extra['qk_layernorm']``
  is false, rotary unless ``model.extra['position_embedding']`` is ``none``) and gated-DeltaNet layers
  (``gated_deltanet_block``: megatron-core's ``GatedDeltaNet`` op by op, FLA's chunked kernel with what it keeps and
  its per-chunk states; both projections LoRA-wrapped when targeted).
* Sliding-window layers (``sliding_attention``): the flash kernels keep what full attention keeps (nothing
  quadratic); megatron-core's unfused attention builds its own banded ``[s, s]`` mask per layer
  (``get_sliding_window_causal_mask``) and keeps it for the in-place masked fill's backward.
* Multi-latent attention (``latent_attention_block``): megatron-core's ``MLASelfAttention`` tensor by tensor.
* LM head: ``fused_lm_head_logprob`` (log-probs from hidden states in chunks: ``fused_lm_head_workspaces``, or the
  Triton backend) or full logits; ``fp32_output`` (Float16Module's upcast); the re-expansion to the call's global
  width when ``CallShape.logits_width`` is set; the log-prob and the RL path's entropy as the endpoint's SkyRL
  revision runs them (``memory_logprob``).

**The lanes' rule: decide only what every width of a tile decides alike.** Every builder here (and in
``memory_logprob``) also runs over a whole tile of widths at once (``fast.memory_lanes``): ``Dims.seq`` and
``Dims.logits_width``, and every size computed from them, may be a ``Lanes``, one int64 per width. Arithmetic on them
is elementwise and needs no care. A *decision* on a size (``if``, ``and``/``or``, ``min``/``max``, ``range``,
``int()``, a comparison used as a truth value) is allowed only where all widths of a tile agree: ``Lanes`` then
answers the shared value, and otherwise raises ``Diverged`` and the tile is evaluated again group by group (correct,
and slower). What ``Lanes`` cannot see is forbidden: a size formatted into a name (an f-string, ``str()``: every lane
would get the array's text), a size as a dict key or set member, a size passed to ``math`` functions or to a loop
that does not go through ``range``/``int``. Rows, TP, hidden widths and the settings are plain ints: decide on them
freely. ``tests/test_lane_rule.py`` runs the builders over tiles of widths on every shipped endpoint and checks that
each lane gets the graph (names, topology, bytes) its width gets alone, and ``tests/test_memory_lanes.py`` holds every
lane's effect to the compiled walk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from skyrl_sim.api import Endpoint, ModelArch, profile_device
from skyrl_sim_plugins.sim.description.layer_ops import (
    FullAttention,
    GatedDeltaNet,
    LatentAttention,
    Linear,
    MoE,
    SwiGLU,
    full_attention,
    layer_kind,
    lm_head,
    sequence_parallel,
)
from skyrl_sim_plugins.sim.description.moe_routes import MoeLayerDims
from skyrl_sim_plugins.sim.description.trainers import hf_lora_modules, trainer_of
from skyrl_sim_plugins.sim.reference.allocator import AllocatorRule, allocator_rule
from skyrl_sim_plugins.sim.reference.memory_graph import Graph, Shape, Workspace, nbytes
from skyrl_sim_plugins.sim.reference.memory_logprob import entropy, logprob, rl_loss, triton_fused_logprob


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Dims:
    """Everything a micro-batch's graphs depend on (a cache key: equal Dims give equal graphs)."""

    rows: int  # b (1 when packed)
    seq: int  # s per CP rank (packed: the packed total)
    logits_width: int  # global width logits are re-expanded to (0: none)
    tp: int
    sp: bool
    act: str  # activation dtype
    hidden: int
    lora_rank: int
    lora_targets: frozenset[str]
    layer_spec: str
    attention: str  # the core attention kernel: "unfused" or "flash"
    fused_swiglu: bool
    train_base: bool
    fp32_output: bool
    fused_lm_head: bool
    chunk: int
    logprob_kernel: str
    vl_clone: bool
    cuda: bool  # CUDA kernels (their workspaces differ from the CPU kernels')
    # The endpoint's SkyRL revision's rules for the head (``skyrl_versions.SkyrlRules``; ``memory_logprob``):
    logprob_backward: str = "list_concat"
    unchunked_short: bool = False
    fused_backend: str = "torch"
    entropy: str = ""  # the RL path's entropy rule ("" for a cross-entropy call)
    entropy_chunk_memory_mb: int = 512
    entropy_chunk_size: int | None = 0
    # The trainer's model code (``description.trainers``): megatron-core's graphs, or the Hugging Face model SkyRL's
    # FSDP trainer runs (``memory_ops_hf``; its LoRA targets are Hugging Face module names)
    model_code: str = "megatron"
    masked: bool = False  # the Hugging Face model: some row is left-padded, so the model builds an attention mask
    # The re-expanded head (``_cross_entropy_head``): how many tokens each row is short of ``seq``, in the micro-batch's
    # row order (``reads_row_tokens``); () when every row is ``seq`` tokens long
    short_rows: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        endpoint: Endpoint,
        model: ModelArch,
        rows: int,
        seq: int,
        logits_width: int,
        rl: bool = False,
        masked: bool = False,
        short_rows: tuple[int, ...] = (),
    ) -> Dims:
        """The dims of a micro-batch of ``rows`` x ``seq`` (``logits_width``: the width its logits are re-expanded
        to, 0 for none); ``rl``: the call takes SkyRL's RL path (a loss other than cross-entropy); ``masked``: some
        row is shorter than ``seq`` (the Hugging Face model's attention mask); ``short_rows``: how many tokens each
        row is short of ``seq``, where the head reads it (``reads_row_tokens``; ``segments.short_rows``)."""
        p, t = endpoint.parallelism, endpoint.trainer
        version = endpoint.rules
        trainer = trainer_of(endpoint)
        if trainer.model_code == "hf":
            return cls(
                rows=rows,
                seq=seq,
                logits_width=0,
                tp=1,
                sp=False,
                act="fp32" if t.params_dtype == "fp32" else t.params_dtype,
                hidden=model.hidden_size,
                lora_rank=endpoint.lora.rank,
                lora_targets=hf_lora_modules(endpoint, model),
                layer_spec="hf",
                attention="flash",  # flash-attention 2 or SDPA's fused kernels: nothing quadratic (a mask is ``masked``)
                fused_swiglu=False,
                train_base=endpoint.full_fine_tune,
                fp32_output=False,
                fused_lm_head=False,
                chunk=t.logprobs_chunk_size,
                logprob_kernel="hf",
                vl_clone=False,
                cuda=profile_device(endpoint.hardware.profile) == "cuda",
                model_code="hf",
                masked=masked,
            )
        return cls(
            rows=rows,
            seq=ceil_div(seq, p.cp),
            logits_width=ceil_div(logits_width, p.cp) if logits_width else 0,
            tp=p.tp,
            sp=sequence_parallel(endpoint),
            act="fp32" if t.params_dtype == "fp32" else t.params_dtype,
            hidden=model.hidden_size,
            lora_rank=endpoint.lora.rank,
            lora_targets=endpoint.adapted_targets(model),
            layer_spec=t.layer_spec,
            attention=t.attention_kernel,
            fused_swiglu=t.bias_activation_fusion,
            train_base=t.train_base_weights,
            fp32_output=t.fp32_output,
            fused_lm_head=t.fused_lm_head_logprob,
            chunk=t.logprobs_chunk_size,
            logprob_kernel=t.logprob_kernel,
            vl_clone=not t.language_model_only,
            cuda=profile_device(endpoint.hardware.profile) == "cuda",
            logprob_backward=version.logprob_backward,
            unchunked_short=version.unchunked_logprob_when_short,
            fused_backend=t.fused_lm_head_logprob_backend,
            entropy=version.entropy if rl else "",
            entropy_chunk_memory_mb=t.vocab_entropy_chunk_memory_mb,
            entropy_chunk_size=t.vocab_entropy_chunk_size,
            short_rows=short_rows,
        )

    @property
    def allocator(self) -> AllocatorRule:
        """How this device's allocator sizes the graphs' tensors (``allocator.allocator_rule``)."""
        return allocator_rule(self.cuda)

    @property
    def full(self) -> Shape:
        return (self.seq, self.rows, self.hidden)

    @property
    def sp_seq(self) -> int:
        return ceil_div(self.seq, self.tp) if self.sp else self.seq

    def shard(self, width: int) -> int:
        return ceil_div(width, self.tp)


def reads_row_tokens(endpoint: Endpoint) -> bool:
    """Whether the endpoint's LM head reads each row's tokens, not only the micro-batch's width: the real backend's
    re-expansion (``logprob_kernel: vocab_parallel_cross_entropy``, megatron-core's model, no fused LM head, no context
    parallelism) copies each row's own tokens, so its backward's clone and zeroed destination per row are that row's
    size (``_row_copies_backward``)."""
    t, p = endpoint.trainer, endpoint.parallelism
    return (
        t.logprob_kernel == "vocab_parallel_cross_entropy"
        and not t.fused_lm_head_logprob
        and p.cp == 1
        and trainer_of(endpoint).model_code == "megatron"
    )


def rms_norm(g: Graph, d: Dims, name: str, x: str) -> str:
    """An RMSNorm over ``x`` (``[s, b, h]``); returns its output.

    With every weight trained and megatron-core's local spec (``WrappedTorchNorm``: ``torch.nn.RMSNorm``), torch's
    composite ``rms_norm`` (``aten/src/ATen/native/layer_norm.cpp``: ``rms_norm_symint``) multiplies the weight into
    ``x * rsqrt(mean(x^2) + eps)``, computed in the op math dtype (fp32 for 16-bit inputs); the weight's multiply
    saves that normalized tensor for the weight's gradient (autograd's ``mul`` saves ``self`` when ``other`` requires
    grad: ``tools/autograd/derivatives.yaml``), alive until the norm's backward. That backward makes the input's
    gradient product ``grad * weight`` first, then ``grad * normalized`` (``mul_tensor_backward``) summed to the
    weight's ``[h]`` gradient, which DDP's hook adds into ``main_grad``. A frozen weight (LoRA) saves nothing of it;
    TransformerEngine's fused norm (``transformer_engine`` spec) keeps its own statistics instead."""
    shape = (d.sp_seq, d.rows, d.hidden)
    if not (d.train_base and d.layer_spec == "local"):
        return g.op(name, shape, d.act, (x,), saves=(x,))
    normalized = g.op(f"{name}.normalized", shape, "fp32", (x,), saves=(x,))
    extra = (("weight_grad_product", shape, "fp32"), ("weight_grad", (d.hidden,), "fp32"))
    return g.op(name, shape, d.act, (normalized,), saves=(normalized,), backward_extra=extra, grad_before_workspaces=True)


def _norm(g: Graph, d: Dims, prefix: str, x: str) -> str:
    """The pre-linear norm (and the sequence-parallel all-gather); returns the full-sequence normed input."""
    local = rms_norm(g, d, f"{prefix}.norm", x)
    if d.sp:
        return g.op(f"{prefix}.all_gather", d.full, d.act, (local,))
    return local


def weight_grad(d: Dims, shape: Shape) -> tuple[Workspace, ...]:
    """With every weight trained, a linear's backward makes its weight's gradient ``[out, in]`` (per TP rank, the
    activation dtype: ``gradient_accumulation_fusion`` off, SkyRL's default), which megatron-core's DDP hook adds into
    the gradient buffer's ``main_grad`` and drops (``LinearWithGradAccumulationAndAsyncCommunication.backward``,
    ``DistributedDataParallel._make_backward_post_hook``)."""
    return (("weight_grad", shape, d.act),) if d.train_base else ()


def column_linear(g: Graph, d: Dims, module: str, x_full: str, linear: Linear) -> str:
    """Column-parallel ``linear`` of ``module`` over the full sequence (output sharded by TP), LoRA-wrapped when
    targeted."""
    prefix = f"{module}.{linear.name}"
    out_shape = (d.seq, d.rows, d.shard(linear.n_out))
    saves = (x_full,) if d.train_base else ()
    grad = weight_grad(d, (d.shard(linear.n_out), linear.n_in))
    base = g.op(f"{prefix}.base", out_shape, d.act, (x_full,), saves=saves, backward_extra=grad)
    if not linear.adapted(d.lora_targets):
        return base
    a = g.op(f"{prefix}.lora_a", (d.seq, d.rows, d.lora_rank), d.act, (x_full,), saves=(x_full,))
    b = g.op(f"{prefix}.lora_b", out_shape, d.act, (a,), saves=(a,))
    scaled = g.op(f"{prefix}.lora_scale", out_shape, d.act, (b,))
    # LoRALinear.forward keeps its wrapped layer's (gathered) norm output in a local until it returns.
    return g.op(f"{prefix}.lora_add", out_shape, d.act, (base, scaled), holds=(x_full,))


def row_linear(g: Graph, d: Dims, module: str, x: str, linear: Linear) -> str:
    """Row-parallel ``linear`` of ``module`` (input sharded by TP), reduce-scattered under sequence parallel,
    LoRA-wrapped when targeted.

    Megatron-Bridge's row-side adapter: A is row-parallel (all-reduced ``[s, b, r]``), B column-parallel with its
    output gathered to the full width ``[s, b, out]``, then split to the sequence-parallel shard and scaled.
    """
    prefix, out_width = f"{module}.{linear.name}", linear.n_out
    saves = (x,) if d.train_base else ()
    grad = weight_grad(d, (out_width, d.shard(linear.n_in)))
    partial = g.op(f"{prefix}.base", (d.seq, d.rows, out_width), d.act, (x,), saves=saves, backward_extra=grad)
    sp_shape = (d.sp_seq, d.rows, out_width)
    base = g.op(f"{prefix}.reduce_scatter", sp_shape, d.act, (partial,)) if d.sp else partial
    if not linear.adapted(d.lora_targets):
        return base
    a = g.op(f"{prefix}.lora_a", (d.seq, d.rows, d.lora_rank), d.act, (x,), saves=(x,))
    b = g.op(f"{prefix}.lora_b", (d.seq, d.rows, d.shard(out_width)), d.act, (a,), saves=(a,))
    if d.tp > 1:
        b = g.op(f"{prefix}.lora_b_gather_output", (d.seq, d.rows, out_width), d.act, (b,))
    if d.sp:
        b = g.op(f"{prefix}.lora_scatter_to_sequence_parallel", sp_shape, d.act, (b,))
    scaled = g.op(f"{prefix}.lora_scale", sp_shape, d.act, (b,))
    return g.op(f"{prefix}.lora_add", sp_shape, d.act, (base, scaled))


def _rotary(g: Graph, d: Dims, which: str, x: str, shape: Shape, head_dim: int) -> str:
    """Rotary embedding of q or k. Megatron-core's unfused path (``local``) makes ``cos`` and ``sin`` of the table,
    ``[s, 1, 1, head_dim]`` fp32 whatever the rows or TP, and the products keep both for backward; the fused
    kernel (``transformer_engine``) makes none."""
    if d.layer_spec != "local":
        return g.op(f"self_attention.rotary_{which}", shape, d.act, (x,))
    table = (d.seq, 1, 1, head_dim)
    cos = g.op(f"self_attention.rotary_{which}_cos", table, "fp32")
    sin = g.op(f"self_attention.rotary_{which}_sin", table, "fp32")
    return g.op(f"self_attention.rotary_{which}", shape, d.act, (x, cos, sin), saves=(cos, sin))


def microbatch_inputs(d: Dims, model: ModelArch) -> tuple[Workspace, ...]:
    """Tensors a micro-batch's forward step makes before the embedding and holds until its last backward.

    On the ``local`` spec: the explicit ``[s, s]`` boolean causal mask (Megatron's default one is built on cuda, so
    the CPU worker passes its own) and, with rotary positions, the rotary table ``[s, 1, 1, head_dim]`` fp32 that
    the model hands every layer (and every recompute). Neither is sharded by TP. ``transformer_engine`` builds
    neither on the device here.
    """
    if d.layer_spec != "local":
        return ()
    tensors: tuple[Workspace, ...] = ()
    if d.attention == "unfused":  # the flash module masks causally itself: the worker passes no mask
        tensors += (("attention_mask", (1, 1, d.seq, d.seq), "bool"),)
    # megatron-core's GPTModel builds no model-level rotary table for MLA (its layers make their own, cached)
    if full_attention(model).rotary and model.mla is None:
        tensors += (("rotary_table", (d.seq, 1, 1, model.head_dim), "fp32"),)
    return tensors


def scores_buffer(d: Dims, model: ModelArch, moe_gather: int = 0) -> Workspace | None:
    """The largest request of megatron-core's process-wide ``GlobalMemoryBuffer`` (name ``"mpu"``, the activation
    dtype) a micro-batch makes: the scores-sized input of the unfused attention's ``baddbmm`` (``beta = 0``: read for
    nothing), ``[b * heads, s, s]``, and the MoE all-gather dispatcher's gathered tokens (``moe_gather`` of them,
    ``[tokens, hidden]``: megatron gathers them into this buffer under TP or EP). The buffer grows to the largest
    request the worker process has seen and is never freed, so it is not a tensor of the layer's graph but memory
    carried from call to call (``segments.buffer_growth``). None when the endpoint makes no such request."""
    if d.model_code == "hf":  # transformers' model has no megatron-core process-wide buffer
        return None
    requests = []
    if d.attention == "unfused" and any(kind != "linear_attention" for kind in model.layer_types):
        requests.append((d.rows * d.shard(model.num_attention_heads), d.seq, d.seq))
    if moe_gather:
        requests.append((moe_gather, d.hidden))
    if not requests:
        return None
    return ("global_memory_buffer.mpu", max(requests, key=math.prod), d.act)


def _softmax_backward_workspace(d: Dims, shape: Shape, dtype: str) -> tuple[Workspace, ...]:
    """PyTorch's CUDA softmax backward first materialises ``grad * output`` (a gradient-sized temporary) and hands it
    to its kernel; the CPU kernel reduces in place and makes none."""
    return (("grad_times_output", shape, dtype),) if d.cuda else ()


def _unfused_core_attention(
    g: Graph,
    d: Dims,
    q: str,
    k: str,
    v: str,
    scores_shape: Shape,
    ctx_shape: Shape,
    held: tuple[str, ...] = (),
    window: int = 0,
) -> str:
    """Megatron-core's ``DotProductAttention`` without fused kernels, as autograd runs it.

    The ``baddbmm`` writes the scores ``[b * heads, s, s]`` into a new tensor (its input buffer is the persistent
    ``scores_buffer``); ``matmul_result`` keeps them referenced until the attention returns. The unfused softmax
    (``FusedScaleMaskSoftmax.forward_torch_softmax``, ``attention_softmax_in_fp32``) then differs by dtype:

    * 16-bit activations: ``input.float()`` makes an fp32 copy, the causal mask is filled into that copy in place
      (its backward keeps only the mask), the fp32 softmax output is saved for backward and cast back to the
      activation dtype for the context product. Backward: the probabilities' gradient (16-bit), its fp32 cast, the
      softmax gradient (fp32, while the saved output and the cast gradient are alive; on CUDA with PyTorch's
      ``grad * output`` temporary beside it), the masked-fill gradient (fp32) and its cast back to 16 bits.
    * fp32 activations: ``.float()`` is the tensor itself, so the mask is filled in place into a view of the
      ``baddbmm`` output; autograd's backward of that in-place op on a view (CopySlices) makes a base-sized gradient,
      a copy of it and the masked copy while the scores' gradient is alive: three scores-sized workspaces.

    The context is the ``bmm`` output permuted and made contiguous: a copy made while the product is alive. ``held``:
    the callers' tensors referenced until the attention returns (what a no-grad forward cannot free earlier).

    A sliding-window layer (``window``): ``forward_torch_softmax`` ignores the passed mask and builds its own with
    ``get_sliding_window_causal_mask`` (a ones ``[s, s]`` bool, its ``triu``, its ``tril``, the negation), and the
    in-place masked fill keeps that mask for its backward.
    """
    # fp32: the mask is filled into a view of the scores (three scores-sized gradients); 16-bit: into the fp32 copy,
    # whose masked-fill gradient is made while the fp32 softmax gradient is still alive.
    fp32 = d.act == "fp32"

    def scores_sized(name: str, dtype: str, inputs: tuple[str, ...], **kwargs: Any) -> str:
        """One of the core attention's ``[b * heads, s, s]`` ops (recomputed under selective recompute)."""
        return g.op(f"self_attention.core_attention.{name}", scores_shape, dtype, inputs, core_attn=True, **kwargs)

    mask_grads = tuple((name, scores_shape, d.act) for name in ("mask_base_grad", "mask_grad_copy", "mask_fill_grad"))
    scores = scores_sized("scores", d.act, (q, k), saves=(q, k), backward_extra=mask_grads if fp32 else ())
    if window:
        band = (d.seq, d.seq)
        steps = tuple((name, band, "bool") for name in ("window_ones", "window_triu", "window_tril"))
        mask = g.op("self_attention.core_attention.window_mask", band, "bool", (), temps=steps, core_attn=True)
        held += (mask,)
    softmax_input = scores
    if not fp32:
        mask_grad = (("mask_fill_grad", scores_shape, "fp32"),)
        softmax_input = scores_sized("softmax_input_fp32", "fp32", (scores,), backward_extra=mask_grad)
    softmax_workspace = _softmax_backward_workspace(d, scores_shape, "fp32")
    masks = (held[-1],) if window else ()
    probs = scores_sized(
        "softmax", "fp32", (softmax_input,), save_output=True, backward_extra=softmax_workspace, saves=masks
    )
    if not fp32:
        probs = scores_sized("softmax_output_cast", d.act, (probs,))
    return g.op(
        "self_attention.core_attention.context",
        ctx_shape,
        d.act,
        (probs, v),
        saves=(probs, v),
        core_attn=True,
        temps=(("context_product", ctx_shape, d.act),),
        holds=(scores, *held),
    )


def attention_block(g: Graph, d: Dims, block: FullAttention, x: str) -> str:
    """Full attention with GQA, optional output gate and q/k norms; returns the post-attention residual."""
    heads = d.shard(block.heads)
    kv_heads = max(1, d.shard(block.kv_heads))
    hd = block.head_dim
    normed = _norm(g, d, "self_attention", x)
    qkv = column_linear(g, d, "self_attention", normed, block.qkv)
    q = g.view("self_attention.query", qkv, (d.seq, d.rows, heads * hd))
    k = g.view("self_attention.key", qkv, (d.seq, d.rows, kv_heads * hd))
    v = g.view("self_attention.value", qkv, (d.seq, d.rows, kv_heads * hd))
    if block.qk_norm:
        q = g.op("self_attention.q_layernorm", (d.seq, d.rows, heads * hd), d.act, (q,), saves=(q,))
        k = g.op("self_attention.k_layernorm", (d.seq, d.rows, kv_heads * hd), d.act, (k,), saves=(k,))
    if block.rotary:
        q = _rotary(g, d, "q", q, (d.seq, d.rows, heads * hd), hd)
        k = _rotary(g, d, "k", k, (d.seq, d.rows, kv_heads * hd), hd)
    ctx_shape = (d.seq, d.rows, heads * hd)
    if d.attention == "unfused":
        # SelfAttention.forward's locals (the rotated query and key, the value view of the fused qkv output) and the
        # core attention's (K/V repeated for GQA) stay referenced until the core attention returns
        held = (normed, q, k, v)  # TransformerLayer.forward holds the norm's output until the attention returns
        if kv_heads < heads:
            k = g.op("self_attention.repeat_k", ctx_shape, d.act, (k,))
            v = g.op("self_attention.repeat_v", ctx_shape, d.act, (v,))
            held += (k, v)
        ctx = _unfused_core_attention(g, d, q, k, v, (d.rows * heads, d.seq, d.seq), ctx_shape, held, block.window)
    elif d.layer_spec == "local":
        ctx = sdpa_flash_attention(g, d, q, k, v, heads, kv_heads, hd)
    else:
        ctx = g.op(
            "self_attention.core_attention.flash",
            ctx_shape,
            d.act,
            (q, k, v),
            saves=(q, k, v),
            save_output=True,
            core_attn=True,
        )
    if block.output_gate:
        gate = g.view("self_attention.gate", qkv, ctx_shape)
        sig = g.op("self_attention.gate_sigmoid", ctx_shape, d.act, (gate,), save_output=True)
        ctx = g.op("self_attention.gate_mul", ctx_shape, d.act, (ctx, sig), saves=(ctx, sig))
    proj = row_linear(g, d, "self_attention", ctx, block.proj)
    # TransformerLayer._forward_attention keeps the norm's output (``input_layernorm_output``) in a local until the
    # residual add: what a forward without grad cannot free earlier
    return g.op("self_attention.residual_add", (d.sp_seq, d.rows, d.hidden), d.act, (proj, x), holds=(normed,))


def sdpa_flash_attention(
    g: Graph, d: Dims, q: str, k: str, v: str, heads: int, kv_heads: int, hd: int, v_dim: int | None = None
) -> str:
    """The local spec's flash core attention (``megatron_vllm.flash_attention.SdpaFlashAttention``): torch's
    ``scaled_dot_product_attention``, causal, ``enable_gqa`` (K/V are never repeated), held to the flash kernel.

    Forward, on both devices: the output, laid out like q (``[s, b, heads, hd]``, so the ``[s, b, heads * hd]`` context
    is a view of it), and the log-sum-exp ``[b, heads, s]`` fp32, both kept for backward with q, k and v. Nothing
    quadratic. Backward: dq, dk, dv at the query's and the K/V's own head counts (the walk's input gradients) and:

    * CUDA (FlashAttention-2's ``mha_bwd``): the fp32 dq accumulator ``[b, round128(s), heads, round32(hd)]``, the
      fp32 softmax-gradient row sums ``[b, heads, round128(s)]`` and, with fewer KV heads than query heads, dk and dv
      for every query head ``[b, s, heads, hd]`` before they are summed per group;
    * CPU (ATen's flash kernel for CPU): nothing more; its scratch is a few per-thread blocks of
      ``q_split x kv_split`` elements, not tensors of the call's size.

    ``v_dim``: the value's head width when it differs from the query's (multi-latent attention); the output has it.
    """
    ctx_shape = (d.seq, d.rows, heads * (v_dim or hd))
    lse = g.op("self_attention.core_attention.logsumexp", (d.rows, heads, d.seq), "fp32", core_attn=True)
    extra: tuple[Workspace, ...] = ()
    if d.cuda:
        s128, hd32 = ceil_div(d.seq, 128) * 128, (ceil_div(hd, 32) * 32 if hd <= 192 else 256)
        extra = (("dq_accum", (d.rows, s128, heads, hd32), "fp32"), ("softmax_d", (d.rows, heads, s128), "fp32"))
        if kv_heads < heads:
            extra += tuple((f"{w}_expanded", (d.rows, d.seq, heads, hd), d.act) for w in ("dk", "dv"))
    return g.op(
        "self_attention.core_attention.sdpa_flash",
        ctx_shape,
        d.act,
        (q, k, v),
        saves=(q, k, v, lse),
        save_output=True,
        core_attn=True,
        backward_extra=extra,
    )


def _gathered_down_projection(g: Graph, d: Dims, name: str, x_full: str, linear: Linear) -> str:
    """A column-parallel down projection of ``MLASelfAttention`` whose output megatron gathers back to its full width
    under TP (``gather_from_tensor_model_parallel_region``: a new tensor; the shard dies once gathered)."""
    out = column_linear(g, d, "self_attention", x_full, linear)
    if d.tp > 1:
        out = g.op(f"self_attention.{name}_gather", (d.seq, d.rows, linear.n_out), d.act, (out,))
    return out


def latent_attention_block(g: Graph, d: Dims, block: LatentAttention, x: str) -> str:
    """megatron-core 0.16.1's ``MLASelfAttention`` (``get_query_key_value_tensors``, ``qkv_up_proj_and_rope_apply``
    without rope fusion, then ``forward``); returns the post-attention residual.

    The down projections' outputs (the compressed query ``[s, b, q_lora_rank]`` and the latent with the rotary key
    ``[s, b, kv_lora_rank + rope]``), gathered under TP; the q and kv norms save them. The up projections make the
    query ``[s, b, heads x q_head_dim]`` and ``kv`` ``[s, b, heads x (nope + v)]``. The rotary parts (views) are
    rotated into new tensors, each rotation saving its view (which keeps the whole query, and the latent, alive) and
    the fp32 cos and sin; the query and the key are concatenations (``torch.cat``: new tensors, its backward slices
    the gradient), the key's rotary part expanded over the heads; the value, a strided view of ``kv``, is made
    contiguous (a copy). Core attention as for full attention (q and k ``q_head_dim`` wide, v ``v_head_dim``), then
    ``linear_proj``. The frozen up and down projections keep nothing (their inputs are kept by the norms)."""
    m = block.dims
    heads = d.shard(block.heads)
    qh, vh, rope = m.q_head_dim, m.v_head_dim, m.qk_rope_head_dim
    normed = _norm(g, d, "self_attention", x)
    if block.q_down is not None:
        q_c = _gathered_down_projection(g, d, "q_down", normed, block.q_down)
        q_in = g.op("self_attention.q_layernorm", (d.seq, d.rows, m.q_lora_rank), d.act, (q_c,), saves=(q_c,))
    else:
        q_in = normed
    kv_c = _gathered_down_projection(g, d, "kv_down", normed, block.kv_down)
    latent = g.view("self_attention.kv_compressed", kv_c, (d.seq, d.rows, m.kv_lora_rank))
    k_rope_in = g.view("self_attention.k_pos_emb", kv_c, (d.seq, d.rows, rope))
    kv_in = g.op("self_attention.kv_layernorm", (d.seq, d.rows, m.kv_lora_rank), d.act, (latent,), saves=(latent,))
    q = column_linear(g, d, "self_attention", q_in, block.q_up)
    kv = column_linear(g, d, "self_attention", kv_in, block.kv_up)
    q_rope_in = g.view("self_attention.q_pos_emb", q, (d.seq, d.rows, heads * rope))
    q_nope = g.view("self_attention.q_no_pe", q, (d.seq, d.rows, heads * m.qk_nope_head_dim))
    k_nope = g.view("self_attention.k_no_pe", kv, (d.seq, d.rows, heads * m.qk_nope_head_dim))
    value_view = g.view("self_attention.value_view", kv, (d.seq, d.rows, heads * vh))
    table = (d.seq, 1, 1, rope)
    rotated = []
    for which, source, width in (("q", q_rope_in, heads * rope), ("k", k_rope_in, rope)):
        cos = g.op(f"self_attention.rotary_{which}_cos", table, "fp32")
        sin = g.op(f"self_attention.rotary_{which}_sin", table, "fp32")
        inputs = (source, cos, sin)
        rotated.append(g.op(f"self_attention.rotary_{which}", (d.seq, d.rows, width), d.act, inputs, saves=inputs))
    ctx_shape = (d.seq, d.rows, heads * vh)
    qk_shape = (d.seq, d.rows, heads * qh)
    query = g.op("self_attention.query", qk_shape, d.act, (q_nope, rotated[0]), grad_slices=True)
    key = g.op("self_attention.key", qk_shape, d.act, (k_nope, rotated[1]), grad_slices=True)
    value = g.op("self_attention.value", ctx_shape, d.act, (value_view,), grad_passthrough=True)
    if d.attention == "unfused":
        held = (normed, query, key, value)
        ctx = _unfused_core_attention(g, d, query, key, value, (d.rows * heads, d.seq, d.seq), ctx_shape, held)
    elif d.layer_spec == "local":
        ctx = sdpa_flash_attention(g, d, query, key, value, heads, heads, qh, vh)
    else:
        ctx = g.op(
            "self_attention.core_attention.flash", ctx_shape, d.act, (query, key, value), saves=(query, key, value),
            save_output=True, core_attn=True,
        )
    proj = row_linear(g, d, "self_attention", ctx, block.proj)
    return g.op("self_attention.residual_add", (d.sp_seq, d.rows, d.hidden), d.act, (proj, x))


def gated_deltanet_block(g: Graph, d: Dims, block: GatedDeltaNet, x: str) -> str:
    """Gated-DeltaNet linear attention as megatron-core's ``GatedDeltaNet.forward`` runs it
    (``megatron/core/ssm/gated_delta_net.py``), ``in_proj`` and ``out_proj`` LoRA-wrapped when targeted; returns the
    post-attention residual.

    * ``in_proj`` makes q, k, v, the gate z, beta and the decay's a in one ``[s, b, in/tp]`` output; the split is views.
    * The short convolution over q, k, v: the ``[b, channels, s]`` contiguous input is kept by the kernel. On CUDA
      ``causal_conv1d_fn`` (causal-conv1d) keeps only that input and writes ``silu(conv)``; on the CPU ``nn.Conv1d``
      with ``kernel - 1`` padding writes ``[b, channels, s + kernel - 1]``, which the silu of its causal slice keeps.
    * q and k are made contiguous and l2-normalised by FLA's ``l2norm`` (``L2NormFunction``: keeps its output and an
      fp32 reciprocal norm per head), then repeated to the value heads when there are more (``repeat_interleave``);
      v, z, beta and a are made contiguous; the decay ``-exp(A_log) * softplus(a + dt_bias)`` is fp32 (softplus keeps
      its input); beta's sigmoid keeps its output.
    * ``chunk_gated_delta_rule`` (FLA's ``ChunkGatedDeltaRuleFunction``, ``fla/ops/gated_delta_rule/chunk.py``;
      ``description.layer_ops.GatedDeltaNet.kernel_tensors`` lists its tensors): keeps q, k, v, beta, the fp32
      chunk-local cumulative gates and the solved intra-chunk ``A``; ``w``, ``u``, the per-chunk states ``h`` and
      ``v_new`` live while it runs; its backward recomputes them and adds the state gradients and the WY backward's.
    * The gated output norm (``_apply_gated_norm``, ``torch.compile``d) keeps its two inputs; its output is
      transposed back to ``[s, b, v]`` (a copy) for ``out_proj``.
    """
    la = block.dims
    hk, hv = d.shard(la.num_key_heads), d.shard(la.num_value_heads)
    dk, dv = la.key_head_dim, la.value_head_dim
    qk_w, v_w = hk * dk, hv * dv
    conv_w = 2 * qk_w + v_w
    tokens = (d.rows, d.seq, hv)
    proj = column_linear(g, d, "self_attention", _norm(g, d, "self_attention", x), block.in_proj)
    mixed = g.view("self_attention.qkv_mixed", proj, (d.rows, d.seq, conv_w))
    z = g.view("self_attention.z", proj, (d.rows, d.seq, hv, dv))
    beta_in = g.view("self_attention.b", proj, tokens)
    alpha = g.view("self_attention.a", proj, tokens)
    conv_in = g.op("self_attention.conv1d_input", (d.rows, conv_w, d.seq), d.act, (mixed,), grad_passthrough=True)
    if d.cuda:
        act = g.op("self_attention.conv1d", (d.rows, conv_w, d.seq), d.act, (conv_in,), saves=(conv_in,))
    else:
        padded = (d.rows, conv_w, d.seq + la.conv_kernel - 1)
        conv = g.op("self_attention.conv1d", padded, d.act, (conv_in,), saves=(conv_in,))
        act = g.op("self_attention.conv_silu", (d.rows, conv_w, d.seq), d.act, (conv,), saves=(conv,))
    heads: dict[str, str] = {}
    for which in ("q", "k"):
        view = g.view(f"self_attention.conv_{which}", act, (d.rows, d.seq, hk, dk))
        dense = g.op(f"self_attention.{which}_contiguous", (d.rows, d.seq, hk, dk), d.act, (view,), grad_passthrough=True)
        rstd = g.op(f"self_attention.{which}_l2norm_rstd", (d.rows, d.seq, hk), "fp32", (dense,), detached=True)
        normed = g.op(
            f"self_attention.{which}_l2norm", (d.rows, d.seq, hk, dk), d.act, (dense, rstd), saves=(rstd,), save_output=True
        )
        if hv > hk:
            normed = g.op(f"self_attention.repeat_{which}", (d.rows, d.seq, hv, dk), d.act, (normed,))
        heads[which] = normed
    v_view = g.view("self_attention.conv_v", act, (d.rows, d.seq, hv, dv))
    v = g.op("self_attention.v_contiguous", (d.rows, d.seq, hv, dv), d.act, (v_view,), grad_passthrough=True)
    gate = g.op("self_attention.z_contiguous", (d.rows, d.seq, hv, dv), d.act, (z,), grad_passthrough=True)
    beta_c = g.op("self_attention.b_contiguous", tokens, d.act, (beta_in,), grad_passthrough=True)
    alpha_c = g.op("self_attention.a_contiguous", tokens, d.act, (alpha,), grad_passthrough=True)
    if d.act != "fp32":
        alpha_c = g.op("self_attention.a_fp32", tokens, "fp32", (alpha_c,))
    shifted = g.op("self_attention.a_dt_bias", tokens, "fp32", (alpha_c,))
    softplus = g.op("self_attention.softplus", tokens, "fp32", (shifted,), saves=(shifted,))
    decay = g.op("self_attention.decay", tokens, "fp32", (softplus,))
    beta = g.op("self_attention.beta_sigmoid", tokens, d.act, (beta_c,), save_output=True)
    kernel = block.kernel_tensors(d.rows, d.seq, d.tp, d.act)
    made = [g.op(f"self_attention.{name}", shape, dtype, (decay,), detached=True) for name, shape, dtype in kernel.kept]
    core = g.op(
        "self_attention.chunk_gated_delta_rule",
        (d.rows, d.seq, hv, dv),
        d.act,
        (heads["q"], heads["k"], v, decay, beta),
        saves=(heads["q"], heads["k"], v, beta, *made),
        temps=kernel.forward,
        backward_extra=kernel.backward,
        core_attn=True,
    )
    norm_temps: tuple[Workspace, ...] = ()
    norm_extra: tuple[Workspace, ...] = ()
    if not d.cuda:  # the CPU kernel (megatron_vllm.gated_delta_rule.GatedNorm): fp32 temporaries of x's shape
        norm_temps = tuple((f"norm_tmp{i}", (d.rows, d.seq, hv, dv), "fp32") for i in range(2))
        norm_extra = tuple((f"norm_grad_tmp{i}", (d.rows, d.seq, hv, dv), "fp32") for i in range(3))
    normed = g.op(
        "self_attention.gated_norm",
        (d.rows, d.seq, hv, dv),
        d.act,
        (core, gate),
        saves=(core, gate),
        temps=norm_temps,
        backward_extra=norm_extra,
    )
    # GatedDeltaNet.forward's locals (qkvzba, qkv, query, key, value, gate, beta, alpha, g, core_attn_out) keep their
    # tensors until it returns: what a forward without grad cannot free earlier
    held = (proj, act, heads["q"], heads["k"], v, gate, beta, alpha_c, decay, core)
    back = g.op(
        "self_attention.gated_norm_transpose", (d.seq, d.rows, v_w), d.act, (normed,), grad_passthrough=True, holds=held
    )
    out = row_linear(g, d, "self_attention", back, block.out_proj)
    return g.op("self_attention.residual_add", (d.sp_seq, d.rows, d.hidden), d.act, (out, x))


def _swiglu(g: Graph, d: Dims, prefix: str, fc1: str, shape: Shape) -> str:
    """SwiGLU over a fused gate+up output: fused keeps only its input; unfused keeps silu(x1) and both halves."""
    if d.fused_swiglu:
        return g.op(f"{prefix}.swiglu", shape, d.act, (fc1,), saves=(fc1,))
    x1 = g.view(f"{prefix}.fc1_gate", fc1, shape)
    x2 = g.view(f"{prefix}.fc1_up", fc1, shape)
    silu = g.op(f"{prefix}.silu", shape, d.act, (x1,), saves=(x1,))
    # megatron-core's glu adds ``glu_linear_offset`` (0.0) to the linear half: a new tensor, kept by the product
    x2 = g.op(f"{prefix}.fc1_up_offset", shape, d.act, (x2,))
    # glu's two halves are views of fc1's output (``torch.chunk``), referenced until the product is made
    return g.op(f"{prefix}.swiglu_mul", shape, d.act, (silu, x2), saves=(silu, x2), holds=(fc1,))


def mlp_block(g: Graph, d: Dims, mlp: SwiGLU, x: str) -> str:
    """Dense SwiGLU MLP; returns the post-MLP residual."""
    normed = _norm(g, d, "mlp", x)
    fc1 = column_linear(g, d, "mlp", normed, mlp.fc1)
    act = _swiglu(g, d, "mlp", fc1, (d.seq, d.rows, d.shard(mlp.ffn)))
    out = row_linear(g, d, "mlp", act, mlp.fc2)
    # TransformerLayer._forward_mlp keeps the norm's output (``pre_mlp_layernorm_output``) until the residual add
    residual = (d.sp_seq, d.rows, d.hidden)
    return g.op("mlp.residual_add", residual, d.act, (out, x), category="saved_activations", holds=(normed,))


def _moe_router(g: Graph, d: Dims, m: MoeLayerDims, local: str) -> tuple[str, str]:
    """megatron-core's ``TopKRouter`` (fp32 gating, softmax over the top-k logits) on the router's tokens; returns the
    ``[tokens, experts]`` routing probabilities and routing map.

    The gating function saves its input and, in backward, computes the weight's gradient as well (then dropped for a
    frozen router); a 16-bit input and router weight are copied to fp32 around the GEMM. ``torch.topk`` makes values
    and int64 ids; with replayed routes the router gathers the held ids' scores instead (no ids are made, and the
    held replay tensor is what the backward's gathers read). The probabilities are scattered into a zeroed
    ``[tokens, experts]`` tensor and the map is a zeroed int32 tensor scattered and cast to bool."""
    t, e, k, h = m.tokens, m.experts, m.top_k, m.hidden
    upcast = d.act != "fp32"
    temps = (("input_fp32", (t, h), "fp32"), ("weight_fp32", (e, h), "fp32")) if upcast else ()
    extra = (("weight_fp32", (e, h), "fp32"), ("grad_input_fp32", (t, h), "fp32")) if upcast else ()
    extra += (("grad_weight", (e, h), "fp32"),)
    logits = g.op("mlp.router.logits", (t, e), "fp32", (local,), saves=(local,), temps=temps, backward_extra=extra)
    if m.replay:
        ids: tuple[str, ...] = ()
        values = g.op("mlp.router.replay_gather", (t, k), "fp32", (logits,))
    else:
        ids = (g.op("mlp.router.topk_indices", (t, k), "int64"),)
        values = g.op("mlp.router.topk_values", (t, k), "fp32", (logits,), saves=ids)
    probs = g.op("mlp.router.probs", (t, k), "fp32", (values,), save_output=True)
    routing_probs = g.op(
        "mlp.router.routing_probs", (t, e), "fp32", (probs, *ids), saves=ids, temps=(("zeros", (t, e), "fp32"),)
    )
    as_int = g.op("mlp.router.routing_map_int32", (t, e), "int32", ids, temps=(("zeros", (t, e), "int32"),))
    routing_map = g.op("mlp.router.routing_map", (t, e), "bool", (as_int,))
    return routing_probs, routing_map


def _moe_dispatch(
    g: Graph, d: Dims, m: MoeLayerDims, local: str, routing_probs: str, routing_map: str
) -> tuple[str, str, str, str, str]:
    """The all-gather dispatcher's dispatch: (over TP x EP) the routing map and probabilities gathered, the tokens
    gathered into megatron's global buffer (no tensor of the graph), the
    tokens per local expert, the permutation (``moe_utils.permute``: token ids masked by the transposed map, tokens
    gathered by them) and the permuted probabilities (masked from the transposed probabilities, which are kept).
    Returns the permuted tokens and probabilities, the permutation indices, the tokens per expert and the map."""
    n, el, h = m.gathered, m.local_experts, m.hidden
    hidden, probs, mapping = local, routing_probs, routing_map
    if m.gathered != m.tokens:
        mapping = g.op("mlp.dispatch.gather_routing_map", (n, m.experts), "bool", (routing_map,))
        probs = g.op("mlp.dispatch.gather_probs", (n, m.experts), "fp32", (routing_probs,))
        # the gathered tokens live in megatron's global buffer (``scores_buffer``, held across calls), so they cost
        # the graph nothing: a view; their gradient is reduce-scattered back to the shard's
        hidden = g.view("mlp.dispatch.gather_tokens", local, (n, h))
    counts = g.op("mlp.dispatch.tokens_per_expert", (el,), "int64", (mapping,))
    sort_temps = (("routing_map_t", (el, n), "bool"), ("token_ids", (n,), "int64"))
    order = g.op("mlp.dispatch.sorted_indices", (m.pairs,), "int64", (mapping,), temps=sort_temps)
    permuted = g.op("mlp.dispatch.permute", (m.pairs, 1, h), d.act, (hidden, order), saves=(order,))
    probs_t = g.op("mlp.dispatch.probs_t", (el, n), "fp32", (probs,), grad_passthrough=True)
    map_t = g.op("mlp.dispatch.map_t", (el, n), "bool", (mapping,))
    permuted_probs = g.op("mlp.dispatch.permuted_probs", (m.pairs,), "fp32", (probs_t, map_t), saves=(probs_t, map_t))
    return permuted, permuted_probs, order, counts, mapping


def _expert(g: Graph, d: Dims, moe: MoE, m: MoeLayerDims, prefix: str, x: str, p: str, n: int) -> str:
    """One expert MLP (or the grouped GEMM's experts together) over ``n`` token copies: fc1, SwiGLU, the routing
    probabilities scaling the activation (megatron's ``per_token_scale``; a 16-bit activation times the fp32
    probabilities is an fp32 product cast back), fc2."""
    ed = replace(d, rows=1, seq=n, sp=False, logits_width=0)
    fc1 = column_linear(g, ed, prefix, x, moe.experts.fc1)
    shape = (n, 1, m.expert_ffn)
    if d.fused_swiglu:  # megatron's weighted_bias_swiglu: one kernel keeps its input and the probabilities
        scaled = g.op(f"{prefix}.weighted_swiglu", shape, d.act, (fc1, p), saves=(fc1, p))
    else:
        act = _swiglu(g, ed, prefix, fc1, shape)
        upcast = d.act != "fp32"
        temps = (("product_fp32", shape, "fp32"),) if upcast else ()
        extra = (("grad_fp32", shape, "fp32"), ("grad_input_fp32", shape, "fp32")) if upcast else ()
        extra += (("grad_probs_full", shape, "fp32"),)
        scaled = g.op(f"{prefix}.probs_scale", shape, d.act, (act, p), saves=(act, p), temps=temps, backward_extra=extra)
    return row_linear(g, ed, prefix, scaled, moe.experts.fc2)


def _shared_expert_gate(g: Graph, d: Dims, local: str, shared: str) -> str:
    """Qwen's gate on the shared expert, as megatron-core 0.16.1's ``SharedExpertMLP.forward`` runs it with
    ``moe_shared_expert_gate`` (``megatron/core/transformer/moe/shared_experts.py``): ``logits =
    F.linear(hidden_states, gate_weight)`` over the MoE layer's input (the sequence-parallel shard the router reads;
    ``gate_weight`` ``[1, hidden]`` replicated over TP), ``gate_score = sigmoid(logits)``, ``output = output *
    gate_score``; returns the gated output.

    What autograd keeps (``tools/autograd/derivatives.yaml``): the linear keeps its input only for a trained weight
    (``weight_grad``: the ``[1, hidden]`` gradient), and the input is the norm's output the router keeps anyway; the
    logits are freed once the sigmoid has run, which keeps its own output (``sigmoid_backward`` reads the result); the
    product keeps both factors, the score and the shared expert's ungated output (``[s, b, hidden]``, kept only
    because of the gate: without it the output is only added). Its backward makes the output's gradient
    ``grad * score`` and the score's, ``grad * output`` at full width then summed to ``[s, b, 1]`` (the broadcast's
    ``sum_to``)."""
    tokens, full = (d.sp_seq, d.rows, 1), (d.sp_seq, d.rows, d.hidden)
    saves = (local,) if d.train_base else ()
    logits = g.op(
        "mlp.shared_experts.gate_logits", tokens, d.act, (local,), saves=saves, backward_extra=weight_grad(d, (1, d.hidden))
    )
    score = g.op("mlp.shared_experts.gate_score", tokens, d.act, (logits,), save_output=True)
    extra = (("grad_score_full", full, d.act),)
    return g.op("mlp.shared_experts.gated", full, d.act, (shared, score), saves=(shared, score), backward_extra=extra)


def moe_mlp_block(g: Graph, d: Dims, moe: MoE, x: str, m: MoeLayerDims) -> str:
    """An MoE layer's MLP as megatron-core 0.16.1 runs it (all-gather dispatcher, expert tensor parallel = TP); returns
    the post-MLP residual. Sizes from ``moe_routes.moe_layer_dims``; linears and LoRA targets from ``moe``.

    The shared expert runs first, over the (gathered) normed tokens; then the router (``_moe_router``), the dispatch
    (``_moe_dispatch``), the experts: megatron-core's local spec runs them one after another (``SequentialMLP``: each
    expert's tokens a view of the permuted tokens, each output kept until the outputs are concatenated, whose
    gradient each expert reads a slice of), TransformerEngine's grouped GEMM all at once; the unpermutation
    (a zeroed tensor the outputs are scatter-added into, the permutation indices kept), the reduce-scatter back to
    the sequence shard under TP x EP, the shared expert's output (gated by ``_shared_expert_gate`` where the model
    has Qwen's gate) added, the residual.
    """
    gathered = _norm(g, d, "mlp", x)
    local = "mlp.norm"  # the router and the dispatcher read the sequence-parallel shard
    shared = None
    if moe.shared is not None:
        sfc1 = column_linear(g, d, "mlp.shared_experts", gathered, moe.shared.fc1)
        sact = _swiglu(g, d, "mlp.shared_experts", sfc1, (d.seq, d.rows, d.shard(moe.shared.ffn)))
        shared = row_linear(g, d, "mlp.shared_experts", sact, moe.shared.fc2)
        if moe.shared_gate:
            shared = _shared_expert_gate(g, d, local, shared)
    routing_probs, routing_map = _moe_router(g, d, m, local)
    permuted, permuted_probs, order, counts, _ = _moe_dispatch(g, d, m, local, routing_probs, routing_map)
    outputs = []
    for e, n in enumerate(m.expert_tokens):
        if m.grouped:
            outputs.append(_expert(g, d, moe, m, "mlp.experts", permuted, permuted_probs, n))
            continue
        prefix = f"mlp.experts.local_experts.{e}"
        x_e = g.view(f"{prefix}.tokens", permuted, (n, 1, m.hidden))
        p_e = g.view(f"{prefix}.probs", permuted_probs, (n,))
        outputs.append(_expert(g, d, moe, m, prefix, x_e, p_e, n))
    joined = outputs[0]
    if not m.grouped:
        joined = g.op("mlp.experts.cat", (m.pairs, 1, m.hidden), d.act, tuple(outputs), grad_slices=True)
    out = g.op(
        "mlp.dispatch.unpermute", (m.gathered, m.hidden), d.act, (joined, order), saves=(order,),
        holds=(counts, routing_probs),
    )
    if m.gathered != m.tokens:
        out = g.op("mlp.dispatch.reduce_scatter", (m.tokens, m.hidden), d.act, (out,))
    out = g.view("mlp.dispatch.output", out, (d.sp_seq, d.rows, d.hidden))
    if shared is not None:
        out = g.op("mlp.shared_experts.add", (d.sp_seq, d.rows, d.hidden), d.act, (out, shared))
    return g.op("mlp.residual_add", (d.sp_seq, d.rows, d.hidden), d.act, (out, x), category="saved_activations")


def layer_graph(d: Dims, model: ModelArch, kind: str, moe: bool, moe_dims: MoeLayerDims | None = None) -> Graph:
    """One decoder layer: input ``in`` (the saved layer input), output ``mlp.residual_add`` (the next layer's input).

    An MoE layer needs ``moe_dims``: ``moe_routes.moe_layer_dims`` for this micro-batch's ``rows x seq`` tokens.
    """
    layer = layer_kind(model, kind, moe)
    g = Graph(allocator=d.allocator)
    x = g.external("in", (d.sp_seq, d.rows, d.hidden), d.act, "saved_activations")
    if isinstance(layer.attention, GatedDeltaNet):
        hidden = gated_deltanet_block(g, d, layer.attention, x)
    elif isinstance(layer.attention, LatentAttention):
        hidden = latent_attention_block(g, d, layer.attention, x)
    else:
        hidden = attention_block(g, d, layer.attention, x)
    if isinstance(layer.mlp, MoE):
        if moe_dims is None:
            raise ValueError("an MoE layer's graph needs moe_dims (moe_routes.moe_layer_dims)")
        moe_mlp_block(g, d, layer.mlp, hidden, moe_dims)
    else:
        mlp_block(g, d, layer.mlp, hidden)
    return g


def embedding_graph(d: Dims) -> Graph:
    """Vocab-parallel lookup, the transpose to ``[s, b, h]``, the VL model's clone, and the sequence-parallel scatter."""
    g = Graph(allocator=d.allocator)
    x = g.op("embedding.lookup", (d.rows, d.seq, d.hidden), d.act)
    x = g.op("embedding.transpose", d.full, d.act, (x,))
    if d.vl_clone:
        x = g.op("embedding.vl_clone", d.full, d.act, (x,))
    out = (d.sp_seq, d.rows, d.hidden)
    if d.sp:
        x = g.op("embedding.scatter_to_sequence_parallel", out, d.act, (x,))
    g.op("embedding.output", out, d.act, (x,), category="saved_activations")
    return g


def _row_copies_backward(
    d: Dims, full: Shape, vocab: int, logits_grad: Shape, out_dtype: str
) -> tuple[tuple[Workspace, ...], tuple[tuple[str, int], ...]]:
    """The backward of the rows' re-expansion (``full[r, W - n:] = logits[r, :n].to(out)``, one ``copy_`` per row,
    ``megatron_vllm.trainer._logprobs``): autograd's chain of nodes, the last row's first, as workspaces and their order
    (``Graph.op``'s ``backward_order``). Row ``r`` has ``n = d.seq - d.short_rows[r]`` tokens (every row ``d.seq`` when
    ``short_rows`` is empty). Per row, from torch's autograd (``torch/csrc/autograd/functions/tensor.cpp``,
    ``CopySlices::apply``; ``CopyBackwards``; ``slice_backward``, ``select_backward``):

    * ``CopySlices`` copies the whole arriving ``[b, W, V]`` gradient (``new_empty_strided`` + ``copy_``) and clones
      the row's slice of it for the copy's backward (the source's gradient, ``[n, V]``); ``CopyBackwards`` makes a
      zeroed gradient for the destination (``zeros_like``, ``[n, V]``), written into the copy and freed, except for
      the row processed last, whose destination is the ``new_zeros`` tensor (no gradient). The previous ``[b, W, V]``
      gradient (the cross-entropy's, for the first row processed) is freed once the copy replaces it; the last
      row's copy is freed at once (nothing reads it).
    * The clone reaches the logits through the dtype cast's backward (bf16 logits: a cast copy ``[n, V]``), the
      slice's (``slice_backward``: a zeroed ``[s, V]``; none for a row of ``s`` tokens, whose ``[:n]`` is the whole
      dimension and no view: torch's indexing skips a full slice) and the row select's (``select_backward``: a zeroed
      ``[b, s, V]``), each freeing the one before it; the select's gradient is added into the sum of the rows before it
      (out of place, from the second row processed on), and the final sum is the logits' gradient.

    The order matters to the peak: the first row processed (the micro-batch's last) meets no sum yet, and the last
    processed (its first) no zeroed destination; ``tests/test_walk_row_copies.py`` holds the steps to autograd's.
    """
    workspaces: list[Workspace] = []
    order: list[tuple[str, int]] = []

    def alloc(name: str, shape: Shape, dtype: str) -> int:
        workspaces.append((name, shape, dtype))
        order.append(("alloc", len(workspaces) - 1))
        return len(workspaces) - 1

    def free(index: int) -> None:
        order.append(("free", index))

    short = d.short_rows or (0,) * d.rows
    previous_copy, total = -1, -1
    for k in range(d.rows):  # k: the k-th row processed (the micro-batch's last row first)
        last = k == d.rows - 1
        missing = short[d.rows - 1 - k]
        row = (d.seq - missing, vocab) if missing else (d.seq, vocab)
        copy = alloc(f"row{k}.copy_slices_grad", full, out_dtype)
        grad = alloc(f"row{k}.grad_clone", row, out_dtype)
        if not last:
            free(alloc(f"row{k}.destination_grad", row, out_dtype))
        if k == 0:
            order.append(("release", 0))  # the cross-entropy's [b, W, V] gradient
        else:
            free(previous_copy)
        if last:
            free(copy)
        previous_copy = copy
        if out_dtype != d.act:  # ToCopyBackward0: the row's gradient cast back to the logits' dtype
            cast = alloc(f"row{k}.grad_cast", row, d.act)
            free(grad)
            grad = cast
        if missing:  # SliceBackward0: the row's tokens placed in a zeroed [s, V]
            sliced = alloc(f"row{k}.slice_grad", (d.seq, vocab), d.act)
            free(grad)
            grad = sliced
        if d.rows == 1:
            order.append(("grad", 0))  # the only row's select backward is the logits' gradient
            free(grad)
            continue
        if k == 0:
            total = alloc(f"row{k}.select_grad", logits_grad, d.act)
            free(grad)
            continue
        selected = alloc(f"row{k}.select_grad", logits_grad, d.act)
        free(grad)
        if last:
            order.append(("grad", 0))  # the sum of every row's: the logits' gradient
        else:
            new_total = alloc(f"row{k}.grad_sum", logits_grad, d.act)
        free(total)
        free(selected)
        if not last:
            total = new_total
    return tuple(workspaces), tuple(order)


def _cross_entropy_head(g: Graph, d: Dims, logits: str, vocab: int) -> tuple[str, str, str]:
    """The real backend's log-probs (``logprob_kernel: vocab_parallel_cross_entropy``), as autograd runs them.

    GPTModel returns the logits transposed to ``[b, s, V]`` (a contiguous copy, held until the loss returns). They
    are re-expanded to the call's global width into a zeroed ``[b, W, V]`` tensor in the output dtype, one row at a
    time (a row's cast ``[s, V]`` when the dtypes differ). Each chunk of ``logprobs_chunk_size`` positions is cloned
    and handed to megatron-core's ``vocab_parallel_cross_entropy``, which turns the clone into the softmax in place
    and saves it; its backward writes the gradient into that same tensor. Backward: with more than one chunk each
    chunk's slice backward makes a zeroed ``[b, W, V]`` gradient, the first becoming the accumulated gradient and the
    others added into it; then the row copies' backward runs row after row in autograd's order
    (``_row_copies_backward``): each row's CopySlices copy of the whole ``[b, W, V]`` gradient, the row's clone and its
    zeroed destination (the row's own tokens: ``d.short_rows``), the slice and select backwards, and the sum into the
    logits' gradient, each freed where autograd frees it. ``scripts/trace_call_memory.py`` shows the same allocations
    in the real run.

    Returns the log-probs, the re-expanded logits and the transposed logits (an RL loss reads the re-expanded ones).
    """
    out_dtype = "fp32" if d.fp32_output else d.act
    width = d.logits_width or d.seq
    full = (d.rows, width, vocab)
    longest = min(d.short_rows, default=0)  # the forward casts one row at a time: the longest row's cast is the largest
    row = (d.seq - longest, vocab) if longest else (d.seq, vocab)
    transposed = g.op("output_layer.transpose", (d.rows, d.seq, vocab), d.act, (logits,), grad_passthrough=True)
    cast = (("row_cast", row, out_dtype),) if out_dtype != d.act else ()
    row_grads, order = _row_copies_backward(d, full, vocab, (d.rows, d.seq, vocab), out_dtype)
    recovered = g.op(
        "recover_left_padding",
        full,
        out_dtype,
        (transposed,),
        temps=cast,
        backward_extra=row_grads,
        backward_order=order,
    )
    chunks = [(start, min(d.chunk, width - start)) for start in range(0, width, d.chunk)]
    pieces = []
    for index, (_, size) in enumerate(chunks):
        last = index == len(chunks) - 1  # processed first in backward: its zeroed gradient becomes the accumulator
        slice_grad = () if last else (("slice_backward", full, out_dtype),)
        pieces.append(
            g.op(
                f"chunk_{index}.vocab_parallel_cross_entropy",
                (d.rows, size, vocab),
                "fp32",
                (recovered,),
                save_output=True,
                grad_in_output=True,
                grad_passthrough=len(chunks) == 1,
                backward_extra=slice_grad,
            )
        )
    return g.op("logprobs", (d.rows, width), "fp32", tuple(pieces), holds=(transposed,)), recovered, transposed


def fused_lm_head_workspaces(
    d: Dims, vocab: int, width: int, hidden_dtype: str
) -> tuple[tuple[Workspace, ...], tuple[Workspace, ...]]:
    """What the fused LM-head log-prob (the real backend's ``fused_lm_head.FusedLinearLogprob``, SkyRL's
    ``FusedLinearChunkedDistributedLogprob`` algorithm) holds beside its saved hidden states ``[b, W, h]``
    (``hidden_dtype``) and the gradient it hands back (the same shape): the forward's and the backward's workspaces.

    Per chunk of ``c`` positions: F = ``[b, c, V/tp]`` fp32, A = the same in the activation dtype (a tensor of its own
    only when that is not fp32), Hr = the chunk's hidden states flattened to ``[b * c, h]`` (a copy when b > 1), Hc =
    their cast to the weight's dtype (when the hidden states are not in it), and ``[V/tp, h]`` products.

    * Forward: the chunk's logits, their max-shifted copy and its exponentials (3 F); the projection in the
      activation dtype and its fp32 cast never coexist with more (A <= F).
    * Backward: the fp32 weight gradient ``[V/tp, h]`` throughout, plus the largest of three moments of a chunk: its
      log-softmax (3 F); the weight gradient's product (logits F, softmax F, the cast gradient A, Hr, Hc, the
      ``[V/tp, h]`` product in the activation dtype and its fp32 cast); the hidden gradient's product (2 F, A,
      ``[b, c, h]``). Each chunk's tensors are released before the next chunk starts.
    """
    chunk = min(d.chunk, width)
    logits = (d.rows, chunk, vocab)
    f32 = tuple((name, logits, "fp32") for name in ("chunk_logits", "chunk_shifted", "chunk_exp"))
    kept = f32[:1] + (("chunk_softmax", logits, "fp32"),)
    if d.act != "fp32":
        kept += (("chunk_grad_cast", logits, d.act),)
    weight_grad = kept + (("weight_product", (vocab, d.hidden), d.act),)
    if d.rows > 1:
        weight_grad += (("chunk_hidden_flat", (d.rows * chunk, d.hidden), hidden_dtype),)
    if hidden_dtype != d.act:
        weight_grad += (("chunk_hidden_cast", (d.rows * chunk, d.hidden), d.act),)
    if d.act != "fp32":
        weight_grad += (("weight_product_fp32", (vocab, d.hidden), "fp32"),)
    hidden_grad = kept + (("hidden_product", (d.rows, chunk, d.hidden), d.act),)
    moments = (f32, weight_grad, hidden_grad)
    largest = max(moments, key=lambda ws: sum(nbytes(shape, dtype) for _, shape, dtype in ws))
    return f32, (("grad_weight", (vocab, d.hidden), "fp32"),) + largest


def head_graph(d: Dims, model: ModelArch) -> Graph:
    """Final norm, output layer (or the fused LM-head log-prob), fp32 upcast, re-expansion, chunked log-prob."""
    g = Graph(category="logits", allocator=d.allocator)
    x = g.external("in", (d.sp_seq, d.rows, d.hidden), d.act, "saved_activations")
    x = rms_norm(g, d, "final_layernorm", x)
    if d.sp:
        x = g.op("output_layer.all_gather", d.full, d.act, (x,))
    vocab = d.shard(lm_head(model).output.n_out)
    out_dtype = "fp32" if d.fp32_output else d.act
    width = d.logits_width or d.seq
    if d.fused_lm_head:
        x = g.op("output_layer.transpose", (d.rows, d.seq, d.hidden), d.act, (x,))
        if d.fp32_output:
            x = g.op("float16module.fp32_output", (d.rows, d.seq, d.hidden), out_dtype, (x,))
        if d.logits_width:
            row = ("row_copy", (d.seq, d.hidden), out_dtype)
            x = g.op("recover_left_padding", (d.rows, width, d.hidden), out_dtype, (x,), temps=(row,))
        if d.fused_backend == "triton":
            logprobs = triton_fused_logprob(g, d, x, width, vocab, out_dtype)
        else:
            temps, extra = fused_lm_head_workspaces(d, vocab, width, out_dtype)
            logprobs = g.op(
                "fused_lm_head_logprob", (d.rows, width), "fp32", (x,), saves=(x,), temps=temps, backward_extra=extra
            )
        if d.entropy:
            entropy(g, d, x, width, vocab, out_dtype, fused=True)
            rl_loss(g, d, logprobs, width, x)
        return g
    saves = (x,) if d.train_base else ()
    grad = weight_grad(d, (vocab, d.hidden))
    x = g.op("output_layer.logits", (d.seq, d.rows, vocab), d.act, (x,), saves=saves, backward_extra=grad)
    if d.logprob_kernel == "vocab_parallel_cross_entropy":
        logprobs, recovered, transposed = _cross_entropy_head(g, d, x, vocab)
        if d.entropy:  # the real backend's RL path (``megatron_vllm.rl_loss``), as SkyRL's
            entropy(g, d, recovered, width, vocab, out_dtype, fused=False)
            rl_loss(g, d, logprobs, width, recovered, transposed)
        return g
    x = g.op("output_layer.transpose", (d.rows, d.seq, vocab), d.act, (x,))
    if d.fp32_output:
        x = g.op("float16module.fp32_output", (d.rows, d.seq, vocab), out_dtype, (x,))
    if d.logits_width:
        row = ("row_copy", (d.seq, vocab), out_dtype)
        x = g.op("recover_left_padding", (d.rows, width, vocab), out_dtype, (x,), temps=(row,))
    if not d.entropy:
        logprob(g, d, x, width, vocab, out_dtype, holds=())
        return g
    logprobs = logprob(g, d, x, width, vocab, out_dtype, holds=(x,))
    entropy(g, d, x, width, vocab, out_dtype, fused=False)
    rl_loss(g, d, logprobs, width, x)
    return g

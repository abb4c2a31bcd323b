"""Per-op tensor sizes of one micro-batch on one rank of SkyRL's FSDP trainer: the Hugging Face model's graphs.

SkyRL's FSDP worker runs transformers' decoder (``LlamaForCausalLM``; Qwen3's differs by its q/k norms) wrapped in
peft LoRA and torch FSDP2, and takes its log-probs outside the model (``workers/model_wrapper.py``:
``HFModelWrapper.forward``). Layout ``[b, s, n]``; every micro-batch has the call's global width (SkyRL pads every
row of a call to its longest and trims nothing, ``skyrl_train_backend.py``), so rows shorter than it are left-padded
and the model gets an attention mask. What each graph makes, as autograd runs it:

* **inputs** (``hf_microbatch_inputs``): the worker's ``sequences``, ``attention_mask``, ``position_ids`` and the
  rolled targets ``[b, s]`` int64; transformers' ``create_causal_mask`` ``[b, 1, s, s]`` bool when a row is padded
  (none otherwise: SDPA's ``is_causal``); the rotary ``cos``/``sin`` ``[b, s, head_dim]`` the model computes once
  and hands every layer (``LlamaRotaryEmbedding``). All live until the micro-batch's backward ends.
* **embedding**: ``embed_tokens`` ``[b, s, h]`` (peft's ``enable_input_require_grads`` makes it require grad).
* **a decoder layer** (``hf_layer_graph``): ``LlamaRMSNorm`` (``pow`` and the normalised copy as temporaries; with
  trainable weights the normalised input is kept), each projection (``q/k/v/o_proj``, ``gate/up/down_proj``) a
  frozen ``mm`` plus, when peft wraps it, ``lora_A`` ``[b, s, r]`` (kept by ``lora_B``), ``lora_B``, its scaled copy
  and the sum (``peft/tuners/lora/layer.py``: ``Linear.forward``); the rotary product ``q * cos + rotate_half(q) *
  sin`` (``rotate_half``'s ``cat`` kept by its product); with a padding mask, K and V repeated to every query head
  (``repeat_kv``: SDPA's GQA is used only without a mask) and the mask turned into an additive float
  ``[b, 1, s, s]`` that SDPA keeps for backward (``convert_boolean_attn_mask``); SDPA's output and log-sum-exp; the
  two residual adds; SwiGLU (``silu`` keeps its input, the product both factors).
* **the head** (``hf_head_graph``): the final norm and ``lm_head`` ``[b, s, V]`` in the compute dtype, then the logits
  divided by the temperature in place (``div_``: its backward makes a new gradient), kept by the worker's ``output``
  until the micro-batch's backward ends.
* **the log-probs** (``hf_logprob_graph``): ``logprobs_from_logits``: on CUDA flash-attention's fused cross-entropy
  (in place: nothing logits-sized); on CPU ``logprobs_from_logits_v2``: fp32 logits take a ``gather`` and a
  ``logsumexp`` per row (its backward makes ``x - lse`` and its ``exp`` per row, the rows' gradients are stacked
  by the ``unbind`` backward, the ``gather`` backward makes a zeroed ``[b, s, V]`` and its ``scatter_add``); 16-bit
  logits a ``log_softmax`` per row, kept. The rows are views: the loop over ``logits`` is ``Tensor.__iter__``'s
  ``unbind(0)`` (``torch/_tensor.py``), which allocates nothing; only its backward (autograd's ``unbind_backward``,
  ``torch/csrc/autograd/FunctionsManual.h``) stacks the rows' gradients into a new ``[b, s, V]``. The entropy metric
  of a training call, under ``no_grad`` in chunks of
  ``logprobs_chunk_size`` positions (``chunked_entropy_from_logits``: ``log_softmax``, ``exp`` and their product per
  chunk). The loss over the action positions.

Every builder follows ``memory_ops``' lanes rule (decisions only on rows, settings and model widths).
"""

from __future__ import annotations

from skyrl_sim.api import ModelArch
from skyrl_sim_plugins.sim.reference.memory_graph import Graph, Shape, Workspace
from skyrl_sim_plugins.sim.reference.memory_ops import Dims


def hf_microbatch_inputs(d: Dims, model: ModelArch) -> tuple[Workspace, ...]:
    """Tensors a micro-batch makes before its embedding and holds until its backward ends (see the module doc)."""
    rows = (d.rows, d.seq)
    tensors: tuple[Workspace, ...] = tuple((name, rows, "int64") for name in ("sequences", "attention_mask"))
    tensors += (("position_ids", rows, "int64"), ("rolled_targets", rows, "int64"))
    if d.masked:
        tensors += (("causal_mask", (d.rows, 1, d.seq, d.seq), "bool"),)
    rotary = (d.rows, d.seq, model.head_dim)
    return tensors + (("rotary_cos", rotary, d.act), ("rotary_sin", rotary, d.act))


def hf_embedding_graph(d: Dims) -> Graph:
    """``embed_tokens``: the lookup ``[b, s, h]`` (the FSDP unit around it is the walk's own segment)."""
    g = Graph(allocator=d.allocator)
    g.op("embedding.output", (d.rows, d.seq, d.hidden), d.act, category="saved_activations")
    return g


def _rmsnorm(g: Graph, d: Dims, name: str, x: str) -> str:
    """``LlamaRMSNorm``: ``x.pow(2)`` and ``x * rsqrt(var + eps)`` are temporaries (the first freed by ``mean``, the
    second by the weight's product); autograd keeps the normalised input only when the weight trains."""
    shape = (d.rows, d.seq, d.hidden)
    temps: tuple[Workspace, ...] = ((f"{name}.pow", shape, d.act),)
    if not d.train_base:
        temps += ((f"{name}.normalized", shape, d.act),)
        return g.op(name, shape, d.act, (x,), saves=(x,), temps=temps)
    normalized = g.op(f"{name}.normalized", shape, d.act, (x,), saves=(x,), temps=temps)
    return g.op(name, shape, d.act, (normalized,), saves=(normalized,))


def _linear(
    g: Graph, d: Dims, name: str, x: str, n_out: int, lora: frozenset[str], holds: tuple[str, ...] = ()
) -> str:
    """A projection: the frozen (or, fully fine-tuned, trained) ``mm`` and peft's adapter around it. ``holds``: the
    caller's locals that live until this projection returns (the block's input and intermediates)."""
    shape = (d.rows, d.seq, n_out)
    saves = (x,) if d.train_base else ()
    if name.split(".")[-1] not in lora:
        return g.op(f"{name}.base", shape, d.act, (x,), saves=saves, holds=holds)
    base = g.op(f"{name}.base", shape, d.act, (x,), saves=saves)
    a = g.op(f"{name}.lora_A", (d.rows, d.seq, d.lora_rank), d.act, (x,), saves=(x,))
    b = g.op(f"{name}.lora_B", shape, d.act, (a,), saves=(a,))
    scaled = g.op(f"{name}.lora_scale", shape, d.act, (b,))
    # an add's backward hands both inputs the same gradient (AddBackward0): nothing is allocated
    return g.op(f"{name}.lora_add", shape, d.act, (base, scaled), holds=holds, grad_slices=True)


def _rotary(g: Graph, d: Dims, which: str, x: str, heads: int, head_dim: int, cos: str, sin: str) -> str:
    """``apply_rotary_pos_emb`` for q or k ``[b, heads, s, head_dim]``: ``x * cos`` (keeps ``cos``), ``rotate_half``
    (the negated half and the ``cat``, which its product with ``sin`` keeps) and the sum."""
    shape: Shape = (d.rows, heads, d.seq, head_dim)
    half = (d.rows, heads, d.seq, head_dim // 2)
    by_cos = g.op(f"self_attn.rotary_{which}.mul_cos", shape, d.act, (x, cos), saves=(cos,))
    rotated = g.op(f"self_attn.rotary_{which}.rotate_half", shape, d.act, (x,), temps=((f"{which}.neg", half, d.act),))
    by_sin = g.op(f"self_attn.rotary_{which}.mul_sin", shape, d.act, (rotated, sin), saves=(sin,))
    return g.op(f"self_attn.rotary_{which}", shape, d.act, (by_cos, by_sin))


def hf_layer_graph(d: Dims, model: ModelArch, lora: frozenset[str]) -> Graph:
    """One decoder layer (see the module doc): input ``in`` ``[b, s, h]``, output ``mlp.residual_add``."""
    heads, kv, hd, h = model.num_attention_heads, model.num_kv_heads, model.head_dim, d.hidden
    g = Graph(allocator=d.allocator)
    x = g.external("in", (d.rows, d.seq, h), d.act, "saved_activations")
    rotary = (d.rows, d.seq, hd)
    cos = g.external("rotary_cos", rotary, d.act, "transient", requires_grad=False)
    sin = g.external("rotary_sin", rotary, d.act, "transient", requires_grad=False)
    normed = _rmsnorm(g, d, "input_layernorm", x)
    q = _linear(g, d, "self_attn.q_proj", normed, heads * hd, lora)
    k = _linear(g, d, "self_attn.k_proj", normed, kv * hd, lora)
    v = _linear(g, d, "self_attn.v_proj", normed, kv * hd, lora)
    if model.extra.get("qk_layernorm", True):  # Qwen3: per-head RMSNorm of q and k before the rotary
        q = g.op("self_attn.q_norm", (d.rows, d.seq, heads * hd), d.act, (q,), saves=(q,))
        k = g.op("self_attn.k_norm", (d.rows, d.seq, kv * hd), d.act, (k,), saves=(k,))
    q = _rotary(g, d, "q", q, heads, hd, cos, sin)
    k = _rotary(g, d, "k", k, kv, hd, cos, sin)
    full = (d.rows, heads, d.seq, hd)
    inputs = [q, k, v]
    if d.masked:
        if kv < heads:  # repeat_kv: SDPA's own GQA only without a mask (transformers' use_gqa_in_sdpa)
            inputs[1] = g.op("self_attn.repeat_k", full, d.act, (k,))
            inputs[2] = g.op("self_attn.repeat_v", full, d.act, (v,))
        mask = g.op("self_attn.float_mask", (d.rows, 1, d.seq, d.seq), d.act, detached=True)
        inputs.append(mask)
    lse = g.op("self_attn.sdpa.logsumexp", (d.rows, heads, d.seq), "fp32", detached=True)
    attn = g.op(
        "self_attn.sdpa",
        full,
        d.act,
        tuple(inputs),
        saves=(*inputs, lse),
        save_output=True,
        core_attn=True,
    )
    # LlamaAttention.forward's locals (its input, the rotated q and k, v) live until it returns
    o = _linear(g, d, "self_attn.o_proj", attn, h, lora, holds=(normed, q, k, v))
    hidden = g.op("self_attn.residual_add", (d.rows, d.seq, h), d.act, (o, x), grad_slices=True)
    normed2 = _rmsnorm(g, d, "post_attention_layernorm", hidden)
    f = model.ffn_hidden_size
    # LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)), its input held until it returns
    gate = _linear(g, d, "mlp.gate_proj", normed2, f, lora)
    act = g.op("mlp.silu", (d.rows, d.seq, f), d.act, (gate,), saves=(gate,))
    up = _linear(g, d, "mlp.up_proj", normed2, f, lora)
    prod = g.op("mlp.act_mul", (d.rows, d.seq, f), d.act, (act, up), saves=(act, up))
    down = _linear(g, d, "mlp.down_proj", prod, h, lora, holds=(normed2,))
    g.op("mlp.residual_add", (d.rows, d.seq, h), d.act, (down, hidden), category="saved_activations", grad_slices=True)
    return g


def hf_head_graph(d: Dims, model: ModelArch, vocab: int) -> Graph:
    """The final norm and ``lm_head``: input ``in`` ``[b, s, h]``, output the logits ``[b, s, V]`` (their in-place
    division by the temperature costs nothing forward; its backward makes the logits' gradient anew)."""
    g = Graph(category="logits", allocator=d.allocator)
    x = g.external("in", (d.rows, d.seq, d.hidden), d.act, "saved_activations")
    x = _rmsnorm(g, d, "model.norm", x)
    logits = (d.rows, d.seq, vocab)
    saves = (x,) if d.train_base else ()
    g.op(
        "lm_head.logits",
        logits,
        d.act,
        (x,),
        saves=saves,
        backward_extra=(("div_backward", logits, d.act),),
        grad_after_workspaces=True,
    )
    return g


def hf_logprob_graph(d: Dims, vocab: int, entropy: bool) -> Graph:
    """SkyRL's log-probs of the logits (external ``in``, kept by the worker) and, for a training call, the entropy
    metric without grad; the loss over the action positions (see the module doc)."""
    g = Graph(category="logits", allocator=d.allocator)
    logits = g.external("in", (d.rows, d.seq, vocab), d.act, "logits")
    full = (d.rows, d.seq, vocab)
    row = (d.seq, vocab)
    if d.cuda:  # flash-attention's cross_entropy_loss, its backward in place (inplace_backward=True)
        logprobs = g.op("logprobs.flash_cross_entropy", (d.rows, d.seq), "fp32", (logits,), saves=(logits,))
    elif d.act == "fp32":
        labels = g.op(
            "logprobs.gather",
            (d.rows, d.seq),
            "fp32",
            (logits,),
            backward_extra=(("gather_backward_zeros", full, d.act), ("scatter_add", full, d.act)),
        )
        rows = g.op("logprobs.unbind", full, d.act, (logits,), grad_passthrough=True, aliases_input=True)
        sums = []
        for r in range(d.rows):
            view = g.view(f"logprobs.row_{r}", rows, row)
            sums.append(
                g.op(
                    f"logprobs.logsumexp_{r}",
                    (d.seq,),
                    "fp32",
                    (view,),
                    saves=(view,),
                    save_output=True,
                    backward_extra=((f"row_{r}_shifted", row, d.act), (f"row_{r}_exp", row, d.act)),
                )
            )
        stacked = g.op("logprobs.stack", (d.rows, d.seq), "fp32", tuple(sums), grad_slices=True)
        logprobs = g.op("logprobs", (d.rows, d.seq), "fp32", (labels, stacked))
    else:  # 16-bit: a log_softmax per row, kept for its backward, and the target's gather
        rows = g.op("logprobs.unbind", full, d.act, (logits,), grad_passthrough=True, aliases_input=True)
        picked = []
        for r in range(d.rows):
            view = g.view(f"logprobs.row_{r}", rows, row)
            soft = g.op(f"logprobs.log_softmax_{r}", row, d.act, (view,), save_output=True)
            picked.append(g.op(f"logprobs.gather_{r}", (d.seq,), d.act, (soft,)))
        logprobs = g.op("logprobs", (d.rows, d.seq), d.act, tuple(picked), grad_slices=True)
    if entropy:
        chunk_temps: list[Workspace] = []
        for start in range(0, d.seq, d.chunk):
            size = min(d.chunk, d.seq - start)
            shape = (d.rows, size, vocab)
            chunk_temps = [("log_softmax", shape, d.act), ("exp", shape, d.act), ("product", shape, d.act)]
            g.op(f"entropy.chunk_{start}", (d.rows, size), d.act, (logits,), temps=tuple(chunk_temps), detached=True)
    actions = (d.rows, d.seq - 1)
    weighted = g.op("loss.weighted", actions, "fp32", (logprobs,))
    g.op("loss", (1,), "fp32", (weighted,))
    return g

"""The model's weight tensors one by one, in the model's order: what a weight sync streams and what vLLM's load
allocates (the weight sync's buckets, ``weight_sync``; the ``load_weights`` start step's allocations,
``vllm_startup``)."""

from __future__ import annotations

from skyrl_sim.api import ModelArch


def model_tensors(model: ModelArch, dtype: int) -> list[int]:
    """The bytes of every tensor the sync streams, in the model's order: every parameter the trainer exports
    (SkyRL's ``MegatronWeightSource``: Megatron-Bridge's ``export_hf_weights`` streams the whole model in HF order;
    the real backend's layout is ``megatron_vllm.hf_export.hf_shapes``), so they add up to
    ``ModelArch.parameter_count``. Per layer: the attention block (``attention_tensors``, ``mla_tensors``, or a gated
    DeltaNet's in_proj, conv1d, dt_bias, A_log, norm and out_proj), the MLP (dense: gate, up, down; MoE: the router
    and its bias, each routed expert's three matrices, then the shared experts' gate, up and down,
    ``n_shared_experts x moe_intermediate_size`` or ``shared_expert_intermediate_size`` wide, and Qwen's
    ``shared_expert_gate`` ``[1, hidden]`` last, as HF's ``Qwen2MoeSparseMoeBlock`` registers its modules: gate,
    experts, shared_expert, shared_expert_gate), the two norms."""
    h = model.hidden_size
    out = [model.vocab_size * h * dtype]
    for index, kind in enumerate(model.layer_types):
        if model.mla is not None and kind != "linear_attention":
            out += [nbytes * dtype for nbytes in mla_tensors(model)]
        elif kind != "linear_attention":  # full or sliding-window attention: the same weights
            out += [nbytes * dtype for nbytes in attention_tensors(model)]
        else:
            la = model.linear_attention
            assert la is not None
            conv_channels = 2 * la.qk_width + la.v_width
            out += [h * la.in_proj_width * dtype, conv_channels * la.conv_kernel * dtype]
            out += [la.num_value_heads * dtype, la.num_value_heads * dtype, la.value_head_dim * dtype]
            out.append(la.v_width * h * dtype)
        if model.is_moe_layer(index):
            moe = model.moe
            assert moe is not None
            out += router_tensors(model, dtype)
            out += [h * moe.expert_ffn_hidden_size * dtype] * (3 * moe.num_experts)
            if moe.shared_expert_ffn_hidden_size:  # hf_export._moe_shapes: shared gate_proj, up_proj, down_proj
                out += [h * moe.shared_expert_ffn_hidden_size * dtype] * 3
            if moe.shared_expert_gate:  # Qwen's mlp.shared_expert_gate.weight [1, hidden], after the shared expert
                out.append(h * dtype)
        else:
            out += [h * model.ffn_hidden_size * dtype] * 3
        out += [h * dtype, h * dtype]
    out.append(h * dtype)
    if not model.tied_embeddings:
        out.append(model.vocab_size * h * dtype)
    return out


def router_tensors(model: ModelArch, dtype: int) -> list[int]:
    """An MoE layer's router in bytes, at the model's dtype in every checkpoint (vLLM keeps it unquantized): its
    ``[num_experts, hidden]`` weight, then its bias where the model has one."""
    moe = model.moe
    assert moe is not None
    out = [model.hidden_size * moe.num_experts * dtype]
    if moe.router_bias:
        out.append(moe.num_experts * dtype)
    return out


def attention_tensors(model: ModelArch) -> list[int]:
    """A softmax attention layer's parameters in elements (``ModelArch.layer_parameter_count``'s): q, k, v (with
    their biases where the model has them), o (and its bias), the q and k norms, the attention sinks."""
    h = model.hidden_size
    out = [h * model.q_width, h * model.kv_width, h * model.kv_width]
    if model.attention_bias:
        out += [model.q_width, model.kv_width, model.kv_width]
    out.append(model.attention_out_width * h)
    if model.attention_bias:
        out.append(h)
    out += [model.head_dim, model.head_dim]
    if model.attention_sinks:
        out.append(model.num_attention_heads)
    return out


def mla_tensors(model: ModelArch) -> list[int]:
    """A multi-latent attention layer's parameters in elements (``MlaDims.parameters``'s; ``hf_export._mla_shapes``'s
    order): the q down projection, its norm and the up projection (or one q projection), the kv down projection, its
    norm and up projection, the output projection."""
    mla, h, heads = model.mla, model.hidden_size, model.num_attention_heads
    assert mla is not None
    q = heads * mla.q_head_dim
    query = [h * mla.q_lora_rank, mla.q_lora_rank, mla.q_lora_rank * q] if mla.q_lora_rank else [h * q]
    kv_up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return [*query, h * mla.latent_width, mla.kv_lora_rank, kv_up, heads * mla.v_head_dim * h]

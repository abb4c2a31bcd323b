"""Which Hugging Face ``config.json`` keys change the network, and what the architecture reader does with each.

A key the reader (``architecture.from_hf_config``) does not model must never be dropped silently: a config that
sets one of the ``UNMODELLED`` keys is refused (exit 2) with the key, the feature it turns on and the families the
reader models named. Three lists, one definition each:

* ``MODELLED``: keys the reader reads into the ``ModelArch`` (sizes, layer kinds, the MoE layout, MLA widths, the
  sliding window).
* ``NO_MEMORY_EFFECT``: keys that change the network's arithmetic but no tensor's size, or whose effect the model
  bounds from above, each with the reason (the MoE
  routing options among them: they choose *which* experts a token visits and how their outputs are weighted, while
  every routing tensor is sized by ``num_experts`` and ``top_k`` alone, and the imbalance they cause is the endpoint's
  ``trainer.moe_routing``, not the config's).
* ``UNMODELLED``: keys of features the reader does not model, with the feature. A key absent from all three lists is
  not a network key as far as this reader knows (``torch_dtype``, token ids, ``transformers_version``...).

A key counts as set when its value is anything but null, false, 0 or empty (``"use_sliding_window": false`` and
``"final_logit_softcapping": null`` set nothing).
"""

from __future__ import annotations

from typing import Any

MODELLED_FAMILIES = (
    "dense full attention (Llama, Qwen, Mistral), Qwen3-MoE and Mixtral MoE, DeepSeek-style MoE (dense first layers, "
    "shared experts, moe_layer_freq), multi-latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash), gated-DeltaNet "
    "hybrids (Qwen3.5/3.6, Qwen3-Next), sliding-window and sink attention (gpt-oss, Gemma-style layer_types)"
)
"""What the reader models, named in every refusal."""

MODELLED = frozenset(
    {
        # every model
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias", "attn_output_gate", "text_config",
        "vision_config", "max_position_embeddings",
        # layer kinds: gated-DeltaNet hybrids and sliding windows
        "layer_types", "full_attention_interval", "linear_num_key_heads", "linear_key_head_dim",
        "linear_num_value_heads", "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_ssm_dtype", "sliding_window",
        "use_sliding_window", "max_window_layers", "sliding_window_pattern",
        # mixture of experts (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek)
        "num_experts", "n_routed_experts", "num_local_experts", "num_experts_per_tok", "experts_per_token",
        "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts", "decoder_sparse_step",
        "mlp_only_layers", "first_k_dense_replace", "moe_layer_freq",
        # multi-latent attention
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    }
)

ROUTING = (
    "a routing option: it chooses which experts a token visits and how their outputs are weighted; every routing "
    "tensor is sized by the expert count and top_k whatever it chooses"
)
NO_MEMORY_EFFECT: dict[str, str] = {
    **{
        key: ROUTING
        for key in (
            "n_group", "topk_group", "topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
            "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits",
            "router_jitter_noise", "moe_router_bias_update_rate",
        )
    },
    "num_nextn_predict_layers": (
        "multi-token prediction heads: SkyRL 0.4.0 builds none unless trainer.mtp.enabled (skyrl/train/utils/utils.py "
        "sets mtp_num_layers to 0), and vLLM loads them only for speculative decoding"
    ),
    "mtp_num_hidden_layers": "multi-token prediction heads (Qwen3.5/3.6): built by neither SkyRL's default nor vLLM's",
    "rope_theta": "rotary frequencies: the same tensors",
    "rope_scaling": "rotary scaling (YaRN and others): the same tensors",
    "rope_parameters": "rotary frequencies and scaling: the same tensors",
    "rope_interleave": "rotary layout: the same tensors",
    "partial_rotary_factor": "rotary width: the walk's rotary tables are sized at the full head width (an upper bound)",
    "rotary_dim": "rotary width: the walk's rotary tables are sized at the full head width (an upper bound)",
    "hidden_act": "the gated MLP's elementwise activation: the same tensors",
    "swiglu_limit": "gpt-oss's clamped SwiGLU: an elementwise clamp, the same tensors",
    "rms_norm_eps": "a norm's epsilon",
    "attention_dropout": "dropout off in training here (SkyRL sets 0)",
    "query_pre_attn_scalar": "the attention's softmax scale",
    "initial_context_length": "gpt-oss's rotary base length: the same tensors",
    "no_rope_layers": "layers without rotary embedding: the walk sizes every layer's rotary tables (an upper bound)",
    "quantization_config": (
        "a quantized checkpoint (fp8, mxfp4): the trainer trains the dequantized model at trainer.params_dtype; an "
        "fp8 checkpoint's vLLM weights are counted module by module (schema/quantization.py), other methods' and "
        "the multi-latent and window families' at inference.model_dtype, an upper bound of the checkpoint's"
    ),
}

UNMODELLED: dict[str, str] = {
    "index_topk": "DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5)",
    "index_n_heads": "DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5)",
    "index_head_dim": "DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5)",
    "o_lora_rank": "DeepSeek-V4's low-rank output projection",
    "compress_ratios": "DeepSeek-V4's compressed attention",
    "hc_mult": "DeepSeek-V4's hyper-connections",
    "attention_chunk_size": "chunked local attention (Llama 4)",
    "num_kv_shared_layers": "KV sharing across layers (Gemma 3n)",
    "kv_sharing_layer_map": "KV sharing across layers",
    "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 3n)",
    "altup_num_inputs": "alternating updates (Gemma 3n)",
    "laurel_rank": "learned augmented residual layers (Gemma 3n)",
    "attn_logit_softcapping": "attention logit soft-capping (Gemma 2): more score-sized tensors",
    "final_logit_softcapping": "output logit soft-capping (Gemma 2): more vocabulary-sized tensors",
    "cross_attention_layers": "cross-attention layers (Llama 3.2 Vision)",
    "layers_block_type": "Mamba hybrid layers (Nemotron-H, Jamba)",
    "hybrid_override_pattern": "Mamba hybrid layers (Nemotron-H)",
    "mamba_num_heads": "Mamba layers",
    "ssm_state_size": "Mamba layers",
    "attn_layer_period": "Mamba hybrid layers (Jamba)",
    "mlp_layer_types": "per-layer MLP kinds",
    "dense_intermediate_size": "separately sized dense MLPs (MiniMax-M3)",
    "shared_intermediate_size": "separately sized shared experts (MiniMax-M3)",
    "moe_latent_size": "latent MoE projections",
}


def is_set(value: Any) -> bool:
    """Whether a config value turns its feature on: anything but null, false, 0 or an empty list or mapping."""
    return value is not None and value is not False and value != 0 and value != [] and value != {}


def refuse_unmodelled(config: dict[str, Any]) -> None:
    """Raise ValueError naming the first ``UNMODELLED`` key ``config`` sets (in its text config or at its top level),
    what it turns on, and the families the reader models."""
    for key, value in config.items():
        if key in UNMODELLED and is_set(value):
            raise ValueError(
                f"key '{key}' ({UNMODELLED[key]}) changes the network and is not modelled; "
                f"modelled families: {MODELLED_FAMILIES}"
            )

"""A megatron-core ``GPTModel`` built from a ``ModelArch``: the real backend's base model.

Local layer spec (no TransformerEngine; megatron-core's unfused core attention or, with ``trainer.attention: flash``,
an SDPA flash one), RMSNorm, SwiGLU, RoPE, no bias, untied embeddings unless the architecture
ties them. What it cannot build is refused with a ``UserError`` naming the model.

Gated-DeltaNet hybrids (``linear_attention`` layers): those layers are megatron-core's ``GatedDeltaNet``
(``megatron/core/ssm/gated_delta_net.py``) with local linears (``in_proj`` column-parallel, ``out_proj``
row-parallel, the value-head RMSNorm as ``out_norm``) and the layer's own input norm, as
``get_gated_delta_net_module_spec`` builds it but without TransformerEngine's fused norm-linear; its short convolution
is ``nn.Conv1d`` (causal-conv1d needs CUDA) and its chunked gated delta rule runs on the CPU kernels of
``gated_delta_rule`` (FLA's need a GPU).

Mixture-of-experts layers (``arch.moe``; every layer, or those of ``moe.moe_layers``) are megatron-core's local MoE
layer as SkyRL 0.4.0 configures it (``moe_settings``): the fp32 ``TopKRouter`` (softmax over the top-k logits, no
load-balancing loss, no expert bias), the all-gather token dispatcher (SkyRL's all-to-all one needs CUDA streams),
``SequentialMLP`` experts (one SwiGLU MLP per local expert: grouped GEMM needs TransformerEngine) and the shared
expert where the model has one. With routed-expert replay on (``trainer.routed_expert_replay``) the routers carry
Megatron's ``RouterReplay``.
"""

from __future__ import annotations

import torch

from skyrl_sim.api import ModelArch, Recompute, Stage, UserError
from skyrl_sim_plugins.megatron_vllm.hf_export import init_hf_weights, rms_norm_eps, rope_theta, to_megatron


def check_supported(arch: ModelArch, tp: int, endpoint_name: str = "", ep: int = 1) -> None:
    """Refuse what the real backend cannot build, naming the endpoint's model and the reason."""
    where = f"endpoint '{endpoint_name}', model '{arch.name}'" if endpoint_name else f"model '{arch.name}'"
    if any(kind not in ("full_attention", "linear_attention", "sliding_attention") for kind in arch.layer_types):
        raise UserError(f"{where}: the real backend builds full-attention, sliding-window and gated-DeltaNet layers only")
    if "linear_attention" in arch.layer_types and (arch.mla is not None or "sliding_attention" in arch.layer_types):
        raise UserError(f"{where}: the real backend builds gated-DeltaNet layers beside full attention only")
    la = arch.linear_attention
    if la is not None and "linear_attention" in arch.layer_types:
        check_deltanet_heads(la.num_key_heads, la.num_value_heads, tp, where)
    if arch.mla is not None and arch.mla.q_head_dim != arch.mla.v_head_dim:
        raise UserError(
            f"{where}: the flash kernels need the query's and the value's head widths equal (qk_nope_head_dim + "
            f"qk_rope_head_dim = {arch.mla.q_head_dim}, v_head_dim = {arch.mla.v_head_dim}), as SkyRL's GLM-4.7-Flash "
            "script notes for flash_attn"
        )
    if arch.moe is not None and tp > 1:
        raise UserError(
            f"{where}: megatron-core trains a mixture-of-experts model under tensor parallelism only with sequence "
            "parallelism, which needs TransformerEngine or Apex norms; the real backend runs MoE models at tp = 1"
        )
    if arch.moe is not None and arch.moe.num_experts % ep:
        raise UserError(f"{where}: {arch.moe.num_experts} experts do not split over ep = {ep}")
    if arch.attention_output_gate:
        raise UserError(f"{where}: attention output gates are not supported by megatron-core's local layer spec")
    if arch.num_attention_heads % arch.num_kv_heads:
        raise UserError(f"{where}: {arch.num_attention_heads} heads do not split into {arch.num_kv_heads} KV groups")
    for what, value in (("num_kv_heads", arch.num_kv_heads), ("vocab_size", arch.vocab_size), ("ffn", arch.ffn_hidden_size)):
        if value % tp:
            raise UserError(f"{where}: {what} = {value} is not divisible by tp = {tp}")


def check_deltanet_heads(key_heads: int, value_heads: int, tp: int, where: str) -> None:
    """megatron-core's TransformerConfig checks of a gated DeltaNet's heads: both split over TP, the value heads into
    the key heads."""
    if value_heads % key_heads or key_heads % tp or value_heads % tp:
        raise UserError(
            f"{where}: gated-DeltaNet heads ({key_heads} key, {value_heads} value) must split over tp = {tp}, and the "
            "value heads into the key heads (megatron-core's TransformerConfig checks)"
        )


def params_dtype(name: str) -> torch.dtype:
    """The endpoint's ``trainer.params_dtype`` as a torch dtype."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def llama_settings() -> dict[str, object]:
    """The block every model here is built with, as the HF models it loads compute it: RMSNorm, SwiGLU, no linear
    biases, no dropout; megatron-core's fused kernels off (they need CUDA or Apex), parameters made on the CPU when
    there is no GPU."""
    return {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "use_cpu_initialization": not torch.cuda.is_available(),
    }


def recompute_settings(recompute: Recompute) -> dict[str, object]:
    """The endpoint's activation recompute as megatron-core TransformerConfig settings (none: keep every activation)."""
    if recompute.granularity == "none":
        return {}
    if recompute.granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {
        "recompute_granularity": "full",
        "recompute_method": recompute.method,
        "recompute_num_layers": recompute.num_layers,
    }


def pipeline_settings(pp: int) -> dict[str, object]:
    """TransformerConfig settings of a ``pp``-stage pipeline (none without one): one send or receive at a time (gloo
    has no coalesced batches: ``batch_p2p_comm`` off). ``variable_seq_lengths`` is set on the built config
    (``build_gpt_model``)."""
    if pp == 1:
        return {}
    return {"pipeline_model_parallel_size": pp, "batch_p2p_comm": False}


def stage_weights(shards: dict[str, torch.Tensor], stage: Stage, tied: bool) -> dict[str, torch.Tensor]:
    """A pipeline stage's part of this rank's shards; a last stage of a tied model keeps a copy of the embeddings as
    its output layer, as megatron-core does."""
    from skyrl_sim_plugins.megatron_vllm.pipeline_stage import to_stage

    out = to_stage(shards, stage)
    if tied and stage.last and not stage.first:
        out["output_layer.weight"] = shards["embedding.word_embeddings.weight"]
    return out


# SkyRL 0.4.0's MegatronConfig defaults for MoE models are moe_router_load_balancing_type "none", moe_aux_loss_coeff 0,
# moe_router_dtype "fp32" (kept), moe_grouped_gemm True (needs TransformerEngine: the local spec runs the same experts
# one by one, SequentialMLP) and moe_token_dispatcher_type "alltoall". megatron-core's all-to-all dispatcher creates a
# torch.cuda.Stream when it is built and synchronises on it, so it cannot run on CPU: the real backend runs the
# all-gather dispatcher, the one the simulator's walk models (sim/reference/memory_ops.moe_mlp_block).
MOE_DISPATCHER = "allgather"


def moe_settings(arch: ModelArch, replay: bool) -> dict[str, object]:
    """megatron-core TransformerConfig settings of ``arch``'s MoE layers (none for a dense model); ``replay``: the
    routers record and replay their top-k ids (``moe_enable_routing_replay``)."""
    moe = arch.moe
    if moe is None:
        return {}
    settings: dict[str, object] = {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.expert_ffn_hidden_size,
        "moe_token_dispatcher_type": MOE_DISPATCHER,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": False,
        "moe_enable_routing_replay": replay,
    }
    if moe.shared_expert_ffn_hidden_size:
        settings["moe_shared_expert_intermediate_size"] = moe.shared_expert_ffn_hidden_size
    if moe.shared_expert_gate:  # Qwen's: SharedExpertMLP's gate_weight [1, hidden], sigmoid(x @ w) x the output
        settings["moe_shared_expert_gate"] = True
    return settings


def linear_attention_settings(arch: ModelArch) -> dict[str, object]:
    """megatron-core TransformerConfig settings of ``arch``'s gated-DeltaNet layers (none without them)."""
    la = arch.linear_attention
    if la is None or "linear_attention" not in arch.layer_types:
        return {}
    return {
        "linear_conv_kernel_dim": la.conv_kernel,
        "linear_key_head_dim": la.key_head_dim,
        "linear_value_head_dim": la.value_head_dim,
        "linear_num_key_heads": la.num_key_heads,
        "linear_num_value_heads": la.num_value_heads,
    }


def deltanet_layer_spec(layer: object) -> object:
    """A local layer spec with megatron-core's ``GatedDeltaNet`` in place of its self-attention: local column- and
    row-parallel linears for ``in_proj`` and ``out_proj``, the layer's own norm class for the value-head
    ``out_norm``."""
    import dataclasses

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from skyrl_sim_plugins.megatron_vllm import gated_delta_rule

    if not torch.cuda.is_available():
        gated_delta_rule.install()
    sub = layer.submodules  # type: ignore[attr-defined]
    deltanet = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=sub.input_layernorm, out_proj=RowParallelLinear
        ),
    )
    return dataclasses.replace(layer, submodules=dataclasses.replace(sub, self_attention=deltanet))


def block_spec(arch: ModelArch, attention: str) -> object:
    """The decoder's layer spec: one spec for a uniform model, else a spec per layer (MoE and dense MLPs mixed, as a
    DeepSeek-style model's dense first layers; full and linear attention mixed)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from skyrl_sim_plugins.megatron_vllm.flash_attention import local_layer_spec

    if "linear_attention" in arch.layer_types:
        experts = arch.moe.num_experts if arch.moe is not None else None
        specs = []
        for i, kind in enumerate(arch.layer_types):
            layer = local_layer_spec(attention, experts if arch.is_moe_layer(i) else None)
            specs.append(deltanet_layer_spec(layer) if kind == "linear_attention" else layer)
        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm(specs[0]))
    latent = arch.mla is not None
    if arch.moe is None:
        return local_layer_spec(attention, latent=latent)
    moe_layers = [arch.is_moe_layer(i) for i in range(arch.num_layers)]
    if all(moe_layers):
        return local_layer_spec(attention, arch.moe.num_experts, latent=latent)
    dense = local_layer_spec(attention, latent=latent)
    sparse = local_layer_spec(attention, arch.moe.num_experts, latent=latent)
    return TransformerBlockSubmodules(layer_specs=[sparse if m else dense for m in moe_layers], layer_norm=final_norm(dense))


def final_norm(layer: object) -> object:
    """The final norm of a per-layer block spec, as megatron-core's own (``get_gpt_decoder_block_spec``) builds it:
    the layers' norm. A ``TransformerBlockSubmodules`` without one builds no ``final_layernorm``, so every model with
    a layer spec per layer (DeepSeek-style dense first layers, a linear-attention hybrid) needs it named."""
    return layer.submodules.input_layernorm  # type: ignore[attr-defined]


def mla_settings(arch: ModelArch) -> dict[str, object]:
    """megatron-core ``MLATransformerConfig`` settings of ``arch``'s multi-latent attention (none without it): the
    ranks and head widths as Megatron-Bridge's DeepSeek provider maps the HF keys (``q_lora_rank`` 0 is None, a
    direct query projection), plain rotary embedding over the rotary part."""
    m = arch.mla
    if m is None:
        return {}
    return {
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_head_dim": m.qk_nope_head_dim,
        "qk_pos_emb_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_type": "rope",
        "rotary_base": rope_theta(arch),
    }


def window_settings(arch: ModelArch) -> dict[str, object]:
    """megatron-core TransformerConfig settings of ``arch``'s sliding-window layers (none without them): the window
    ``(sliding_window - 1, 0)`` (``get_sliding_window_causal_mask``: a query attends to the keys from ``window[0]``
    before it to itself, the HF window's ``sliding_window`` keys) on the layers ``window_attn_skip_freq`` marks
    (``is_layer_window_attention``: a list, 1 for a window layer)."""
    if "sliding_attention" not in arch.layer_types:
        return {}
    return {
        "window_size": (arch.sliding_window - 1, 0),
        "window_attn_skip_freq": [int(kind == "sliding_attention") for kind in arch.layer_types],
    }


def latent_module_graph(arch: ModelArch, seed: int, dtype: torch.dtype, attention: str = "flash") -> torch.nn.Module:
    """megatron-core's GPTModel of an MLA ``arch`` (MoE layers, dense first layers and shared experts included) with
    megatron's own initialisation: the module graph the simulator's layer description is held to on CPU
    (``tests/real/test_mla_module_graph.py``). Needs model parallel initialised; ``fix_moe_router`` and ``fix_mla``
    are applied."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from skyrl_sim_plugins.megatron_vllm.cpu_shims import fix_mla, fix_moe_router

    fix_moe_router()
    fix_mla()
    torch.manual_seed(seed)
    config = MLATransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        **llama_settings(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **mla_settings(arch),
        **moe_settings(arch, replay=False),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(arch, attention),
        vocab_size=arch.vocab_size,
        max_sequence_length=4096,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
    )


def build_gpt_model(
    arch: ModelArch,
    seed: int,
    dtype: torch.dtype,
    max_sequence_length: int,
    recompute: Recompute | None = None,
    attention: str = "unfused",
    stage: Stage | None = None,
    route_replay: bool = False,
) -> torch.nn.Module:
    """This rank's GPTModel shard with the seed's base weights, all frozen. Needs model parallel initialised.

    ``attention`` is the endpoint's ``trainer.attention_kernel``: megatron-core's unfused core attention or the SDPA
    flash module (``flash_attention.local_layer_spec``). ``stage``: this rank's pipeline stage (``pipeline_stage``),
    None without pipeline parallelism. ``route_replay``: an MoE model's routers get Megatron's ``RouterReplay`` (the
    process-wide list of replay instances is emptied first, so it holds this model's only)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = recompute or Recompute(granularity="none")
    if arch.mla is not None:
        from skyrl_sim_plugins.megatron_vllm.cpu_shims import fix_mla

        fix_mla()
    if arch.moe is not None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from skyrl_sim_plugins.megatron_vllm.cpu_shims import fix_moe_router

        fix_moe_router()
        RouterReplay.clear_global_router_replay_instances()

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    on_cuda = torch.cuda.is_available()
    config_class = MLATransformerConfig if arch.mla is not None else TransformerConfig
    config = config_class(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        layernorm_epsilon=rms_norm_eps(arch),
        add_qkv_bias=False,
        **llama_settings(),
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        calculate_per_token_loss=True,
        sequence_parallel=False,
        **recompute_settings(recompute),
        **pipeline_settings(parallel_state.get_pipeline_model_parallel_world_size()),
        **moe_settings(arch, route_replay),
        **mla_settings(arch),
        **window_settings(arch),
        **linear_attention_settings(arch),
    )
    if stage is not None:
        # micro-batches trimmed to their own width exchange their shapes before each send (SkyRL sets it too). Set on
        # the built config: its constructor refuses it beside the default MoE allgather dispatcher, which a dense
        # model never runs
        config.variable_seq_lengths = True
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(arch, attention),
        vocab_size=arch.vocab_size,
        max_sequence_length=max_sequence_length,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_theta(arch)),
        pre_process=stage is None or stage.first,
        post_process=stage is None or stage.last,
    )
    rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_world_size()
    shards = to_megatron(init_hf_weights(arch, seed), arch, tp, rank, ep, ep_rank)
    if stage is not None:
        shards = stage_weights(shards, stage, arch.tied_embeddings)
        numbers = [layer.layer_number - 1 for layer in model.decoder.layers]  # megatron's global layer numbers
        if numbers != list(stage.layers):
            raise RuntimeError(f"megatron-core built layers {numbers} on stage {stage.index}, not {list(stage.layers)}")
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(shards))
    if missing:
        raise RuntimeError(f"no base weight for megatron parameters {missing}")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(shards[name].to(param.dtype))
            param.requires_grad_(False)
    if on_cuda:
        model = model.cuda()
    return model

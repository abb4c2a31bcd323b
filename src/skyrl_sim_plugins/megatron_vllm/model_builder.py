"""A megatron-core ``GPTModel`` built from a ``ModelArch``: the real backend's base model.

Local layer spec (no TransformerEngine; megatron-core's unfused core attention or, with ``trainer.attention: flash``,
an SDPA flash one), RMSNorm, SwiGLU, RoPE, no bias, untied embeddings unless the architecture
ties them. Only dense full-attention architectures are supported (megatron-core's local spec has no gated DeltaNet
and the real backend does not run MoE); anything else is refused with a ``UserError`` naming the model.

Weights are created deterministically from a seed in the Hugging Face Llama layout (``hf_export.init_hf_weights``) and
loaded as this rank's shards (``hf_export.to_megatron``), so TP=1 and TP=2 hold the very same function and the HF
checkpoint written for vLLM is exactly the model that trained. Base weights are frozen.
"""

from __future__ import annotations

import torch

from skyrl_sim.api import ModelArch, Recompute, Stage, UserError
from skyrl_sim_plugins.megatron_vllm.hf_export import init_hf_weights, rms_norm_eps, rope_theta, to_megatron


def check_supported(arch: ModelArch, tp: int, endpoint_name: str = "") -> None:
    """Refuse what the real backend cannot build, naming the endpoint's model and the reason."""
    where = f"endpoint '{endpoint_name}', model '{arch.name}'" if endpoint_name else f"model '{arch.name}'"
    if any(kind != "full_attention" for kind in arch.layer_types):
        raise UserError(f"{where}: the real backend builds dense full-attention models only (this one has linear attention)")
    if arch.moe is not None:
        raise UserError(f"{where}: the real backend builds dense models only (this one is mixture-of-experts)")
    if arch.attention_output_gate:
        raise UserError(f"{where}: attention output gates are not supported by megatron-core's local layer spec")
    if arch.num_attention_heads % arch.num_kv_heads:
        raise UserError(f"{where}: {arch.num_attention_heads} heads do not split into {arch.num_kv_heads} KV groups")
    for what, value in (("num_kv_heads", arch.num_kv_heads), ("vocab_size", arch.vocab_size), ("ffn", arch.ffn_hidden_size)):
        if value % tp:
            raise UserError(f"{where}: {what} = {value} is not divisible by tp = {tp}")


def params_dtype(name: str) -> torch.dtype:
    """The endpoint's ``trainer.params_dtype`` as a torch dtype."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


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


def build_gpt_model(
    arch: ModelArch,
    seed: int,
    dtype: torch.dtype,
    max_sequence_length: int,
    recompute: Recompute | None = None,
    attention: str = "unfused",
    stage: Stage | None = None,
) -> torch.nn.Module:
    """This rank's GPTModel shard with the seed's base weights, all frozen. Needs model parallel initialised.

    ``attention`` is the endpoint's ``trainer.attention_kernel``: megatron-core's unfused core attention or the SDPA
    flash module (``flash_attention.local_layer_spec``). ``stage``: this rank's pipeline stage (``pipeline_stage``),
    None without pipeline parallelism."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from skyrl_sim_plugins.megatron_vllm.flash_attention import local_layer_spec

    recompute = recompute or Recompute(granularity="none")

    tp = parallel_state.get_tensor_model_parallel_world_size()
    on_cuda = torch.cuda.is_available()
    config = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        layernorm_epsilon=rms_norm_eps(arch),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not on_cuda,
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        calculate_per_token_loss=True,
        sequence_parallel=False,
        **recompute_settings(recompute),
        **pipeline_settings(parallel_state.get_pipeline_model_parallel_world_size()),
    )
    if stage is not None:
        # micro-batches trimmed to their own width exchange their shapes before each send (SkyRL sets it too). Set on
        # the built config: its constructor refuses it beside the default MoE allgather dispatcher, which a dense
        # model never runs
        config.variable_seq_lengths = True
    model = GPTModel(
        config=config,
        transformer_layer_spec=local_layer_spec(attention),
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
    shards = to_megatron(init_hf_weights(arch, seed), arch, tp, rank)
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

"""Static memory of a training rank: what it holds before its first micro-batch and keeps between calls.

TP/PP-sharded weights (and the vision tower on the vision-language path; with full fine-tuning their fp32 gradients
and optimizer state too), LoRA parameters with fp32 gradients and Adam state (optimizer state off the device with
``optimizer_offload``, sharded over data parallelism by the distributed optimizer). Under expert parallelism a rank
holds only its own experts.

Read by the walk (every rank's allocator starts from it: ``memory_walk.EndpointFacts``), by tenancy (an adapter
slot's bytes: ``service.tenancy``) and by colocation (the trainer's share of a device it shares with vLLM).
"""

from __future__ import annotations

import math

from skyrl_sim.api import DTYPE_BYTES, Endpoint, ModelArch, Stage, stage_layers
from skyrl_sim_plugins.sim.description.layer_ops import MoE, decoder_layer


def lora_params_per_rank(model: ModelArch, endpoint: Endpoint, layers: list[int], experts: bool | None = None) -> int:
    """LoRA A and B parameters of ``layers`` on one TP (and expert-parallel) rank: every adapted linear of the layer
    description, split as Megatron-Bridge's ParallelLinearAdapter splits it (``Linear.adapter_parameters_per_rank``).
    ``experts``: only the routed experts' adapters (True) or only the others (False); None: all."""
    p, rank, targets = endpoint.parallelism, endpoint.lora.rank, endpoint.adapted_targets(model)
    total = 0
    for index in layers:
        layer = decoder_layer(model, index)
        routed = [id(x) for x in layer.mlp.experts.linears] if isinstance(layer.mlp, MoE) else []
        for linear, copies in layer.adapted_linears(targets, p.ep):
            if experts is None or (id(linear) in routed) == experts:
                total += copies * linear.adapter_parameters_per_rank(rank, p.tp)
    return total


def trainable_state_bytes(params: int, endpoint: Endpoint, dtype: str | None = None, replicas: int | None = None) -> int:
    """Parameters (in ``dtype``, the trainer's ``params_dtype`` when not given) plus fp32 main gradients plus Adam
    (an fp32 master copy unless the parameters are fp32, two fp32 moments).

    The distributed optimizer shards the optimizer state over the parameters' data-parallel replicas (``replicas``:
    DP, or DP / EP for routed experts' parameters); ``optimizer_offload`` moves it to the host.
    """
    t = endpoint.trainer
    pbytes = DTYPE_BYTES[dtype or t.params_dtype]
    optimizer = 0 if t.optimizer_offload else (8 + (4 if pbytes < 4 else 0))
    shards = replicas if replicas is not None else endpoint.parallelism.dp
    return params * (pbytes + 4) + math.ceil(params * optimizer / shards)


def static_bytes(model: ModelArch, endpoint: Endpoint, stage: Stage | None = None) -> dict[str, int]:
    """Weights (with full fine-tuning: their gradients and optimizer state too) and LoRA adapter state, per rank of
    ``stage`` (the last pipeline stage when not given). Under expert parallelism a rank holds ``E / ep`` experts.

    Under pipeline parallelism the first stage holds the word embeddings (and the vision tower), the last the output
    layer (a copy of the embeddings when they are tied, as megatron-core keeps one on the last stage), a middle stage
    neither."""
    p, t = endpoint.parallelism, endpoint.trainer
    layers = stage_layers(model, endpoint) if stage is None else list(stage.layers)
    vocab = model.vocab_size * model.hidden_size
    if stage is None or p.pp == 1:
        vocab_copies = 1 if model.tied_embeddings or p.pp > 1 else 2
        vision = not t.language_model_only and p.pp == 1
    else:
        vocab_copies = int(stage.first) + int(stage.last)
        vision = not t.language_model_only and stage.first
    # each layer's own count: a DeepSeek-style model's dense first layers and its MoE layers differ, as do a hybrid's
    stage_params = vocab * vocab_copies + sum(model.layer_parameter_count(i) for i in layers)
    if model.moe is not None and p.ep > 1:  # expert parallelism: a rank holds its own experts' weights only
        per_expert = 3 * model.hidden_size * model.moe.expert_ffn_hidden_size
        others = model.moe.num_experts - math.ceil(model.moe.num_experts / p.ep)
        stage_params -= sum(1 for i in layers if model.is_moe_layer(i)) * others * per_expert
    if vision:
        stage_params += model.vision_params
    per_rank = math.ceil(stage_params / p.tp)
    pbytes = DTYPE_BYTES[t.params_dtype]
    weights = per_rank * pbytes
    if t.train_base_weights:
        weights = trainable_state_bytes(per_rank, endpoint)
    adapters = 0
    if endpoint.adapted_targets(model):
        dtype, dp = endpoint.lora.dtype, p.dp
        if model.moe is not None and p.ep > 1:  # an expert's replicas are DP / EP ranks (its expert-data-parallel group)
            dense = lora_params_per_rank(model, endpoint, layers, experts=False)
            routed = lora_params_per_rank(model, endpoint, layers, experts=True)
            adapters = trainable_state_bytes(dense, endpoint, dtype, dp) + trainable_state_bytes(
                routed, endpoint, dtype, max(1, dp // p.ep)
            )
        else:
            adapters = trainable_state_bytes(lora_params_per_rank(model, endpoint, layers), endpoint, dtype)
    return {"weights": weights, "adapters": adapters}

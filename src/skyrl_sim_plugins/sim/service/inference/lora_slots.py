"""The adapter slots vLLM preallocates when it serves LoRA: ``max_loras`` stacked A and B buffers at ``max_lora_rank``
for every module it wraps, and the punica wrapper's index buffers, on one engine worker.

SkyRL turns ``enable_lora`` on when it syncs adapters (``inference_servers/utils.py``: ``max_lora_rank`` is
``lora.rank``, ``max_loras`` is ``lora.max_loras``; ``lora_dtype`` is left at ``"auto"``, the model's dtype:
``LoRAConfig.verify_with_model_config``). vLLM makes the buffers inside ``load_model`` (the V1 runner's
``gpu_model_runner.py`` and the V2 runner's ``gpu/model_runner.py`` both call ``load_lora_model`` under the load's
memory profiler), so they are counted with the weights and taken out of the KV budget
(``gpu_worker.py``: ``determine_available_memory``).

Which modules are wrapped (``lora/model_manager.py``: ``_create_lora_modules``, with no ``target_modules``, as SkyRL
passes none): every ``LinearBase`` and ``MoERunner`` by its name's suffix, and the model's ``embedding_modules``
(``embed_tokens``, ``lm_head``; ``lora/utils.py``: ``get_supported_lora_modules``). What each allocates
(``create_lora_weights``), ``L = max_loras``, ``r = max_lora_rank``, shapes on one TP rank:

- a linear (``lora/layers/base_linear.py``, ``column_parallel_linear.py``): per output slice (``n_slices``: 3 for
  the merged QKV, the packed module's output sizes for a merged column such as gate_up or the DeltaNet's in_proj_qkvz,
  else 1) ``lora_a [L, 1, r, input_size]`` and ``lora_b [L, 1, slice_output, r]``; a column-parallel layer's input is
  whole and its outputs are the rank's partitions, a row-parallel layer's input is its partition and its output
  whole. ``fully_sharded_loras`` (SkyRL's ``fully_sharded_loras``, off by default) divides a column layer's A rank
  and a row layer's B output by TP;
- the routed experts (``lora/layers/fused_moe.py``: ``FusedMoEWithLoRA``; SkyRL sets
  ``enable_mixed_moe_lora_format``, the 2D wrapper): ``w13_lora_a [L, E, r, H]`` and ``w13_lora_b [L, E, I/tp, r]``
  per gate/up slice, ``w2_lora_a [L, E, r, I/tp]``, ``w2_lora_b [L, E, H, r]`` (fully sharded: ``r/tp`` in
  ``w13_lora_a``, ``H/tp`` in ``w2_lora_b``);
- the input embedding (``vocab_parallel_embedding.py``: ``VocabParallelEmbeddingWithLoRA``): ``lora_a [L, vocab,
  r]``, ``lora_b [L, 1, H, r]``, whole on every rank;
- the LM head, through its logits processor (``logits_processor.py``: ``LogitsProcessorWithLoRA``; a tied head as
  well, ``model_manager`` wraps the logits processor for any module named ``lm_head``): ``lora_a [L, 1, r, H]``,
  ``lora_b [L, 1, vocab, r]``, whole on every rank;
- the punica wrapper, made first (``punica_base.py``: four int64 ``[max_num_batched_tokens]`` index tensors and three
  int64 ``[max_num_seqs]``; on CUDA ``punica_gpu.py`` adds two ``LoRAKernelMeta``, each two int32
  ``[max_num_batched_tokens]``, two int32 ``[L + 1]`` and one int32 ``[L + 2]``; the CPU platform's
  ``PunicaWrapperCPU`` adds none).

The shapes are the same in every vLLM version modelled (0.23.0, 0.26.0, 0.30.0, 0.32.0 read). Not counted: the
MoE router (``GateLinear`` is not the exact ``ReplicatedLinear`` type the LoRA layer replaces, so vLLM leaves it). A
multimodal checkpoint's vision tower gets no slots: without ``enable_tower_connector_lora`` (SkyRL does not set it)
``_maybe_init_mm`` gives its modules no punica wrapper, and ``_create_lora_modules`` skips them.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_sim.api import (
    MODEL_DTYPE_BYTES,
    Endpoint,
    ModelArch,
    QuantLinear,
    layer_linears,
    partition,
    profile_device,
)

INT64_BYTES = 8
INT32_BYTES = 4
LORA_MAX_VOCAB = 258048
"""The largest vocabulary ``LogitsProcessorWithLoRA.create_lora_weights`` takes (every version read)."""


@dataclass(frozen=True)
class LoraSlots:
    """What one engine worker allocates for its adapter slots, by part, in bytes."""

    linears: int  # the decoder layers' linear modules and experts
    embeddings: int  # the input embedding and the LM head's logits processor
    metadata: int  # the punica wrapper's index buffers

    @property
    def total(self) -> int:
        return self.linears + self.embeddings + self.metadata


def linear_slot_tensors(
    model: ModelArch, linear: QuantLinear, tp: int, slots: int, rank: int, dtype: int, fully_sharded: bool = False
) -> list[int]:
    """One wrapped module's ``create_lora_weights`` on one rank: its A tensors, then its B tensors (module doc)."""
    shard = tp if fully_sharded else 1
    if linear.split == "experts":
        intermediate, hidden = linear.outputs[0] // tp, linear.outputs[1]
        experts = linear.experts
        w13_a = [slots * experts * (rank // shard) * hidden * dtype] * 2
        w2_a = [slots * experts * rank * intermediate * dtype]
        w13_b = [slots * experts * intermediate * rank * dtype] * 2
        w2_b = [slots * experts * (hidden // shard) * rank * dtype]
        return w13_a + w2_a + w13_b + w2_b
    outputs, inputs = partition(model, linear, tp)
    if linear.split == "row":
        return [slots * rank * inputs * dtype] + [slots * out // shard * rank * dtype for out in outputs]
    return [slots * (rank // shard) * inputs * dtype for _ in outputs] + [slots * out * rank * dtype for out in outputs]


def layer_modules(model: ModelArch, index: int) -> list[QuantLinear]:
    """The layer's modules vLLM wraps: its linears (``layer_linears``), the DeltaNet's ``conv1d`` (a plain
    ``ColumnParallelLinear`` of input ``conv_kernel``: ``qwen_gdn_linear_attn.py``)."""
    out = list(layer_linears(model, index))
    if model.layer_types[index] == "linear_attention":
        la = model.linear_attention
        assert la is not None
        out.append(QuantLinear("linear_attn.conv1d", (), (2 * la.qk_width + la.v_width,), la.conv_kernel, "column"))
    return out


def punica_metadata_bytes(endpoint: Endpoint) -> int:
    """The punica wrapper's index buffers (module doc)."""
    tokens, seqs = endpoint.inference.max_num_batched_tokens, endpoint.inference.max_num_seqs
    slots = endpoint.inference.max_loras
    base = 4 * tokens * INT64_BYTES + 3 * seqs * INT64_BYTES
    if profile_device(endpoint.hardware.profile) != "cuda":
        return base
    kernel_meta = 2 * tokens * INT32_BYTES + 2 * (slots + 1) * INT32_BYTES + (slots + 2) * INT32_BYTES
    return base + 2 * kernel_meta


def lora_slot_tensors(endpoint: Endpoint, model: ModelArch) -> list[int]:
    """What vLLM allocates for the slots on one rank, in order: the punica wrapper, the embedding's A and B, each
    layer's modules, the LM head's A and B; empty when vLLM serves no LoRA."""
    inference = endpoint.inference
    if not inference.enable_lora:
        return []
    tp, slots, rank = inference.tensor_parallel_size, inference.max_loras, endpoint.lora.rank
    dtype = MODEL_DTYPE_BYTES[inference.model_dtype]
    h, vocab = model.hidden_size, model.vocab_size
    out = [punica_metadata_bytes(endpoint), slots * vocab * rank * dtype, slots * h * rank * dtype]
    for index in range(model.num_layers):
        for linear in layer_modules(model, index):
            out += linear_slot_tensors(model, linear, tp, slots, rank, dtype, inference.fully_sharded_loras)
        if model.is_moe_layer(index) and model.moe is not None and model.moe.shared_expert_gate:
            out += [slots * rank * h * dtype, slots * 1 * rank * dtype]  # a ReplicatedLinear [1, H], whole on each rank
    out += [slots * rank * h * dtype, slots * vocab * rank * dtype]
    return out


def lora_slots(endpoint: Endpoint, model: ModelArch) -> LoraSlots:
    """The worker's adapter slots by part (zero when vLLM serves no LoRA)."""
    tensors = lora_slot_tensors(endpoint, model)
    if not tensors:
        return LoraSlots(0, 0, 0)
    metadata, embeddings = tensors[0], sum(tensors[1:3]) + sum(tensors[-2:])
    return LoraSlots(sum(tensors) - metadata - embeddings, embeddings, metadata)


def lora_vocab_refusal(endpoint: Endpoint, model: ModelArch) -> str:
    """vLLM's refusal of a vocabulary too large for its LM head's LoRA layer, word for word
    (``logits_processor.py``: ``LogitsProcessorWithLoRA.create_lora_weights`` raises it in ``load_model``, after the
    weights); empty where it does not apply."""
    if endpoint.inference.enable_lora and model.vocab_size > LORA_MAX_VOCAB:
        return f"When using LoRA, vocab size must be <= {LORA_MAX_VOCAB}"
    return ""

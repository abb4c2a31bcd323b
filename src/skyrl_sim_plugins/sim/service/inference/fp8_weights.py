"""The weights one vLLM engine worker holds for an FP8 checkpoint, module by module, as vLLM's ``Fp8Config`` makes them.

Which modules are FP8 (``model_executor/layers/quantization/fp8.py``: ``Fp8Config.get_quant_method``): every
``LinearBase`` built with the model's ``quant_config`` gets ``Fp8LinearMethod`` unless the checkpoint's ignore list
names it (``is_layer_skipped``), and the routed experts get ``Fp8MoEMethod``. Everything else stays in the model's
dtype: the embedding and the LM head (``VocabParallelEmbedding``/``ParallelLMHead``: not ``LinearBase``), the norms,
a gated-DeltaNet layer's ``conv1d`` (``qwen_gdn_linear_attn.py``: a ``ColumnParallelLinear`` built without
``quant_config``), its ``A_log``, ``dt_bias`` and gated norm, the biases of quantized linears (``LinearBase`` makes
them in ``params_dtype``), the MoE router and the shared-expert gate (``qwen3_next.py``: ``GateLinear`` and
``ReplicatedLinear`` without ``quant_config``; Qwen3-MoE's ``GateLinear`` takes it, a few hundred kB per layer
counted here at model dtype), and whatever the checkpoint ignores.

What a quantized module allocates on one tensor-parallel rank:

* ``Fp8LinearMethod.create_weights``: ``weight`` float8_e4m3fn ``[sum(output_partition_sizes),
  input_size_per_partition]`` (1 byte an element, ``fp8_utils.create_fp8_weight_parameter``); block-wise, the fp32
  ``weight_scale_inv`` ``[ceil(out / block_n), ceil(in / block_k)]`` of the partition
  (``create_fp8_scale_parameter``: ``BlockQuantScaleParameter``); per-tensor, one fp32 ``weight_scale`` per logical
  shard (``PerTensorScaleParameter``); with static activations, one fp32 ``input_scale`` per logical shard
  (``create_fp8_input_scale``).
* ``Fp8MoEMethod.create_weights``: ``w13_weight`` ``[E, 2 x I_pp, H]`` and ``w2_weight`` ``[E, H, I_pp]`` in fp8;
  block-wise fp32 scales ``[E, 2 x ceil(I_pp / block_n), ceil(H / block_k)]`` and ``[E, ceil(H / block_n),
  ceil(I_pp / block_k)]``, per-tensor ``[E, 2]`` and ``[E]``; static activations add ``[E]`` twice.

The modules and their partitions are ``schema/quantization.py``'s (``layer_linears``, ``partition``), which also
refuses what vLLM refuses of them. The partitions are vLLM's: ``QKVParallelLinear`` splits the query heads and
``max(1, kv_heads // tp)`` KV heads per rank, column-parallel linears their outputs, row-parallel ones their inputs,
``FusedMoE`` the experts' intermediate size (no expert parallelism in the engines modelled). The model-dtype rest is
the model's parameter count less the quantized modules', split over TP as the model-dtype count does
(``vllm_budget.weights_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_sim.api import (
    MODEL_DTYPE_BYTES,
    Endpoint,
    Fp8Checkpoint,
    ModelArch,
    QuantLinear,
    ceil_div,
    fp8_checkpoint,
    layer_linears,
    partition,
)
from skyrl_sim_plugins.sim.service.inference.weight_tensors import model_tensors, router_tensors

FP8_BYTES = 1
"""``torch.float8_e4m3fn``: one byte an element."""
SCALE_BYTES = 4
"""The scales' dtype: float32 (``create_fp8_scale_parameter``; e8m0 scales only where a checkpoint asks for them)."""

def fp8_module_parts(model: ModelArch, linear: QuantLinear, checkpoint: Fp8Checkpoint, tp: int) -> tuple[int, int]:
    """What ``Fp8LinearMethod.create_weights`` or ``Fp8MoEMethod.create_weights`` registers for the module on one
    rank (module doc): ``(fp8 weights, fp32 scales)`` in bytes, the static input scales among the scales."""
    block = checkpoint.weight_block_size
    static = checkpoint.activation_scheme == "static"
    if linear.split == "experts":
        e = linear.experts
        intermediate, hidden = linear.outputs[0] // tp, linear.outputs[1]
        weights = e * 3 * intermediate * hidden * FP8_BYTES
        if block is not None:
            bn, bk = block
            w13 = 2 * ceil_div(intermediate, bn) * ceil_div(hidden, bk)
            scales = e * (w13 + ceil_div(hidden, bn) * ceil_div(intermediate, bk))
        else:
            scales = e * 2 + e
        return weights, (scales + (2 * e if static else 0)) * SCALE_BYTES
    outputs, inputs = partition(model, linear, tp)
    out = sum(outputs)
    weights = out * inputs * FP8_BYTES
    scales = ceil_div(out, block[0]) * ceil_div(inputs, block[1]) if block is not None else len(outputs)
    return weights, (scales + (len(outputs) if static else 0)) * SCALE_BYTES


def fp8_module_bytes(model: ModelArch, linear: QuantLinear, checkpoint: Fp8Checkpoint, tp: int) -> int:
    """The module's bytes on one rank: its fp8 weights and its scales."""
    return sum(fp8_module_parts(model, linear, checkpoint, tp))


def vllm_fp8_tensors(endpoint: Endpoint, model: ModelArch, checkpoint: Fp8Checkpoint) -> list[tuple[int, bool]]:
    """What vLLM's load allocates on one rank, module by module in the model's order, as ``(bytes, fp8)``: the
    embedding, each layer's quantizable modules (an FP8 module's weight, then its scales; an ignored one whole at
    the model's dtype) and the rest of the layer at the model's dtype (norms, the DeltaNet's conv1d and scalars, the
    router and gates, biases), the final norm, the LM head."""
    tp = endpoint.inference.tensor_parallel_size
    dtype = MODEL_DTYPE_BYTES[endpoint.inference.model_dtype]
    h = model.hidden_size
    out: list[tuple[int, bool]] = [(model.vocab_size * h * dtype // tp, False)]
    for index in range(model.num_layers):
        linears = layer_linears(model, index)
        for linear in linears:
            if checkpoint.ignores(index, linear.shards):
                out.append((linear.parameters() * dtype // tp, False))
            else:
                weights, scales = fp8_module_parts(model, linear, checkpoint, tp)
                out += [(weights, True), (scales, True)]
        rest = model.layer_parameter_count(index) - sum(linear.parameters() for linear in linears)
        out.append((rest * dtype // tp, False))
    out.append((h * dtype // tp, False))
    if not model.tied_embeddings:
        out.append((model.vocab_size * h * dtype // tp, False))
    return out


@dataclass(frozen=True)
class Fp8Weights:
    """One engine worker's weights under an FP8 checkpoint: the FP8 modules' bytes, and the model-dtype rest."""

    fp8_bytes: int
    model_dtype_bytes: int
    quantized_parameters: int

    @property
    def total(self) -> int:
        return self.fp8_bytes + self.model_dtype_bytes


def fp8_weights(endpoint: Endpoint, model: ModelArch, checkpoint: Fp8Checkpoint) -> Fp8Weights:
    """The worker's weights under ``checkpoint``: the sums of ``vllm_fp8_tensors``."""
    tensors = vllm_fp8_tensors(endpoint, model, checkpoint)
    quantized = sum(
        linear.parameters()
        for index in range(model.num_layers)
        for linear in layer_linears(model, index)
        if not checkpoint.ignores(index, linear.shards)
    )
    fp8 = sum(nbytes for nbytes, is_fp8 in tensors if is_fp8)
    return Fp8Weights(fp8, sum(nbytes for nbytes, is_fp8 in tensors if not is_fp8), quantized)


def vllm_weights_bytes(endpoint: Endpoint, model: ModelArch) -> int | None:
    """The worker's weights when vLLM serves an FP8 checkpoint (``schema/quantization.py``), else None."""
    checkpoint = fp8_checkpoint(endpoint, model)
    return None if checkpoint is None else fp8_weights(endpoint, model, checkpoint).total


def vllm_load_tensors(endpoint: Endpoint, model: ModelArch) -> list[int] | None:
    """The tensors vLLM's load allocates on one rank for an FP8 checkpoint (``vllm_fp8_tensors``), None without."""
    checkpoint = fp8_checkpoint(endpoint, model)
    if checkpoint is None:
        return None
    return [nbytes for nbytes, _ in vllm_fp8_tensors(endpoint, model, checkpoint) if nbytes]


SYNC_BLOCK = (128, 128)
"""SkyRL's FP8 weight sync's blocks (``SerializedFp8Config.weight_block_size``)."""


def fp8_sync_tensors(model: ModelArch, dtype: int) -> list[int]:
    """What SkyRL 0.4.0's FP8 weight sync streams, tensor by tensor in the model's order
    (``weight_sync/fp8/vllm_format.py``: ``iter_serialized_fp8_tensors``): every weight its Qwen3.5 spec quantizes
    (``qwen35.py``: ``is_quantizable_weight_shape``: q, k, v, o; the MLP's and shared expert's gate, up, down; the
    DeltaNet's in_proj_qkv, in_proj_z, out_proj) as fp8 then its fp32 ``weight_scale_inv`` of 128x128 blocks
    (``blockwise_cast_to_fp8``); the routed experts batched per projection, ``[E, I, H]`` in fp8 with ``[E,
    ceil(I / 128), ceil(H / 128)]`` scales (``iter_batched_moe_expert_fp8_tensors``); everything else cast to the
    model's dtype (the embedding, LM head, norms, in_proj_b/in_proj_a, conv1d, the DeltaNet's scalars, the router,
    the shared-expert gate). Only models SkyRL has a spec for get here (``schema/quantization.fp8_refusal``)."""
    bn, bk = SYNC_BLOCK
    h = model.hidden_size

    def fp8(rows: int, cols: int, batch: int = 1) -> list[int]:
        return [batch * rows * cols * FP8_BYTES, batch * ceil_div(rows, bn) * ceil_div(cols, bk) * SCALE_BYTES]

    out = [model.vocab_size * h * dtype]
    for index, kind in enumerate(model.layer_types):
        if kind == "linear_attention":
            la = model.linear_attention
            assert la is not None
            conv_channels = 2 * la.qk_width + la.v_width
            out += fp8(2 * la.qk_width + la.v_width, h) + fp8(la.v_width, h)  # in_proj_qkv, in_proj_z
            out += [la.num_value_heads * h * dtype] * 2  # in_proj_b, in_proj_a
            out += [conv_channels * la.conv_kernel * dtype]
            out += [la.num_value_heads * dtype, la.num_value_heads * dtype, la.value_head_dim * dtype]
            out += fp8(h, la.v_width)
        else:
            out += fp8(model.q_width, h) + fp8(model.kv_width, h) + fp8(model.kv_width, h)
            out += fp8(h, model.attention_out_width)
            out += [model.head_dim * dtype, model.head_dim * dtype]
        if model.is_moe_layer(index):
            moe = model.moe
            assert moe is not None
            out += router_tensors(model, dtype)
            i, e = moe.expert_ffn_hidden_size, moe.num_experts
            out += fp8(i, h, e) + fp8(i, h, e) + fp8(h, i, e)  # gate, up (the batched gate_up split), down
            if moe.shared_expert_ffn_hidden_size:
                s = moe.shared_expert_ffn_hidden_size
                out += fp8(s, h) + fp8(s, h) + fp8(h, s)
            if moe.shared_expert_gate:
                out.append(h * dtype)
        else:
            out += fp8(model.ffn_hidden_size, h) + fp8(model.ffn_hidden_size, h) + fp8(h, model.ffn_hidden_size)
        out += [h * dtype, h * dtype]
    out.append(h * dtype)
    if not model.tied_embeddings:
        out.append(model.vocab_size * h * dtype)
    return out


def sync_tensors(endpoint: Endpoint, model: ModelArch, dtype: int) -> list[int]:
    """What a merged weight sync streams: SkyRL's FP8 wire when vLLM serves an FP8 checkpoint (the only way a merged
    sync reaches one), else every parameter at the model's dtype (``weight_tensors.model_tensors``)."""
    if fp8_checkpoint(endpoint, model) is not None and not endpoint.adapter_weight_sync:
        return fp8_sync_tensors(model, dtype)
    return model_tensors(model, dtype)

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

FP8_BYTES = 1
"""``torch.float8_e4m3fn``: one byte an element."""
SCALE_BYTES = 4
"""The scales' dtype: float32 (``create_fp8_scale_parameter``; e8m0 scales only where a checkpoint asks for them)."""

def fp8_module_bytes(model: ModelArch, linear: QuantLinear, checkpoint: Fp8Checkpoint, tp: int) -> int:
    """What ``Fp8LinearMethod.create_weights`` or ``Fp8MoEMethod.create_weights`` registers for the module on one
    rank (module doc): the fp8 weight, its scales, and static input scales."""
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
        return weights + (scales + (2 * e if static else 0)) * SCALE_BYTES
    outputs, inputs = partition(model, linear, tp)
    out = sum(outputs)
    weights = out * inputs * FP8_BYTES
    scales = ceil_div(out, block[0]) * ceil_div(inputs, block[1]) if block is not None else len(outputs)
    return weights + (scales + (len(outputs) if static else 0)) * SCALE_BYTES


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
    """The worker's weights under ``checkpoint`` (module doc)."""
    tp = endpoint.inference.tensor_parallel_size
    dtype = MODEL_DTYPE_BYTES[endpoint.inference.model_dtype]
    fp8 = quantized = 0
    for index in range(model.num_layers):
        for linear in layer_linears(model, index):
            if checkpoint.ignores(index, linear.shards):
                continue
            fp8 += fp8_module_bytes(model, linear, checkpoint, tp)
            quantized += linear.parameters()
    return Fp8Weights(fp8, (model.parameter_count() - quantized) * dtype // tp, quantized)


def vllm_weights_bytes(endpoint: Endpoint, model: ModelArch) -> int | None:
    """The worker's weights when vLLM serves an FP8 checkpoint (``schema/quantization.py``), else None."""
    checkpoint = fp8_checkpoint(endpoint, model)
    return None if checkpoint is None else fp8_weights(endpoint, model, checkpoint).total

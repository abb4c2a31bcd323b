"""The vision tower's weights on one vLLM worker: what ``Qwen3_VisionTransformer`` registers, module by module.

vLLM builds the tower (``vllm/model_executor/models/qwen3_vl.py``: ``Qwen3_VisionTransformer.__init__``) before the
language model (``qwen3_5.py``: ``Qwen3_5ForConditionalGeneration.__init__``) at the model's dtype, and skips it when
every modality's limit is 0 (``interfaces.py``: ``_mark_tower_model``; ``language_model_only`` sets every limit to 0,
``config/multimodal.py``: ``MultiModalConfig.get_limit_per_prompt``). Under the default ``mm_encoder_tp_mode``
``weights`` (``MultiModalConfig``; SkyRL 0.4.0 does not set it) its linears are TP-sharded like the language model's
(``is_vit_use_data_parallel`` false: ``disable_tp`` off). ``data`` (every rank holds them whole) is not modelled.

Per block (``Qwen3_VisionBlock``): two LayerNorms (weight and bias, replicated), ``attn.qkv`` (``QKVParallelLinear``,
bias; ``Qwen2_5_VisionAttention``), ``attn.proj`` (``RowParallelLinear``, bias), ``mlp.linear_fc1``
(``ColumnParallelLinear``, bias) and ``mlp.linear_fc2`` (``RowParallelLinear``, bias; ``Qwen3_VisionMLP``). Once:
``patch_embed.proj`` (``Conv3dLayer`` with bias, replicated), ``pos_embed`` (``nn.Embedding``, replicated), the
merger (``Qwen3_VisionPatchMerger``: a LayerNorm, ``linear_fc1`` column-parallel 4C -> 4C, ``linear_fc2``
row-parallel 4C -> the language model's width, both with bias) and one such merger per deepstack index (its norm over
4C: ``use_postshuffle_norm``). A column-parallel bias is split over TP, a row-parallel bias is whole on every rank.

FP8: each linear is built with the model's ``quant_config`` (``prefix=...visual.blocks.N.attn.qkv``); the ones the
checkpoint's ignore list names stay at the model's dtype, the rest take ``Fp8LinearMethod.create_weights``'s fp8 weight
and fp32 scales (``fp8_weights.fp8_module_parts``). Biases, norms, the patch embedding and the position embedding are
never quantized. Rotary tables are buffers, not counted (``get_rope``: under 2 MB).
"""

from __future__ import annotations

from skyrl_sim.api import (
    MODEL_DTYPE_BYTES,
    Endpoint,
    Fp8Checkpoint,
    ModelArch,
    QuantLinear,
    VisionTower,
    fp8_checkpoint,
    vision_tower,
)
from skyrl_sim_plugins.sim.service.inference.fp8_weights import fp8_module_parts


def tower_built(endpoint: Endpoint, model: ModelArch) -> VisionTower | None:
    """The tower vLLM builds for this endpoint, None when the model has none or vLLM runs the language model only."""
    if endpoint.vllm_language_model_only:
        return None
    return vision_tower(model.extra)


def tower_linears(tower: VisionTower) -> list[tuple[str, QuantLinear, bool]]:
    """``(module, linear, bias)`` for every linear of the tower in build order (module doc), by vLLM's names."""
    h, i, m = tower.hidden_size, tower.intermediate_size, tower.merged_width
    out: list[tuple[str, QuantLinear, bool]] = []

    def add(name: str, outputs: tuple[int, ...], inputs: int, split: str) -> None:
        out.append((name, QuantLinear(name, (name,), outputs, inputs, split), True))  # type: ignore[arg-type]

    for block in range(tower.depth):
        prefix = f"visual.blocks.{block}"
        add(f"{prefix}.attn.qkv", (h, h, h), h, "column")  # heads split over TP, q, k, v alike (no GQA)
        add(f"{prefix}.attn.proj", (h,), h, "row")
        add(f"{prefix}.mlp.linear_fc1", (i,), h, "column")
        add(f"{prefix}.mlp.linear_fc2", (h,), i, "row")
    mergers = ["visual.merger"] + [f"visual.deepstack_merger_list.{k}" for k in range(tower.deepstack_mergers)]
    for merger in mergers:
        add(f"{merger}.linear_fc1", (m,), m, "column")
        add(f"{merger}.linear_fc2", (tower.out_hidden_size,), m, "row")
    return out


def replicated_parameters(tower: VisionTower) -> int:
    """The parameters every rank holds whole: the patch embedding (Conv3d weight and bias), the position embedding,
    each block's two LayerNorms, each merger's LayerNorm (4C wide after the shuffle for a deepstack merger)."""
    h = tower.hidden_size
    patch = h * tower.patch_inputs + h
    norms = tower.depth * 2 * 2 * h + 2 * h + tower.deepstack_mergers * 2 * tower.merged_width
    return patch + tower.num_position_embeddings * h + norms


def vision_tensors(endpoint: Endpoint, model: ModelArch) -> list[tuple[int, bool]]:
    """What vLLM allocates for the tower on one rank, as ``(bytes, fp8)`` in build order (module doc); empty when it
    builds none."""
    tower = tower_built(endpoint, model)
    if tower is None:
        return []
    dtype = MODEL_DTYPE_BYTES[endpoint.inference.model_dtype]
    tp = endpoint.inference.tensor_parallel_size  # mm_encoder_tp_mode "weights", vLLM's default
    checkpoint = fp8_checkpoint(endpoint, model)
    out: list[tuple[int, bool]] = [(replicated_parameters(tower) * dtype, False)]
    for name, linear, _bias in tower_linears(tower):
        width = sum(linear.outputs)
        bias = width // tp if linear.split == "column" else width
        if checkpoint is None or checkpoint_ignores(checkpoint, name):
            out.append((linear.parameters() // tp * dtype, False))
        else:
            weights, scales = fp8_module_parts(model, linear, checkpoint, tp)
            out += [(weights, True), (scales, True)]
        out.append((bias * dtype, False))
    return out


def checkpoint_ignores(checkpoint: Fp8Checkpoint, module: str) -> bool:
    """Whether the checkpoint's ignore list names a tower module (``model.visual...`` or ``visual...``)."""
    return checkpoint.ignores(None, (module,))


def vision_weights_bytes(endpoint: Endpoint, model: ModelArch) -> int:
    """The tower's bytes on one vLLM worker (0 without one): the sum of ``vision_tensors``."""
    return sum(nbytes for nbytes, _ in vision_tensors(endpoint, model))

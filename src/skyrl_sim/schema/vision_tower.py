"""The vision tower of a multimodal checkpoint, as vLLM builds it beside the language model.

Qwen3.5/3.6 checkpoints (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``) carry a
``vision_config``; vLLM builds its ``Qwen3_VisionTransformer`` (``vllm/model_executor/models/qwen3_vl.py``) before
the language model (``qwen3_5.py``: ``Qwen3_5ForConditionalGeneration.__init__``, ``self.visual`` under
``_mark_tower_model``) unless every modality's limit is 0 (``language_model_only``, or ``limit_mm_per_prompt`` all 0:
``interfaces.py``: ``_mark_tower_model`` puts a ``StageMissingLayer`` in its place). The multi-token-prediction head
(``mtp.*``) is never loaded without speculative decoding (``hf_to_vllm_mapper`` maps ``mtp.`` to None).

The tower's dimensions are the config's ``vision_config`` keys vLLM reads. The presets carry Qwen's published tower
(``QWEN35_VISION``); an HF ``config.json`` carries its own (``architecture.from_hf_config`` keeps it in
``ModelArch.extra``). The trainer's side keeps its own count (``ModelArch.vision_params``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VISION_KEY = "vision_config"
"""Where a model keeps its checkpoint's vision tower config (``ModelArch.extra``)."""

QWEN35_VISION: dict[str, Any] = {
    # The 27-block, 1,152-wide tower of Qwen3.5/3.6 (9B and larger): hidden 1,152, depth 27, 16 heads, MLP 4,304,
    # patch 16, a learned 48 x 48 position grid (2,304), temporal patch 2, 2 x 2 spatial merge, no deepstack mergers
    # and a merger projecting to the language model's width (huggingface/pytorch-image-models PR #2765 and issue
    # #2764, which load the tower from the released checkpoints' vision_config: "1152 / 27 / 16 / 4304 ...
    # .qwen3_5_27b (5120)"). out_hidden_size is the language model's hidden size (the preset sets it).
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "num_position_embeddings": 2304,
}


QWEN_IMAGE_MAX_PIXELS = 16_777_216
"""The image processor's pixel cap (``preprocessor_config.json``: ``size.longest_edge``, a pixel count) of Qwen's
Qwen3-VL-family checkpoints: 16,777,216 (QwenLM/Qwen3-VL issue #1836 quotes Qwen3-VL-8B-Instruct's file). Assumed for
Qwen3.5/3.6, whose checkpoints use the same ``Qwen3VLProcessor`` (vLLM: ``Qwen3_5ProcessingInfo`` derives from
``Qwen3VLProcessingInfo``); vLLM's largest dummy image has ``longest_edge / (patch_size x spatial_merge_size)**2``
tokens (``qwen2_vl.py``: ``get_image_size_with_most_features``, ``get_max_image_tokens``). The video processor's cap
(Qwen3-VL: 25,165,824 over two frames, 12,288 tokens) is below it, so the image is the modality vLLM profiles."""


@dataclass(frozen=True)
class VisionTower:
    """The ``vision_config`` sizes ``Qwen3_VisionTransformer.__init__`` reads."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int
    out_hidden_size: int
    deepstack_mergers: int = 0  # len(deepstack_visual_indexes): Qwen3-VL has them, Qwen3.5/3.6 none
    image_max_pixels: int = QWEN_IMAGE_MAX_PIXELS

    @property
    def max_image_tokens(self) -> int:
        """The largest image's tokens after the merge (``Qwen2VLProcessingInfo.get_max_image_tokens``)."""
        return self.image_max_pixels // (self.patch_size * self.spatial_merge_size) ** 2

    @property
    def merged_width(self) -> int:
        """The merger's input: ``spatial_merge_size**2`` patches side by side (``Qwen3_VisionPatchMerger``)."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def patch_inputs(self) -> int:
        """One patch's pixels: ``in_channels x temporal_patch_size x patch_size**2`` (the Conv3d's kernel)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


QWEN3_VISION_ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
"""The architectures whose vLLM class builds ``Qwen3_VisionTransformer`` (``qwen3_5.py``, ``qwen3_vl.py``,
``qwen3_vl_moe.py``). Another multimodal config's tower (Qwen2.5-VL's windowed one, LLaVA's CLIP...) is not this one:
its ``vision_config`` is not read, and vLLM's side counts the language model only (``docs/sampling.md``)."""


def builds_qwen3_vision_tower(config: dict[str, Any]) -> bool:
    """Whether an HF ``config.json``'s ``architectures`` name a model whose vLLM class builds the Qwen3-VL tower."""
    listed = config.get("architectures")
    return isinstance(listed, list) and bool(listed) and listed[0] in QWEN3_VISION_ARCHITECTURES


def _size(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise ValueError(f"'vision_config.{key}' must be a positive integer, got {value!r}")
    return value


def vision_tower(extra: dict[str, Any]) -> VisionTower | None:
    """The tower a model's ``extra["vision_config"]`` describes, None when it has none (a text-only model or a
    config whose vision block lacks ``depth``/``hidden_size``: not a Qwen3-VL-style tower)."""
    config = extra.get(VISION_KEY)
    if not isinstance(config, dict) or "depth" not in config or "hidden_size" not in config:
        return None
    hidden = _size("hidden_size", config["hidden_size"])
    deepstack = config.get("deepstack_visual_indexes") or []
    if not isinstance(deepstack, list):
        raise ValueError("'vision_config.deepstack_visual_indexes' must be a list")
    keys = ("intermediate_size", "num_heads", "patch_size", "temporal_patch_size", "spatial_merge_size",
            "in_channels", "num_position_embeddings", "out_hidden_size")
    missing = [key for key in keys if key not in config]
    if missing:
        raise ValueError(f"'vision_config' has no {', '.join(missing)} (vLLM's Qwen3_VisionTransformer reads them)")
    sizes = {key: _size(key, config[key]) for key in keys}
    if hidden % sizes["num_heads"]:
        raise ValueError(f"'vision_config.num_heads' {sizes['num_heads']} does not divide hidden_size {hidden}")
    return VisionTower(_size("depth", config["depth"]), hidden, deepstack_mergers=len(deepstack), **sizes)

"""Which FP8 checkpoint vLLM serves, read from the endpoint and its model, and the combinations SkyRL and vLLM refuse.

A user states an FP8 vLLM the way vLLM is told one:

* ``inference.quantization: fp8`` is vLLM's own ``quantization`` engine argument (``--quantization``; SkyRL passes it
  through ``engine_init_kwargs``, and sets it itself for its FP8 weight sync). ``null`` (the default) is vLLM's
  default: the checkpoint's own ``quantization_config`` decides (``vllm/config/model.py``:
  ``ModelConfig._verify_quantization`` reads ``quant_method`` from the HF config).
* The checkpoint's ``quantization_config`` (an HF ``config.json``'s, or a preset's ``{preset: name,
  quantization_config: {...}}``) gives its layout: ``quant_method: fp8``, ``weight_block_size`` (block-wise scales;
  absent: per-tensor), ``activation_scheme`` (``dynamic`` or ``static``) and the modules left in the model's dtype
  (``ignored_layers``, else ``modules_to_not_convert``: ``Fp8Config.from_config``,
  ``model_executor/layers/quantization/fp8.py``).
* ``inference.quantization: fp8`` on a model with no ``quantization_config`` means the model's FP8 checkpoint in the
  layout both Qwen's FP8 releases and SkyRL's FP8 weight sync use (``skyrl/backends/skyrl_train/weight_sync/fp8/
  vllm_format.py``: ``get_serialized_fp8_quantization_config``): 128x128 blocks, dynamic activation scales, and a
  gated-DeltaNet layer's small ``in_proj_b``/``in_proj_a`` left unquantized (``models/qwen35.py``:
  ``get_qwen35_fp8_ignored_layers``; Qwen's FP8 checkpoints leave them out too).

What the setting means for the rest of the deployment, from SkyRL 0.4.0's code (``fp8_refusal``):

* **A full-weight sync** (Megatron's default ``merge_lora: true``, or full fine-tuning) reaches an FP8 vLLM only
  through SkyRL's FP8 weight sync (``generator.inference_engine.fp8_weight_sync_mode: blockwise``), which quantizes
  each merged weight to FP8 with block scales on the trainer and loads both into vLLM's FP8 parameters. SkyRL's plain
  sync casts to ``model_dtype`` and would overwrite FP8 parameters without their scales. That path requires
  ``trainer.strategy: megatron`` and a model with a registered FP8 spec, Qwen3.5/3.6 only (``train/utils/utils.py``:
  ``validate_cfg``; ``weight_sync/fp8/models/``); any other full-weight sync to an FP8 vLLM is refused here. The
  pre-0.4.0 revision modelled (``pr1874``) is refused too: its FP8 sync was not read.
* **LoRA adapters** (Megatron with ``merge_lora: false``, or LoRA on FSDP) leave the base weights alone: vLLM serves
  the adapters over FP8 base layers (``vllm/lora/layers/base_linear.py`` applies the base layer's quant method), and
  the FP8 weights stay the checkpoint's. SkyRL's FP8 weight sync itself refuses adapter sync ("FP8 weight sync
  requires full-weight updates"), which does not apply: the checkpoint, not the sync, is FP8.
* **The trainer** trains the dequantized model at ``trainer.params_dtype`` as before.

Families whose FP8 weights are not counted (multi-latent attention, sliding-window and sink attention) are refused
with ``inference.quantization: fp8``; their configs' own ``quantization_config`` keeps the model-dtype count, an upper
bound (``network_keys``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.vision_tower import vision_tower

if TYPE_CHECKING:
    from skyrl_sim.schema.endpoint import Endpoint

QUANTIZATION_KEY = "quantization_config"
"""Where a model keeps its checkpoint's quantization config (``ModelArch.extra``)."""
DEFAULT_BLOCK = (128, 128)
"""The block layout of an FP8 checkpoint that states none: Qwen's FP8 releases and SkyRL's FP8 weight sync."""
FP8_SYNC_SPEC_NOTE = "SkyRL 0.4.0 registers an FP8 sync spec for Qwen3.5/3.6 only (weight_sync/fp8/models/qwen35.py)"


@dataclass(frozen=True)
class Fp8Checkpoint:
    """An FP8 checkpoint as vLLM's ``Fp8Config`` reads it."""

    weight_block_size: tuple[int, int] | None
    """``[block_n, block_k]``: one fp32 ``weight_scale_inv`` per block; None: per-tensor ``weight_scale``."""
    activation_scheme: Literal["dynamic", "static"]
    """``static``: one fp32 ``input_scale`` per logical shard; ``dynamic``: computed per step, nothing stored."""
    ignored_layers: tuple[str, ...]
    """Module names left in the model's dtype (vLLM matches them exactly, shard by shard)."""
    source: str
    """Where the layout comes from: the model's ``quantization_config`` or the default layout."""

    @cached_property
    def _ignored_by_layer(self) -> tuple[dict[int, frozenset[str]], frozenset[str]]:
        """The ignore list parsed once: per decoder layer the module paths after ``layers.N.``, and the entries
        naming no layer."""
        by_layer: dict[int, set[str]] = {}
        rest = set()
        for entry in self.ignored_layers:
            match = LAYER_ENTRY.search(entry)
            if match is None:
                rest.add(entry)
            else:
                by_layer.setdefault(int(match.group(1)), set()).add(match.group(2))
        return {k: frozenset(v) for k, v in by_layer.items()}, frozenset(rest)

    def ignores(self, layer: int | None, shards: tuple[str, ...]) -> bool:
        """Whether every checkpoint shard of a module (``linear_attn.in_proj_b``...) of decoder layer ``layer`` is
        in the ignore list (``quant_utils.is_layer_skipped``: a fused module is skipped when its shards are; vLLM
        refuses a module with some shards skipped and some not, and so does this). Entries match whatever prefix
        precedes ``layers.N.`` (``model.``, ``model.language_model.``)."""
        by_layer, rest = self._ignored_by_layer
        if layer is None:
            hits = [any(e == shard or e.endswith("." + shard) for e in rest) for shard in shards]
        else:
            names = by_layer.get(layer, frozenset())
            hits = [shard in names for shard in shards]
        if any(hits) and not all(hits):
            raise ValueError(
                f"the quantization_config ignores some but not all shards of layer {layer}'s "
                f"{'/'.join(shards)}: vLLM refuses a fused module quantized in part (is_layer_skipped)"
            )
        return all(hits)


LAYER_ENTRY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
"""An ignore-list entry naming a decoder layer's module: ``<prefix>layers.<N>.<module path>``."""


def _block(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {value!r}")
    return (value[0], value[1])


def default_ignored_layers(model: ModelArch) -> tuple[str, ...]:
    """A gated-DeltaNet layer's ``in_proj_b`` and ``in_proj_a`` (``in_proj_ba`` fused) in every linear-attention
    layer, and each vision block's ``attn.proj``, ``mlp.linear_fc1`` and ``mlp.linear_fc2`` (their widths stop being
    128-divisible once TP-sharded), as SkyRL's ``get_qwen35_fp8_ignored_layers`` lists them (blockwise wire)."""
    names = []
    for index, kind in enumerate(model.layer_types):
        if kind == "linear_attention":
            names += [f"model.layers.{index}.linear_attn.{shard}" for shard in ("in_proj_b", "in_proj_a", "in_proj_ba")]
    tower = vision_tower(model.extra)
    for block in range(tower.depth if tower is not None else 0):  # SkyRL's _QWEN35_VISION_BLOCK_PREFIX_TEMPLATES
        names += [f"model.visual.blocks.{block}.{name}" for name in ("attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    return tuple(names)


def model_quantization(model: ModelArch) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as the model carries it (None when it has none)."""
    config = model.extra.get(QUANTIZATION_KEY)
    return config if isinstance(config, dict) else None


def fp8_checkpoint(endpoint: Endpoint, model: ModelArch) -> Fp8Checkpoint | None:
    """The FP8 checkpoint the endpoint's vLLM serves, or None when its weights are in the model's dtype. Raises
    ScenarioError (key ``inference.quantization``; the caller adds the file) where vLLM refuses the statement, or the
    family's FP8 weights are not counted."""
    stated = endpoint.inference.quantization
    config = model_quantization(model)
    method = None if config is None else str(config.get("quant_method", ""))
    if config is not None and stated is not None and method != stated:
        raise ScenarioError(
            "",
            "inference.quantization",
            f"Quantization method specified in the model config ({method}) does not match the quantization method "
            f"specified in the `quantization` argument ({stated}): vLLM refuses to start "
            "(vllm/config/model.py: ModelConfig._verify_quantization)",
        )
    if method != "fp8" and stated != "fp8":
        return None
    if not fp8_counted(model):
        if stated is None:
            return None  # the config's own fp8: counted at model dtype, an upper bound (network_keys)
        raise ScenarioError(
            "",
            "inference.quantization",
            "FP8 weights are counted for dense, MoE and gated-DeltaNet models; this model's multi-latent, "
            "sliding-window or sink attention layers are not listed module by module",
        )
    if config is None:
        return Fp8Checkpoint(DEFAULT_BLOCK, "dynamic", default_ignored_layers(model), "default layout (128x128)")
    try:
        block = _block(config.get("weight_block_size"))
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"Unsupported activation scheme {scheme}")  # Fp8Config.__init__, vLLM's words
        if block is not None and scheme != "dynamic":
            raise ValueError(  # Fp8Config.__init__
                "The block-wise quantization only supports dynamic activation scheme for now, but got "
                f"{scheme} activation scheme."
            )
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        if not isinstance(ignored, list) or not all(isinstance(name, str) for name in ignored):
            raise ValueError("quantization_config.ignored_layers must be a list of module names")
    except ValueError as exc:
        raise ScenarioError("", "model.quantization_config", str(exc)) from None
    return Fp8Checkpoint(block, scheme, tuple(ignored), "the model's quantization_config")


Split = Literal["column", "row", "qkv", "experts"]


@dataclass(frozen=True)
class QuantLinear:
    """One vLLM module of a decoder layer that can take the FP8 method: its name, its checkpoint shards (what an
    ignore list names), its logical output widths and input width, and how tensor parallelism splits it."""

    name: str
    shards: tuple[str, ...]
    outputs: tuple[int, ...]
    inputs: int
    split: Split
    experts: int = 0  # routed experts (``split == "experts"``): outputs are (2 x I, H), inputs unused

    def parameters(self) -> int:
        """The module's weight parameters, unsplit."""
        if self.split == "experts":
            intermediate, hidden = self.outputs
            return self.experts * 3 * intermediate * hidden
        return sum(self.outputs) * self.inputs


def layer_linears(model: ModelArch, index: int) -> list[QuantLinear]:
    """The modules of decoder layer ``index`` built with the model's ``quant_config`` (module doc), by vLLM's names."""
    h = model.hidden_size
    out: list[QuantLinear] = []
    if model.layer_types[index] == "linear_attention":
        la = model.linear_attention
        assert la is not None
        qk, v, nv = la.qk_width, la.v_width, la.num_value_heads
        if la.fused_in_proj_checkpoint:  # Qwen3-Next: one fused shard each (create_qkvz_proj, create_ba_proj)
            fused = ("linear_attn.in_proj_qkvz",)
            out.append(QuantLinear("linear_attn.in_proj_qkvz", fused, (2 * qk + 2 * v,), h, "column"))
            out.append(QuantLinear("linear_attn.in_proj_ba", ("linear_attn.in_proj_ba",), (2 * nv,), h, "column"))
        else:  # Qwen3.5/3.6: [key, key, value, value] and [nv, nv], loaded from split checkpoint tensors
            qkvz = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z")
            out.append(QuantLinear("linear_attn.in_proj_qkvz", qkvz, (qk, qk, v, v), h, "column"))
            ba = ("linear_attn.in_proj_b", "linear_attn.in_proj_a")
            out.append(QuantLinear("linear_attn.in_proj_ba", ba, (nv, nv), h, "column"))
        out.append(QuantLinear("linear_attn.out_proj", ("linear_attn.out_proj",), (h,), v, "row"))
    else:
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        out.append(QuantLinear("self_attn.qkv_proj", qkv, (model.q_width, model.kv_width, model.kv_width), h, "qkv"))
        out.append(QuantLinear("self_attn.o_proj", ("self_attn.o_proj",), (h,), model.attention_out_width, "row"))
    if model.is_moe_layer(index):
        moe = model.moe
        assert moe is not None
        out.append(
            QuantLinear("mlp.experts", ("mlp.experts",), (moe.expert_ffn_hidden_size, h), 0, "experts", moe.num_experts)
        )
        shared = moe.shared_expert_ffn_hidden_size
        if shared:
            gate_up = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
            out.append(QuantLinear("mlp.shared_expert.gate_up_proj", gate_up, (shared, shared), h, "column"))
            down = ("mlp.shared_expert.down_proj",)
            out.append(QuantLinear("mlp.shared_expert.down_proj", down, (h,), shared, "row"))
    else:
        ffn = model.ffn_hidden_size
        out.append(QuantLinear("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), (ffn, ffn), h, "column"))
        out.append(QuantLinear("mlp.down_proj", ("mlp.down_proj",), (h,), ffn, "row"))
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def partition(model: ModelArch, linear: QuantLinear, tp: int) -> tuple[tuple[int, ...], int]:
    """``(output_partition_sizes, input_size_per_partition)`` of a dense module on one rank (vLLM's linear layers)."""
    if linear.split == "row":
        return linear.outputs, linear.inputs // tp
    if linear.split == "qkv":  # QKVParallelLinear: heads per rank, KV heads replicated past their number
        kv_heads = max(1, model.num_kv_heads // tp)
        kv = kv_heads * (linear.outputs[1] // model.num_kv_heads)
        return (linear.outputs[0] // tp, kv, kv), linear.inputs
    return tuple(width // tp for width in linear.outputs), linear.inputs


def check_block_shapes(model: ModelArch, checkpoint: Fp8Checkpoint, tp: int) -> None:
    """vLLM's refusals of a block-wise checkpoint's modules (``fp8_utils.validate_fp8_block_shape``, and
    ``validate_fp8_block_shape_moe`` for the experts), and of a module whose shards are ignored in part: raises
    ValueError with vLLM's words. A merged module with a shard that is not a multiple of ``block_n`` skips the check
    (``LinearBase._maybe_allow_fp8_block_shape_mismatch``, in every version modelled)."""
    block = checkpoint.weight_block_size
    for index in range(model.num_layers):
        for linear in layer_linears(model, index):
            if checkpoint.ignores(index, linear.shards) or block is None:
                continue
            bn, bk = block
            if linear.split == "experts":
                intermediate = linear.outputs[0] // tp
                if intermediate % bn or (tp > 1 and intermediate % bk):
                    raise ValueError(
                        f"layer {index}'s experts: the weight output_size_per_partition {intermediate} is not "
                        f"divisible by weight quantization block_n = {bn} (validate_fp8_block_shape_moe)"
                    )
                continue
            outputs, inputs = partition(model, linear, tp)
            if len(outputs) > 1 and any(size % bn for size in outputs):
                continue  # LinearBase._maybe_allow_fp8_block_shape_mismatch: a merged module's ragged shards pass
            if tp > 1 and linear.split == "row" and inputs % bk:
                raise ValueError(
                    f"layer {index}'s {linear.name}: Weight input_size_per_partition = {inputs} is not divisible by "
                    f"weight quantization block_k = {bk} (validate_fp8_block_shape)"
                )
            if tp > 1 and linear.split != "row" and outputs[0] % bn:
                raise ValueError(
                    f"layer {index}'s {linear.name}: Weight output_partition_size = {outputs[0]} is not divisible by "
                    f"weight quantization block_n = {bn} (validate_fp8_block_shape)"
                )


def fp8_counted(model: ModelArch) -> bool:
    """Whether the model's FP8 weights are counted module by module: no multi-latent attention, no sliding-window
    or sink attention layers (their vLLM modules are not listed here)."""
    return model.mla is None and not model.attention_sinks and "sliding_attention" not in model.layer_types


def is_qwen35_family(model: ModelArch) -> bool:
    """Qwen3.5/3.6's layout (gated-DeltaNet layers with split ``in_proj_qkv/z/b/a``), the one model SkyRL 0.4.0's FP8
    weight sync has a spec for (``is_qwen35_config``: model types ``qwen3_5*``)."""
    la = model.linear_attention
    return la is not None and not la.fused_in_proj_checkpoint


def fp8_refusal(endpoint: Endpoint, model: ModelArch) -> ScenarioError | None:
    """Why vLLM or SkyRL cannot run this endpoint with an FP8 vLLM (None when they can): vLLM's block-shape
    checks, then SkyRL's weight sync (see the module doc)."""
    checkpoint = fp8_checkpoint(endpoint, model)
    if not endpoint.runs_vllm or checkpoint is None:
        return None
    key = "inference.quantization"
    try:
        check_block_shapes(model, checkpoint, endpoint.inference.tensor_parallel_size)
    except ValueError as exc:
        return ScenarioError("", key, f"vLLM refuses the FP8 checkpoint: {exc}")
    if endpoint.adapter_weight_sync:
        return None
    if not endpoint.rules.fp8_weight_sync:
        reason = (
            f"a full-weight sync to an FP8 vLLM on SkyRL {endpoint.skyrl_version}: the FP8 weight sync modelled is "
            "SkyRL 0.4.0's (fp8_weight_sync_mode); this revision's was not read"
        )
        return ScenarioError("", key, reason)
    if endpoint.trainer.strategy != "megatron":
        reason = (
            "a full-weight sync reaches an FP8 vLLM only through SkyRL's FP8 weight sync, and SkyRL refuses it "
            "without Megatron: \"FP8 weight sync requires trainer.strategy='megatron'\" (skyrl/train/utils/utils.py: "
            "validate_cfg); its plain sync casts to model_dtype and would overwrite FP8 weights without their scales"
        )
        return ScenarioError("", key, reason)
    if not is_qwen35_family(model):
        reason = (
            "a full-weight sync reaches an FP8 vLLM only through SkyRL's FP8 weight sync, which needs a registered "
            f"model spec: {FP8_SYNC_SPEC_NOTE}; sync LoRA adapters instead (lora.merge_lora false) or serve the "
            "model unquantized"
        )
        return ScenarioError("", key, reason)
    return None


def uncounted_quantization_note(endpoint: Endpoint, model: ModelArch) -> str | None:
    """A line saying that vLLM's weights are counted at ``inference.model_dtype`` although the checkpoint is
    quantized (None when they are counted as the checkpoint holds them, or no vLLM runs): the model's
    ``quantization_config`` names a method other than fp8 (mxfp4, awq, ...), or fp8 on a family whose FP8 modules are
    not listed (``fp8_checkpoint`` returns None for both). vLLM loads such a checkpoint in its own format
    (``ModelConfig._verify_quantization``), so the weights, and what they take from the KV budget, are an upper bound:
    ``check`` says so rather than pass it in silence."""
    config = model_quantization(model)
    if config is None or not endpoint.runs_vllm or endpoint.inference.quantization is not None:
        return None
    method = str(config.get("quant_method", "")) or "(no quant_method)"
    if method == "fp8" and fp8_counted(model):
        return None
    why = (
        "this family's FP8 modules (multi-latent, sliding-window or sink attention) are not listed"
        if method == "fp8"
        else "only fp8 checkpoints are counted module by module"
    )
    return (
        f"model quantization_config quant_method {method}: vLLM's weights are counted at inference.model_dtype "
        f"({endpoint.inference.model_dtype}), an upper bound of the checkpoint's ({why}); the KV cache is a lower bound"
    )

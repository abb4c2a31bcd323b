"""Model architectures: the layers the memory model, the time model and the real backend walk.

An architecture comes from a shipped preset (by name) or from a Hugging Face ``config.json``. Only what changes memory,
time or the real backend's model is kept: sizes of every linear, which layers are full attention, sliding-window
attention or gated-DeltaNet linear attention, multi-latent attention's low-rank widths (DeepSeek-V2/V3, Kimi K2,
GLM-4.7-Flash), the MoE layout (DeepSeek-style dense first layers and shared experts included), the vocabulary, and
whether embeddings are tied. A ``config.json`` key known to change the network that this reader does not model is
refused (``network_keys``), never dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.documents import load_json_file
from skyrl_sim.schema.limits import MAX_MODEL_DIM, MAX_MODEL_LAYERS
from skyrl_sim.schema.network_keys import MODELLED_FAMILIES, refuse_unmodelled
from skyrl_sim.schema.vision_tower import QWEN35_VISION, VISION_KEY, builds_qwen3_vision_tower, vision_tower

LayerKind = Literal["full_attention", "linear_attention", "sliding_attention"]
LAYER_KINDS: tuple[LayerKind, ...] = ("full_attention", "linear_attention", "sliding_attention")
"""``sliding_attention``: softmax attention over the last ``ModelArch.sliding_window`` tokens only (gpt-oss, Gemma's
``layer_types``); the trainer computes it like full attention with a banded mask, vLLM keeps only the window's blocks."""


@dataclass(frozen=True)
class MlaDims:
    """Multi-latent attention widths (megatron-core ``MLATransformerConfig``; HF DeepSeek-V2/V3 config keys).

    The query is projected down to ``q_lora_rank`` and up to ``heads x (qk_nope_head_dim + qk_rope_head_dim)``
    (``q_lora_rank`` 0: projected straight from the hidden state, DeepSeek-V2-Lite); the key and value are one
    compressed latent ``kv_lora_rank`` wide plus a shared rotary key ``qk_rope_head_dim`` wide, up-projected to
    ``heads x (qk_nope_head_dim + v_head_dim)``. vLLM caches only the latent and the rotary key per token and layer."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    @property
    def q_head_dim(self) -> int:
        """A query's (and a key's) width per head: the no-position part and the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """What ``linear_kv_down_proj`` makes per token: the compressed kv and the rotary key (vLLM's cached vector)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def parameters(self, hidden: int, heads: int) -> int:
        """The attention block's weights (megatron-core ``MLASelfAttention.__init__``): the q down and up projections
        with the q norm between them (or one ``linear_q_proj``), the kv down projection, the kv norm, the kv up
        projection, the output projection."""
        q = heads * self.q_head_dim
        rank = self.q_lora_rank
        query = hidden * rank + rank + rank * q if rank else hidden * q
        kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        kv = hidden * self.latent_width + self.kv_lora_rank + kv_up
        return query + kv + heads * self.v_head_dim * hidden


@dataclass(frozen=True)
class LinearAttentionDims:
    """Gated-DeltaNet (Qwen3.5/3.6 linear attention) widths."""

    num_key_heads: int
    key_head_dim: int
    num_value_heads: int
    value_head_dim: int
    conv_kernel: int
    fused_in_proj_checkpoint: bool = False
    """The HF checkpoint stores the input projection as two fused tensors (``in_proj_qkvz``, ``in_proj_ba``:
    Qwen3-Next) rather than ``in_proj_qkv/z/b/a`` (Qwen3.5/3.6): SkyRL 0.4.0 then leaves ``in_proj`` out of
    ``all-linear`` LoRA (``gdn_in_proj_lora_is_safe``)."""
    ssm_state_dtype: str = "auto"
    """The config's ``mamba_ssm_dtype`` (Qwen3.5/3.6 set ``float32``): the dtype vLLM keeps the recurrent state in
    when ``inference.mamba_ssm_cache_dtype`` is ``auto`` (``Qwen3_5ForConditionalGenerationConfig``); ``auto``: the
    model's dtype."""

    @property
    def qk_width(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def v_width(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def in_proj_width(self) -> int:
        """q, k, v, the output gate z, and the per-head beta and decay (a) scalars."""
        return 2 * self.qk_width + 2 * self.v_width + 2 * self.num_value_heads


SSM_STATE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The recurrent-state dtypes a config's ``mamba_ssm_dtype`` may name (vLLM's ``MambaDType``)."""


@dataclass(frozen=True)
class MoeDims:
    """Mixture-of-experts layout of the MLP blocks."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()  # empty = every layer
    router_bias: bool = False
    """A per-expert router bias (DeepSeek-V3's ``e_score_correction_bias`` under ``noaux_tc``, gpt-oss's router bias):
    ``num_experts`` parameters per MoE layer, nothing more."""
    shared_expert_gate: bool = False
    """Qwen's gated shared expert (Qwen1.5/Qwen2-MoE, Qwen3-Next, Qwen3.5/3.6 MoE): a ``Linear(hidden, 1)`` per MoE
    layer whose sigmoid scales the shared expert's output (HF ``Qwen2MoeSparseMoeBlock.shared_expert_gate``,
    megatron-core's ``SharedExpertMLP`` with ``moe_shared_expert_gate``): ``hidden`` parameters per MoE layer, and in
    training the gate's score and the shared expert's ungated output kept for backward. DeepSeek-style shared experts
    have no gate. No HF config key names it: ``from_hf_config`` sets it for the Qwen model types whose MoE block builds
    it (``QWEN_GATED_SHARED_EXPERT``) when ``shared_expert_intermediate_size`` is positive. Needs shared experts."""


@dataclass(frozen=True)
class ModelArch:
    """One decoder-only model as the simulator sees it."""

    name: str
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = False
    attention_output_gate: bool = False
    layer_types: tuple[LayerKind, ...] = ()
    linear_attention: LinearAttentionDims | None = None
    moe: MoeDims | None = None
    mla: MlaDims | None = None
    sliding_window: int = 0
    """Tokens a ``sliding_attention`` layer attends to (its own included); 0 when the model has none."""
    attention_sinks: bool = False
    """A learned sink logit per head joins each softmax (gpt-oss): ``heads`` parameters per layer, no activation."""
    attention_bias: bool = False
    """Biases on the q, k, v and output projections (gpt-oss): their widths in parameters, no activation."""
    vision_params: int = 0
    source: str = "preset"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self._check_sizes()
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if "linear_attention" in self.layer_types and self.linear_attention is None:
            raise ValueError("linear_attention layers need linear_attention dimensions")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ValueError("sliding_attention layers need a sliding_window of at least one token")

    def _check_sizes(self) -> None:
        """Every size a positive integer within the limits (a preset override or an HF config can hold anything)."""
        sizes: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
        }
        for key in ("linear_attention", "moe", "mla"):
            dims = getattr(self, key)
            if dims is not None and not isinstance(dims, (LinearAttentionDims, MoeDims, MlaDims)):
                raise ValueError(f"{key} must be a mapping of sizes")
            if dims is not None:
                for sub, value in vars(dims).items():
                    if sub in SWITCHES and not isinstance(value, bool):
                        raise ValueError(f"model {key}.{sub} must be true or false, got {value!r}")
                    if sub == "ssm_state_dtype" and value not in SSM_STATE_DTYPES:
                        raise ValueError(f"model {key}.{sub} must be one of {', '.join(SSM_STATE_DTYPES)}, got {value!r}")
                    if sub not in ("moe_layers", "ssm_state_dtype", *SWITCHES):
                        sizes[f"{key}.{sub}"] = value
        sizes["sliding_window"] = self.sliding_window
        for key, value in sizes.items():
            limit = MAX_MODEL_LAYERS if key == "num_layers" else MAX_MODEL_DIM
            zero_ok = key in ("moe.shared_expert_ffn_hidden_size", "mla.q_lora_rank", "sliding_window")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"model {key} must be an integer, got {value!r}")
            if not (0 if zero_ok else 1) <= value <= limit:
                raise ValueError(f"model {key} must be between {0 if zero_ok else 1} and {limit:,}, got {value:,}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model num_kv_heads {self.num_kv_heads} does not divide num_attention_heads {self.num_attention_heads}"
            )
        if self.moe is not None and self.moe.top_k > self.moe.num_experts:
            raise ValueError(f"model moe.top_k {self.moe.top_k} is more than moe.num_experts {self.moe.num_experts}")
        if self.moe is not None and self.moe.shared_expert_gate and not self.moe.shared_expert_ffn_hidden_size:
            raise ValueError(
                "model moe.shared_expert_gate is true but moe.shared_expert_ffn_hidden_size is 0: the gate scales a "
                "shared expert's output, so it needs one"
            )
        for flag in ("tied_embeddings", "attention_output_gate", "attention_sinks", "attention_bias"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"model {flag} must be true or false, got {getattr(self, flag)!r}")
        if not isinstance(self.name, str) or not isinstance(self.extra, dict):
            raise ValueError("model name must be a string")
        if not isinstance(self.vision_params, int) or isinstance(self.vision_params, bool) or self.vision_params < 0:
            raise ValueError(f"model vision_params must be a non-negative integer, got {self.vision_params!r}")

    @property
    def q_width(self) -> int:
        """Query projection width (doubled when the query carries an output gate; MLA: the up-projected query)."""
        if self.mla is not None:
            return self.num_attention_heads * self.mla.q_head_dim
        width = self.num_attention_heads * self.head_dim
        return 2 * width if self.attention_output_gate else width

    @property
    def kv_width(self) -> int:
        """One of K and V's widths (MLA: the up-projected key, as wide as the query)."""
        if self.mla is not None:
            return self.num_attention_heads * self.mla.q_head_dim
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        """The query's, key's and value's widths together (MLA: after the up projections)."""
        if self.mla is not None:
            return self.num_attention_heads * (2 * self.mla.q_head_dim + self.mla.v_head_dim)
        return self.q_width + 2 * self.kv_width

    @property
    def attention_out_width(self) -> int:
        """The core attention's output width, the output projection's input (MLA: heads x ``v_head_dim``)."""
        if self.mla is not None:
            return self.num_attention_heads * self.mla.v_head_dim
        return self.num_attention_heads * self.head_dim

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """Every field, ``extra`` included, as one hashable value: the key of any cache whose result depends on the
        model. The dataclass's own equality leaves ``extra`` out (it holds free-form config keys), but the memory walk
        reads some of them (``qk_layernorm``, ``position_embedding``), so keying a cache on the model alone or on a
        few of its fields (its name) would hand one model's result to another. A plain property (not cached): a cached
        value would land in ``__dict__``, which callers copy into ``ModelArch(**...)``."""
        values = [getattr(self, f.name) for f in fields(self) if f.name != "extra"]
        return (*values, json.dumps(self.extra, sort_keys=True, default=repr))

    def is_moe_layer(self, index: int) -> bool:
        if self.moe is None:
            return False
        return not self.moe.moe_layers or index in self.moe.moe_layers

    def parameter_count(self) -> int:
        """Text-model parameters (embedding, every layer, final norm, output layer)."""
        h = self.hidden_size
        total = self.vocab_size * h * (1 if self.tied_embeddings else 2) + h
        return total + sum(self.layer_parameter_count(index) for index in range(self.num_layers))

    def layer_parameter_count(self, index: int) -> int:
        """Parameters of decoder layer ``index``: its two norms, its attention block, its MLP (dense or MoE)."""
        h = self.hidden_size
        total = 2 * h  # two norms
        if self.layer_types[index] == "linear_attention":
            la = self.linear_attention
            assert la is not None
            conv_channels = 2 * la.qk_width + la.v_width
            total += h * la.in_proj_width + conv_channels * la.conv_kernel + la.v_width * h
            total += 2 * la.num_value_heads + la.value_head_dim
        elif self.mla is not None:
            total += self.mla.parameters(h, self.num_attention_heads)
        else:
            total += h * self.qkv_width + self.attention_out_width * h + 2 * self.head_dim
            if self.attention_bias:
                total += self.qkv_width + h
            if self.attention_sinks:
                total += self.num_attention_heads
        if self.is_moe_layer(index):
            moe = self.moe
            assert moe is not None
            total += h * moe.num_experts + (moe.num_experts if moe.router_bias else 0)  # router
            total += moe.num_experts * 3 * h * moe.expert_ffn_hidden_size
            total += 3 * h * moe.shared_expert_ffn_hidden_size
            total += h if moe.shared_expert_gate else 0  # the shared expert's gate, Linear(hidden, 1)
        else:
            total += 3 * h * self.ffn_hidden_size
        return total


SWITCHES = ("fused_in_proj_checkpoint", "router_bias", "shared_expert_gate")
"""The true/false fields of the nested dimension records (every other field is a size)."""


def _hybrid(pattern: int, layers: int) -> tuple[LayerKind, ...]:
    """Qwen3.5/3.6 layout: every `pattern`-th layer is full attention, the rest gated DeltaNet."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "linear_attention" for i in range(layers))


BUILT_MODEL_CONTEXT = 32768
"""The context length (``max_position_embeddings``) of the presets the real backend builds (the tiny models,
``mid-dense``, ``seed-shard``): the real backend writes a preset's ``extra["max_position_embeddings"]`` into the HF
config it exports for vLLM (``megatron_vllm/hf_export.py: write_llama_config``; ``fsdp_trainer.py: hf_config``), whose
``max_model_len`` defaults to it (``vllm/config/model.py: _get_and_verify_max_len``), so the simulator and the real
backend admit the same sequences. 32,768 is what that export wrote for them before they carried one (its fallback),
kept so the real backend's vLLM is unchanged."""

PRESETS: dict[str, ModelArch] = {
    # Qwen/Qwen3.6-27B text model (Qwen3_5ForConditionalGeneration); vision tower depth 27, hidden 1,152.
    "qwen3.6-27b": ModelArch(
        name="qwen3.6-27b",
        hidden_size=5120,
        ffn_hidden_size=17408,
        num_layers=64,
        num_attention_heads=24,
        num_kv_heads=4,
        head_dim=256,
        vocab_size=248320,
        attention_output_gate=True,
        layer_types=_hybrid(4, 64),
        # Qwen3.5/3.6 configs set mamba_ssm_dtype float32 (assumed for 3.6-27B: the family's checkpoints carry it)
        linear_attention=LinearAttentionDims(16, 128, 48, 128, 4, ssm_state_dtype="float32"),
        vision_params=460_000_000,
        # text_config.max_position_embeddings 262,144 in Qwen/Qwen3.6-27B's config.json (the model card: "262,144
        # natively"); vLLM's max_model_len defaults to it. The vision tower vLLM builds beside it (vision_tower.py).
        extra={"max_position_embeddings": 262144, VISION_KEY: {**QWEN35_VISION, "out_hidden_size": 5120}},
    ),
    # Qwen/Qwen3-8B, a dense full-attention model.
    "qwen3-8b": ModelArch(
        name="qwen3-8b",
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_layers=36,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        # max_position_embeddings 40,960 in Qwen/Qwen3-8B's config.json (as in the other Qwen3 dense configs);
        # vLLM's max_model_len defaults to it
        extra={"max_position_embeddings": 40960},
    ),
    # Qwen/Qwen3.6-35B-A3B: hybrid attention with 256 routed experts (top 8) and one shared expert per layer.
    "qwen3.6-35b-a3b": ModelArch(
        name="qwen3.6-35b-a3b",
        hidden_size=2048,
        ffn_hidden_size=512,
        num_layers=40,
        num_attention_heads=16,
        num_kv_heads=2,
        head_dim=256,
        vocab_size=248320,
        attention_output_gate=True,
        layer_types=_hybrid(4, 40),
        linear_attention=LinearAttentionDims(16, 128, 32, 128, 4, ssm_state_dtype="float32"),
        # Qwen3_5MoeSparseMoeBlock: the shared expert scaled by sigmoid(shared_expert_gate(x))
        moe=MoeDims(
            num_experts=256,
            top_k=8,
            expert_ffn_hidden_size=512,
            shared_expert_ffn_hidden_size=512,
            shared_expert_gate=True,
        ),
        # 262,144: the model card's "Context Length: 262,144 natively" (Qwen/Qwen3.6-35B-A3B), the value the family's
        # text_config.max_position_embeddings carries (Qwen3.6-27B's config.json). The vision tower: the family's
        # 27-block tower (assumed for 35B-A3B as for Qwen3-VL-30B-A3B, pytorch-image-models PR #2765), its merger
        # projecting to the 2,048-wide language model (vision_tower.py).
        extra={"max_position_embeddings": 262144, VISION_KEY: {**QWEN35_VISION, "out_hidden_size": 2048}},
    ),
    # The tiny dense model the real backend trains on CPU (head dim 32: the smallest vLLM's CPU attention takes).
    "tiny-dense": ModelArch(
        name="tiny-dense",
        hidden_size=128,
        ffn_hidden_size=352,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=512,
        # Llama layout, as the real backend builds it: no q/k norms
        extra={"qk_layernorm": False, "max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
    # A tiny gated-DeltaNet hybrid the real backend trains on CPU (megatron-core's GatedDeltaNet with the CPU kernels of
    # megatron_vllm.gated_delta_rule): three DeltaNet layers then one full-attention layer (Qwen3.5/3.6's pattern), two
    # key heads and four value heads of 32 (the value heads repeat the key heads, as Qwen3.6's 48 over 16 do), no
    # attention output gate (megatron-core's local spec has none), Llama layout for the attention layer.
    "tiny-hybrid": ModelArch(
        name="tiny-hybrid",
        hidden_size=128,
        ffn_hidden_size=352,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=512,
        layer_types=_hybrid(4, 4),
        linear_attention=LinearAttentionDims(2, 32, 4, 32, 4),
        extra={"qk_layernorm": False, "max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
    # A larger tiny model for the CPU memory experiments: long rows make a real out-of-memory reachable in seconds.
    "tiny-wide": ModelArch(
        name="tiny-wide",
        hidden_size=256,
        ffn_hidden_size=1024,
        num_layers=2,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=32,
        vocab_size=4096,
        # Llama layout, as the real backend builds it: no q/k norms
        extra={"qk_layernorm": False, "max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
    # Qwen3-8B's layer shapes cut to 8 layers (~2.8 B parameters): the real backend's mid-size GPU check model.
    "mid-dense": ModelArch(
        name="mid-dense",
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_layers=8,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        extra={"max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
    # What one of the seed endpoint's four TP ranks holds of Qwen3.6-27B, as a dense full-attention model the real
    # backend builds (Llama layout: no output gate, no q/k norms) on one GPU: hidden 5,120, a quarter of the heads
    # (6 of 256, 1 KV group), of the FFN (4,352) and of the vocabulary (62,080), 4 layers
    # (scenarios/endpoints/seed-scale-h200-tp1.yaml says why).
    "seed-shard": ModelArch(
        name="seed-shard",
        hidden_size=5120,
        ffn_hidden_size=4352,
        num_layers=4,
        num_attention_heads=6,
        num_kv_heads=1,
        head_dim=256,
        vocab_size=62080,
        extra={"qk_layernorm": False, "max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
    # tiny-dense with a sliding window of 64 tokens on its first layer (Gemma/gpt-oss-style layer_types): the
    # sliding-window family on CPU, megatron-core's unfused attention masking the window.
    "tiny-swa": ModelArch(
        name="tiny-swa",
        hidden_size=128,
        ffn_hidden_size=352,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=512,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=64,
        # Llama layout, as the real backend builds it: no q/k norms
        extra={"qk_layernorm": False, "max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
    # A tiny multi-latent attention model with DeepSeek-style MoE: a dense first layer, then MoE layers of 8 routed
    # experts (top 2) and one shared expert; the query's and the value's head widths equal (32: 16 without position
    # and 16 rotary), which the flash kernels need. The family's module graph in megatron-core on CPU.
    "tiny-mla-moe": ModelArch(
        name="tiny-mla-moe",
        hidden_size=128,
        ffn_hidden_size=256,
        num_layers=3,
        num_attention_heads=4,
        num_kv_heads=4,
        head_dim=32,
        vocab_size=512,
        mla=MlaDims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=64),
        moe=MoeDims(
            num_experts=8, top_k=2, expert_ffn_hidden_size=64, shared_expert_ffn_hidden_size=64, moe_layers=(1, 2)
        ),
        extra={"qk_layernorm": False, "max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
    # A tiny mixture-of-experts model for the MoE / routed-expert replay scenarios.
    "tiny-moe": ModelArch(
        name="tiny-moe",
        hidden_size=128,
        ffn_hidden_size=256,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=512,
        moe=MoeDims(num_experts=8, top_k=2, expert_ffn_hidden_size=64),
        # Llama layout, as the real backend builds it: no q/k norms
        extra={"qk_layernorm": False, "max_position_embeddings": BUILT_MODEL_CONTEXT},
    ),
}


def size(key: str, value: Any, minimum: int = 1) -> int:
    """A size read from an HF config: a JSON integer of at least ``minimum``. ``"256"``, ``256.9`` and ``true`` are
    refused with the key named (``int()`` would read them as 256, 256 and 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "a string" if isinstance(value, str) else "a boolean" if isinstance(value, bool) else type(value).__name__
        raise ValueError(f"'{key}' must be an integer, got {value!r} ({kind})")
    if value < minimum:
        raise ValueError(f"'{key}' must be at least {minimum}, got {value}")
    return value


def flag(key: str, value: Any) -> bool:
    """A switch read from an HF config: a JSON boolean, absent or null meaning false (``bool("false")`` is true)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"'{key}' must be true or false, got {value!r}")
    return value


def from_hf_config(config: dict[str, Any], name: str) -> ModelArch:
    """Read an HF ``config.json``: dense Qwen/Llama-style, Qwen3-MoE, Mixtral and gpt-oss MoE, a Qwen3.5/3.6 hybrid
    with a text_config, DeepSeek-V2/V3-style MLA and MoE (Kimi K2, GLM-4.7-Flash), sliding-window layers. A key of
    ``network_keys.UNMODELLED`` is refused with its name."""
    if not isinstance(config, dict):
        raise ValueError(f"an HF config must be a JSON object, got {type(config).__name__}")
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise ValueError("the HF config's text_config must be a JSON object")
    refuse_unmodelled(text)
    if text is not config:
        refuse_unmodelled({k: v for k, v in config.items() if k != "text_config"})
    vision = config.get("vision_config")

    def get(key: str, default: Any = None) -> Any:
        if key in text:
            return size(key, text[key], minimum=0 if default == 0 else 1)
        if default is None:
            raise ValueError(f"config has no '{key}'")
        return default

    def opt(key: str, default: int) -> int:
        """An optional size: absent or null reads as ``default``."""
        return default if text.get(key) is None else size(key, text[key], minimum=0 if default == 0 else 1)

    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    layers = get("num_hidden_layers")
    if heads < 1 or layers < 1 or layers > MAX_MODEL_LAYERS:
        raise ValueError(
            f"num_attention_heads ({heads}) must be positive and num_hidden_layers ({layers}) between 1 and "
            f"{MAX_MODEL_LAYERS:,}"
        )
    model_type = str(text.get("model_type", config.get("model_type", "")))
    mla = _hf_mla(text, opt)
    head_dim = mla.q_head_dim if mla is not None else opt("head_dim", hidden // heads) or hidden // heads
    window = _hf_sliding_window(text, opt)
    layer_types = _hf_layer_types(text, layers, window)
    linear: LinearAttentionDims | None = None
    if "linear_attention" in layer_types:
        linear = LinearAttentionDims(
            num_key_heads=get("linear_num_key_heads"),
            key_head_dim=get("linear_key_head_dim"),
            num_value_heads=get("linear_num_value_heads"),
            value_head_dim=get("linear_value_head_dim"),
            conv_kernel=get("linear_conv_kernel_dim", 4),
            # Qwen3-Next's checkpoint fuses the projection (in_proj_qkvz, in_proj_ba); Qwen3.5/3.6 split it.
            fused_in_proj_checkpoint=model_type.startswith("qwen3_next"),
            ssm_state_dtype=_ssm_state_dtype(text.get("mamba_ssm_dtype")),
        )
    moe = _hf_moe(text, layers, get, opt, model_type)
    vision_params = 0
    if isinstance(vision, dict) and "hidden_size" in vision and "depth" in vision:
        vh = size("vision_config.hidden_size", vision["hidden_size"])
        vision_params = size("vision_config.depth", vision["depth"]) * 12 * vh * vh
    ffn = opt("intermediate_size", 0) or get("moe_intermediate_size")
    extra: dict[str, Any] = {}
    if isinstance(text.get("max_position_embeddings"), int) and not isinstance(text["max_position_embeddings"], bool):
        extra["max_position_embeddings"] = text["max_position_embeddings"]
    if text.get("rope_scaling") or text.get("rope_parameters"):  # vLLM may scale the context it derives
        extra["rope_scaling"] = True
    if mla is not None:
        extra["qk_layernorm"] = False  # MLA's q and kv norms are its own (MlaDims); no per-head q/k norms
    if isinstance(vision, dict) and builds_qwen3_vision_tower(config):
        vision_tower({VISION_KEY: vision})  # a tower vLLM cannot build from it is refused here, with its key
        extra[VISION_KEY] = vision  # the tower vLLM builds beside the language model (schema/vision_tower.py)
    quantization = config.get("quantization_config", text.get("quantization_config"))
    if isinstance(quantization, dict):
        extra["quantization_config"] = quantization  # the checkpoint's layout, read by schema/quantization.py
    return ModelArch(
        name=name,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=heads if mla is not None else opt("num_key_value_heads", heads),
        head_dim=head_dim,
        vocab_size=get("vocab_size"),
        tied_embeddings=flag("tie_word_embeddings", config.get("tie_word_embeddings", text.get("tie_word_embeddings"))),
        attention_output_gate=flag("attn_output_gate", text.get("attn_output_gate", _implied_output_gate(text, config))),
        layer_types=layer_types,
        linear_attention=linear,
        moe=moe,
        mla=mla,
        sliding_window=window if "sliding_attention" in layer_types else 0,
        # gpt-oss's attention carries a learned sink per head (HF GptOssAttention.sinks); no config key says so
        attention_sinks=model_type == "gpt_oss",
        attention_bias=flag("attention_bias", text.get("attention_bias")),
        vision_params=vision_params,
        source="hf-config",
        extra=extra,
    )


def _ssm_state_dtype(value: Any) -> str:
    """A config's ``mamba_ssm_dtype``: absent or null reads as ``auto`` (the model's dtype)."""
    if value is None:
        return "auto"
    if value not in SSM_STATE_DTYPES:
        raise ValueError(f"'mamba_ssm_dtype' must be one of {', '.join(SSM_STATE_DTYPES)}, got {value!r}")
    return str(value)


def _implied_output_gate(text: dict[str, Any], config: dict[str, Any]) -> bool | None:
    """Qwen3-Next gates its attention output without saying so: its config has no ``attn_output_gate`` and
    transformers' and vLLM's Qwen3-Next attention default it to true (``Qwen3NextAttention``: ``getattr(config,
    "attn_output_gate", True)``)."""
    return True if str(text.get("model_type", config.get("model_type", ""))).startswith("qwen3_next") else None


def _hf_mla(text: dict[str, Any], opt: Any) -> MlaDims | None:
    """Multi-latent attention's widths when the config has a ``kv_lora_rank`` (DeepSeek-V2/V3, Kimi K2,
    GLM-4.7-Flash); ``q_lora_rank`` null means the query is projected directly (DeepSeek-V2-Lite)."""
    if text.get("kv_lora_rank") is None:
        return None
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if text.get(key) is None:
            raise ValueError(f"a config with 'kv_lora_rank' (multi-latent attention) needs '{key}'")
    return MlaDims(
        kv_lora_rank=opt("kv_lora_rank", 0),
        qk_nope_head_dim=opt("qk_nope_head_dim", 0),
        qk_rope_head_dim=opt("qk_rope_head_dim", 0),
        v_head_dim=opt("v_head_dim", 0),
        q_lora_rank=opt("q_lora_rank", 0),
    )


def _hf_sliding_window(text: dict[str, Any], opt: Any) -> int:
    """The sliding window in tokens, 0 when none is in effect: ``sliding_window`` unless ``use_sliding_window`` is
    false (Qwen2/Qwen3 configs carry a window they do not use)."""
    if text.get("use_sliding_window") is False:
        return 0
    return opt("sliding_window", 0)


def _hf_layer_types(text: dict[str, Any], layers: int, window: int) -> tuple[LayerKind, ...]:
    """Each layer's kind: ``layer_types`` as listed (``sliding_attention`` only where a window is in effect), a
    hybrid's ``full_attention_interval``, or a window's own rule: Qwen2's layers from ``max_window_layers`` on, Gemma's
    ``sliding_window_pattern`` (every pattern-th layer full), else every layer (Mistral)."""
    if "layer_types" in text:
        listed = text["layer_types"]
        if not isinstance(listed, list) or len(listed) != layers:
            raise ValueError(f"'layer_types' must list one kind for each of the {layers} layers")
        kinds: list[LayerKind] = []
        for kind in listed:
            if kind == "linear_attention":
                kinds.append("linear_attention")
            elif kind == "sliding_attention" and window:
                kinds.append("sliding_attention")
            elif kind in ("full_attention", "sliding_attention", "attention"):
                kinds.append("full_attention")
            else:
                raise ValueError(f"'layer_types' entry {kind!r} is not a layer kind the reader models ({MODELLED_FAMILIES})")
        return tuple(kinds)
    if "full_attention_interval" in text:
        return _hybrid(size("full_attention_interval", text["full_attention_interval"]), layers)
    if not window:
        return ()
    if text.get("max_window_layers") is not None:
        first = size("max_window_layers", text["max_window_layers"], minimum=0)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    if text.get("sliding_window_pattern") is not None:
        pattern = size("sliding_window_pattern", text["sliding_window_pattern"])
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers))
    return ("sliding_attention",) * layers


QWEN_GATED_SHARED_EXPERT = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe")
"""HF model types (a prefix of the text config's or the outer config's ``model_type``: ``qwen3_5_moe_text`` too)
whose MoE block gates its shared expert with ``shared_expert_gate``: transformers' ``Qwen2MoeSparseMoeBlock``,
``Qwen3NextSparseMoeBlock``, ``Qwen3_5MoeSparseMoeBlock``, and vLLM's ``Qwen3MoeSparseMoeBlock`` when the config
carries a shared expert. Other families reading ``shared_expert_intermediate_size`` (Bailing, Nemotron-H) have no
gate, nor have DeepSeek's ``n_shared_experts``."""


def _hf_moe(text: dict[str, Any], layers: int, get: Any, opt: Any, model_type: str) -> MoeDims | None:
    """The MoE layout: Qwen3-MoE (``num_experts``, ``decoder_sparse_step``, ``mlp_only_layers``), Mixtral and gpt-oss
    (``num_local_experts``, the experts ``intermediate_size`` wide), DeepSeek (``n_routed_experts``, the first
    ``first_k_dense_replace`` layers dense, then every ``moe_layer_freq``-th, ``n_shared_experts`` shared experts of
    ``moe_intermediate_size`` each, as HF's ``DeepseekV3DecoderLayer`` and megatron-core's ``moe_layer_freq`` build
    them), and whether a Qwen shared expert is gated (``QWEN_GATED_SHARED_EXPERT``). None for a dense model."""
    experts_key = next(
        (k for k in ("num_experts", "n_routed_experts", "num_local_experts") if text.get(k) is not None), None
    )
    experts = opt(experts_key, 0) if experts_key else 0
    if not experts:
        return None
    sparse_step = opt("decoder_sparse_step", 1)
    mlp_only = {size(f"mlp_only_layers.{i}", v, 0) for i, v in enumerate(text.get("mlp_only_layers") or [])}
    first_dense = opt("first_k_dense_replace", 0)
    freq = text.get("moe_layer_freq", 1)
    if isinstance(freq, list):  # megatron-core's pattern form: 1 an MoE layer, 0 a dense one
        if len(freq) != layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
            raise ValueError(f"'moe_layer_freq' as a list must hold a 0 or 1 for each of the {layers} layers")
        pattern = [bool(v) for v in freq]
    else:
        step = size("moe_layer_freq", freq)
        pattern = [i >= first_dense and i % step == 0 for i in range(layers)]
    moe_layers = tuple(
        i for i in range(layers) if pattern[i] and i not in mlp_only and (i + 1) % sparse_step == 0
    )
    if not moe_layers:
        return None
    expert_ffn = opt("moe_intermediate_size", 0) or get("intermediate_size")
    shared = opt("shared_expert_intermediate_size", 0) or opt("n_shared_experts", 0) * expert_ffn
    top_k = get("num_experts_per_tok") if text.get("num_experts_per_tok") is not None else get("experts_per_token")
    gated = model_type.startswith(QWEN_GATED_SHARED_EXPERT) and opt("shared_expert_intermediate_size", 0) > 0
    return MoeDims(
        num_experts=experts,
        top_k=top_k,
        expert_ffn_hidden_size=expert_ffn,
        shared_expert_ffn_hidden_size=shared,
        moe_layers=() if len(moe_layers) == layers else moe_layers,
        # DeepSeek-V3's noaux_tc keeps an e_score_correction_bias per expert; gpt-oss's router has a bias
        router_bias=text.get("topk_method") == "noaux_tc" or model_type == "gpt_oss",
        shared_expert_gate=gated,
    )


def _dims(key: str, value: Any) -> LinearAttentionDims | MoeDims | MlaDims:
    """``linear_attention``, ``moe`` or ``mla`` overrides of a preset: a mapping of sizes (``moe_layers`` a list of
    indices)."""
    if not isinstance(value, dict):
        raise ValueError(f"model {key} must be a mapping of sizes, got {value!r}")
    value = dict(value)
    if key == "moe" and "moe_layers" in value:
        layers = value["moe_layers"]
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError("model moe.moe_layers must be a list of layer indices")
        value["moe_layers"] = tuple(layers)
    try:
        return {"linear_attention": LinearAttentionDims, "moe": MoeDims, "mla": MlaDims}[key](**value)
    except TypeError as exc:
        raise ValueError(f"bad model {key} fields: {exc}") from None


def resolve_model(ref: str | dict[str, Any], base_dir: Path) -> ModelArch:
    """A preset name, ``{config: path}`` to an HF config.json, or ``{preset: name, <field>: value}`` overrides.

    Raises ValueError with a reason a user can act on.
    """
    if isinstance(ref, str):
        if ref not in PRESETS:
            raise ValueError(f"unknown model preset '{ref}' (known: {', '.join(sorted(PRESETS))})")
        return PRESETS[ref]
    if not isinstance(ref, dict):
        raise ValueError("model must be a preset name or a mapping with 'config' or 'preset'")
    ref = dict(ref)
    if "config" in ref:
        path = Path(ref.pop("config"))
        if not path.is_absolute():
            path = base_dir / path
        if ref:
            raise ValueError(f"unknown keys beside 'config': {', '.join(sorted(ref))}")
        try:
            data = load_json_file(path, role="the HF config")
        except ScenarioError as exc:
            raise ValueError(f"HF config {path}: {exc.reason}") from None
        try:
            return from_hf_config(data, name=path.parent.name or path.stem)
        except (TypeError, ValueError, OverflowError, ZeroDivisionError, AttributeError) as exc:
            raise ValueError(f"HF config {path}: {exc}") from None
    if "preset" in ref:
        base = resolve_model(ref.pop("preset"), base_dir)
        if "quantization_config" in ref:  # the checkpoint's layout (schema/quantization.py), kept beside the sizes
            quantization = ref.pop("quantization_config")
            if not isinstance(quantization, dict):
                raise ValueError("model quantization_config must be a mapping (an HF config's quantization_config)")
            base = replace(base, extra={**base.extra, "quantization_config": quantization})
        known = set(base.__dataclass_fields__) - {"extra", "source"}
        unknown = set(ref) - known
        if unknown:
            raise ValueError(f"unknown model fields: {', '.join(sorted(unknown))}")
        if "layer_types" in ref:
            if not isinstance(ref["layer_types"], list) or len(ref["layer_types"]) > MAX_MODEL_LAYERS:
                raise ValueError(f"layer_types must be a list of at most {MAX_MODEL_LAYERS:,} layer kinds")
            if any(kind not in LAYER_KINDS for kind in ref["layer_types"]):
                raise ValueError(f"layer_types entries must be one of {', '.join(LAYER_KINDS)}")
            ref["layer_types"] = tuple(ref["layer_types"])
        elif "num_layers" in ref and ref["num_layers"] != base.num_layers:
            kinds = set(base.layer_types)
            if len(kinds) != 1:
                raise ValueError("a hybrid preset with another num_layers needs its layer_types listed too")
            layers = ref["num_layers"]
            if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_MODEL_LAYERS:
                raise ValueError(f"model num_layers must be an integer between 1 and {MAX_MODEL_LAYERS:,}, got {layers!r}")
            ref["layer_types"] = (kinds.pop(),) * layers
        for key in ("linear_attention", "moe", "mla"):
            if key in ref and ref[key] is not None:
                ref[key] = _dims(key, ref[key])
        try:
            return replace(base, **ref)
        except TypeError as exc:
            raise ValueError(f"bad model fields: {exc}") from None
    raise ValueError("model mapping needs 'config' (path to config.json) or 'preset'")

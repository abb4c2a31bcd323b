"""The public ``config.json`` files of the families SkyRL users train (MLA with DeepSeek-style MoE: GLM-4.7-Flash,
DeepSeek-V3, Kimi K2; sliding-window and sink attention with MoE: gpt-oss) load, and the parameter count each gives
matches the model card's (``scenarios/models/README.md`` says where each file comes from)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from skyrl_sim.schema.architecture import ModelArch, from_hf_config
from skyrl_sim_plugins.sim.service.inference.weight_tensors import mla_tensors, model_tensors

CONFIGS = Path(__file__).parent.parent / "scenarios" / "models"


def load(name: str) -> ModelArch:
    return from_hf_config(json.loads((CONFIGS / name / "config.json").read_text()), name)


# The model cards' totals. DeepSeek-V3: 671B main-model parameters (its 685B on the hub add the 14B MTP module, which
# SkyRL 0.4.0 does not build). gpt-oss: the model card's table (116.83B and 20.91B). GLM-4.7-Flash: "30B-A3B" (the
# hub's 31B counts the MTP layer).
CARDS = {
    "deepseek-v3": 671e9,
    "gpt-oss-120b": 116.83e9,
    "gpt-oss-20b": 20.91e9,
    "glm-4.7-flash": 30e9,
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_the_parameter_count_matches_the_model_card(name: str) -> None:
    count = load(name).parameter_count()
    assert abs(count / CARDS[name] - 1) < 0.005, f"{name}: {count / 1e9:.2f}B against the card's {CARDS[name] / 1e9}B"


def test_kimi_k2_counts_its_trillion() -> None:
    """Kimi K2's card states "1T" (one significant figure) and its technical report about 1.04T; the architecture
    table (61 layers, one dense, 384 experts of 2048, one shared, hidden 7168, vocabulary 160K) sums to 1.026T. The
    card's rounding is looser than the 0.5% the other families meet; what can be held is that the count lies between
    the two stated figures, with the MLA block and the one dense layer read."""
    arch = load("kimi-k2-instruct")
    count = arch.parameter_count()
    assert 1.0e12 <= count <= 1.04e12
    assert arch.mla is not None and arch.mla.q_lora_rank == 1536
    assert arch.moe is not None and not arch.is_moe_layer(0) and arch.is_moe_layer(1)


def test_glm_4_7_flash_reads_as_mla_with_a_dense_first_layer() -> None:
    """Not 20-head MHA at head_dim 64: the MLA widths, the dense first layer of intermediate_size, then 46 MoE layers
    of 64 experts (top 4) with one shared expert of moe_intermediate_size."""
    arch = load("glm-4.7-flash")
    assert arch.mla is not None
    assert (arch.mla.q_lora_rank, arch.mla.kv_lora_rank, arch.mla.q_head_dim, arch.mla.v_head_dim) == (768, 512, 256, 256)
    assert arch.q_width == 20 * 256 and arch.attention_out_width == 20 * 256
    assert arch.moe is not None and not arch.is_moe_layer(0) and all(arch.is_moe_layer(i) for i in range(1, 47))
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.shared_expert_ffn_hidden_size) == (64, 4, 1536)
    assert arch.ffn_hidden_size == 10240 and arch.moe.router_bias


def test_deepseek_v3_has_three_dense_layers() -> None:
    arch = load("deepseek-v3")
    assert [arch.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert arch.layer_parameter_count(0) != arch.layer_parameter_count(3)


def test_gpt_oss_alternates_sliding_and_full_attention() -> None:
    arch = load("gpt-oss-120b")
    assert arch.layer_types[:4] == ("sliding_attention", "full_attention") * 2
    assert arch.sliding_window == 128 and arch.attention_sinks and arch.attention_bias
    assert arch.moe is not None and arch.moe.num_experts == 128 and arch.moe.expert_ffn_hidden_size == 2880


def test_moe_layer_freq_and_first_k_dense_replace_follow_deepseek() -> None:
    """HF's DeepseekV3DecoderLayer: an MoE MLP where ``i >= first_k_dense_replace and i % moe_layer_freq == 0``; a
    list is megatron-core's pattern form."""
    base = {
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 6,
        "vocab_size": 100, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    }
    arch = from_hf_config({**base, "first_k_dense_replace": 1, "moe_layer_freq": 2}, "x")
    assert [arch.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    arch = from_hf_config({**base, "moe_layer_freq": [0, 0, 1, 1, 0, 1]}, "x")
    assert [arch.is_moe_layer(i) for i in range(6)] == [False, False, True, True, False, True]
    assert from_hf_config({**base, "first_k_dense_replace": 6}, "x").moe is None
    shared = from_hf_config({**base, "n_shared_experts": 2}, "x")
    assert shared.moe is not None and shared.moe.shared_expert_ffn_hidden_size == 64


def test_a_window_the_config_does_not_use_is_no_window() -> None:
    """Qwen2/Qwen3 configs carry a ``sliding_window`` with ``use_sliding_window: false``: full attention."""
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 100}
    off = from_hf_config({**base, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 2}, "x")
    assert set(off.layer_types) == {"full_attention"} and off.sliding_window == 0
    on = from_hf_config({**base, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2}, "x")
    assert on.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    mistral = from_hf_config({**base, "sliding_window": 4096}, "x")
    assert set(mistral.layer_types) == {"sliding_attention"}
    gemma = from_hf_config({**base, "sliding_window": 512, "sliding_window_pattern": 2}, "x")
    assert gemma.layer_types == ("sliding_attention", "full_attention") * 2


@pytest.mark.parametrize("name", ["glm-4.7-flash", "gpt-oss-20b"])
def test_the_weight_sync_streams_each_attention_layers_own_weights(name: str) -> None:
    """The separate-GPU weight sync's tensors (``weight_sync.model_tensors``) of an MLA model hold each layer's down
    and up projections and the two latent norms (``MlaDims.parameters``), and a sliding-window layer streams q, k, v
    and o as a full-attention layer does."""
    model = load(name)
    tensors = model_tensors(model, 1)
    assert len(tensors) > model.num_layers
    if model.mla is not None:
        assert sum(mla_tensors(model)) == model.mla.parameters(model.hidden_size, model.num_attention_heads)
    else:
        assert "sliding_attention" in model.layer_types
        h = model.hidden_size
        assert tensors[1:4] == [h * model.q_width, h * model.kv_width, h * model.kv_width]


QWEN3_NEXT = Path(__file__).parent / "data" / "hf_configs" / "qwen3-next-80b-a3b" / "config.json"


def load_any(name: str) -> ModelArch:
    path = QWEN3_NEXT if name == "qwen3-next-80b-a3b" else CONFIGS / name / "config.json"
    return from_hf_config(json.loads(path.read_text()), name)


@pytest.mark.parametrize("name", [*sorted(CARDS), "kimi-k2-instruct", "qwen3-next-80b-a3b"])
def test_the_weight_sync_streams_every_parameter(name: str) -> None:
    """SkyRL's Megatron weight source exports the whole model (``MegatronWeightSource``: ``export_hf_weights``), so
    the tensors a merged sync streams add up to the model's parameters as the static memory counts them: a
    DeepSeek-style MoE layer's ``n_shared_experts x moe_intermediate_size`` shared experts and Qwen's
    ``shared_expert_intermediate_size`` one included, with the latent norms, the DeltaNet's small tensors and the
    router biases."""
    model = load_any(name)
    for dtype in (1, 2):
        assert sum(model_tensors(model, dtype)) == dtype * model.parameter_count()


@pytest.mark.parametrize("name", ["deepseek-v3", "glm-4.7-flash"])
def test_the_weight_sync_streams_the_real_backends_export(name: str) -> None:
    """An MLA MoE model's streamed tensors are the real backend's HF export (``hf_export.hf_shapes``), tensor for
    tensor, plus the routers' score-correction biases (which the small real model has not): the shared experts'
    gate, up and down projections among them."""
    from skyrl_sim_plugins.megatron_vllm.hf_export import hf_shapes

    model = load_any(name)
    assert model.moe is not None and model.moe.shared_expert_ffn_hidden_size > 0
    exported = sorted(math.prod(shape) for shape in hf_shapes(model).values())
    streamed = model_tensors(model, 1)
    moe_layers = sum(map(model.is_moe_layer, range(model.num_layers)))
    biases = [model.moe.num_experts] * (moe_layers if model.moe.router_bias else 0)
    assert sorted(exported + biases) == sorted(streamed)

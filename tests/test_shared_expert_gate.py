"""Qwen's gated shared expert (``MoeDims.shared_expert_gate``): read from HF configs of the Qwen MoE families, counted in
the parameters, streamed by the weight sync, walked in training memory, priced by the time model, built by the real
backend's megatron-core settings and HF export; refused without a shared expert."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from skyrl_sim.schema.architecture import PRESETS, ModelArch, from_hf_config, resolve_model
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.hf_export import from_megatron, hf_shapes, init_hf_weights, to_megatron
from skyrl_sim_plugins.megatron_vllm.model_builder import moe_settings
from skyrl_sim_plugins.sim.description.layer_ops import Setup, Work, moe_block
from skyrl_sim_plugins.sim.description.moe_routes import moe_layer_dims, moe_layer_terms
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, layer_graph
from skyrl_sim_plugins.sim.service.weight_sync import model_tensors

ROOT = Path(__file__).resolve().parent.parent
QWEN3_NEXT = ROOT / "tests" / "data" / "hf_configs" / "qwen3-next-80b-a3b" / "config.json"
MOE_SCENARIO = ROOT / "scenarios" / "moe_r3.yaml"


def qwen3_next() -> dict:
    return json.loads(QWEN3_NEXT.read_text())


def ungated(model: ModelArch) -> ModelArch:
    assert model.moe is not None
    return replace(model, moe=replace(model.moe, shared_expert_gate=False))


def qwen3_next_parameters(c: dict) -> int:
    """Qwen3-Next-80B-A3B's parameters from transformers' ``Qwen3NextForCausalLM`` module by module, written out from
    the config alone: every layer's two norms, a gated-attention layer's q (doubled for the output gate), k, v, o and
    per-head q/k norms, or a gated DeltaNet's fused ``in_proj_qkvz`` and ``in_proj_ba``, conv1d, ``dt_bias``,
    ``A_log``, the value-head norm and ``out_proj``; every MoE block's router, experts, shared expert and
    ``shared_expert_gate`` (``Linear(hidden, 1)``); embeddings, final norm, untied LM head."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    hd, heads, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    full = h * heads * hd * 2 + 2 * h * kv * hd + heads * hd * h + 2 * hd
    nk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    nv, dv = c["linear_num_value_heads"], c["linear_value_head_dim"]
    qkvz = h * (2 * nk * dk + 2 * nv * dv)
    ba = h * 2 * nv
    conv = (2 * nk * dk + nv * dv) * c["linear_conv_kernel_dim"]
    deltanet = qkvz + ba + conv + nv + nv + dv + nv * dv * h
    e, f, s = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    moe = h * e + e * 3 * h * f + 3 * h * s + h  # router, experts, shared expert, shared_expert_gate
    interval = c["full_attention_interval"]
    attention = sum(full if (i + 1) % interval == 0 else deltanet for i in range(layers))
    return 2 * c["vocab_size"] * h + h + layers * (2 * h + moe) + attention


def test_qwen3_next_parameters_are_the_hf_modules_gate_included() -> None:
    config = qwen3_next()
    model = from_hf_config(config, "qwen3-next-80b-a3b")
    assert model.moe is not None and model.moe.shared_expert_gate
    assert model.parameter_count() == qwen3_next_parameters(config)
    assert model.parameter_count() - ungated(model).parameter_count() == config["num_hidden_layers"] * config["hidden_size"]


@pytest.mark.parametrize(
    ("model_type", "outer", "shared", "gated"),
    [
        ("qwen3_next", None, 512, True),
        ("qwen2_moe", None, 5632, True),
        ("qwen3_5_moe_text", "qwen3_5_moe", 512, True),
        ("qwen3_moe", None, 0, False),  # Qwen3-MoE ships without a shared expert
        ("bailing_moe", None, 512, False),  # reads shared_expert_intermediate_size, has no gate
    ],
)
def test_the_gate_is_read_from_the_qwen_model_types(model_type: str, outer: str | None, shared: int, gated: bool) -> None:
    text = {k: v for k, v in qwen3_next().items() if not k.startswith(("linear_", "full_attention"))}
    text.update(model_type=model_type, shared_expert_intermediate_size=shared)
    config = {"model_type": outer, "text_config": text} if outer else text
    model = from_hf_config(config, "x")
    assert model.moe is not None and model.moe.shared_expert_gate is gated


def test_deepseek_shared_experts_have_no_gate() -> None:
    config = {**qwen3_next(), "model_type": "deepseek_v3", "n_shared_experts": 1}
    del config["shared_expert_intermediate_size"]
    model = from_hf_config(config, "x")
    assert model.moe is not None and model.moe.shared_expert_ffn_hidden_size == 512
    assert not model.moe.shared_expert_gate


def test_the_shipped_qwen_moe_preset_is_gated() -> None:
    moe = PRESETS["qwen3.6-35b-a3b"].moe
    assert moe is not None and moe.shared_expert_gate and moe.shared_expert_ffn_hidden_size == 512


@pytest.mark.parametrize(
    ("moe", "reason"),
    [
        ({"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 64, "shared_expert_gate": True}, "needs one"),
        ({"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 64, "shared_expert_gate": "yes"}, "true or false"),
    ],
)
def test_a_gate_without_a_shared_expert_is_refused_naming_the_key(moe: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=rf"moe\.shared_expert_gate.*{reason}"):
        resolve_model({"preset": "tiny-moe", "moe": moe}, ROOT)


def test_the_weight_sync_streams_the_gate_after_the_shared_expert() -> None:
    model = from_hf_config(qwen3_next(), "qwen3-next-80b-a3b")
    h, dtype = model.hidden_size, 2
    streamed, blind = model_tensors(model, dtype), model_tensors(ungated(model), dtype)
    assert sum(streamed) == dtype * model.parameter_count() == dtype * qwen3_next_parameters(qwen3_next())
    assert len(streamed) - len(blind) == model.num_layers
    # layer 0 (a DeltaNet layer): embedding, 6 DeltaNet tensors, router, 3 x 512 experts, 3 shared, the gate, 2 norms
    gate_at = 1 + 6 + 1 + 3 * 512 + 3
    assert streamed[gate_at - 1] == h * 512 * dtype and streamed[gate_at] == h * dtype
    assert blind[gate_at] == h * dtype  # without the gate the first norm sits there
    assert streamed[gate_at + 1 : gate_at + 3] == [h * dtype, h * dtype]


def moe_r3_endpoint(sets: dict | None = None):
    return load_scenario(MOE_SCENARIO).resolve("compact", sets or {}).endpoint


@pytest.mark.parametrize("tp_sp", [False, True])
def test_the_walk_keeps_the_gate_score_and_the_ungated_output(tp_sp: bool) -> None:
    """Qwen3.6-35B-A3B, 4,096 tokens: the gate's product keeps the shared expert's ungated output and the score (on
    the router's shard: half the tokens at TP 2 with sequence parallelism), beyond what the ungated layer keeps."""
    model = PRESETS["qwen3.6-35b-a3b"]
    endpoint = moe_r3_endpoint(None if tp_sp else {"parallelism.sequence_parallel": False})
    d = Dims.of(endpoint, model, 1, 4096, 0)
    local = 2048 if tp_sp else 4096  # TP 2: sequence parallelism shards the router's (and the gate's) tokens
    graphs = {}
    for m in (model, ungated(model)):
        graphs[m.moe.shared_expert_gate] = layer_graph(d, m, "full_attention", True, moe_layer_dims(4096, endpoint, m))
    gated, blind = graphs[True], graphs[False]
    saved = set(gated.saved_storages(grad=True, selective=False))
    added = saved - set(blind.saved_storages(grad=True, selective=False))
    [output] = added - {"mlp.shared_experts.gate_score"}
    assert "mlp.shared_experts.gate_score" in added and output.startswith("mlp.shared_experts.linear_fc2.")
    assert "mlp.shared_experts.gate_logits" not in saved  # the sigmoid keeps its output, not its input
    assert gated.tensors["mlp.shared_experts.gate_score"].shape == (local, 1, 1)

    def saved_bytes(g) -> int:
        return sum(g.tensors[k].nbytes for k in g.saved_storages(grad=True, selective=False))

    ungated_out, score = local * 2048 * 2, local * 2
    assert saved_bytes(gated) - saved_bytes(blind) == ungated_out + score
    terms = moe_layer_terms(4096, endpoint, model)
    assert terms["shared_gate_score"] == score and terms["shared_ungated_out"] == ungated_out
    assert "shared_gate_score" not in moe_layer_terms(4096, endpoint, ungated(model))


def test_the_time_model_prices_the_gate() -> None:
    model = PRESETS["qwen3.6-35b-a3b"]
    endpoint = moe_r3_endpoint()
    setup = Setup.of(endpoint, model=model)
    work = Work(4096.0, 0.0)
    gated = moe_block(model).forward(work, setup, model.hidden_size).ops
    blind = moe_block(ungated(model)).forward(work, setup, model.hidden_size).ops
    [gate] = [op for op in gated if op.name == "shared.gate"]
    assert [op.name for op in gated if op.name != "shared.gate"] == [op.name for op in blind]
    # sequence parallel at TP 2: each rank gates 2,048 tokens, reading the input and the shared output, writing one
    # gated output and a logit and score each
    assert gate.bytes == 2 * 2048 * (3 * 2048 + 4) and gate.flops > 2 * 2048 * 2048


def test_the_real_backend_builds_and_exports_the_gate() -> None:
    base = PRESETS["tiny-moe"]
    assert base.moe is not None
    model = replace(base, moe=replace(base.moe, shared_expert_ffn_hidden_size=64, shared_expert_gate=True))
    assert moe_settings(model, False)["moe_shared_expert_gate"] is True
    assert "moe_shared_expert_gate" not in moe_settings(ungated(model), False)
    shapes = hf_shapes(model)
    assert shapes["model.layers.0.shared_expert_gate.weight"] == (1, 128)
    blind = hf_shapes(ungated(model))
    assert sum(map(math.prod, shapes.values())) - sum(map(math.prod, blind.values())) == 2 * 128  # one per MoE layer
    assert list(shapes).index("model.layers.0.shared_expert_gate.weight") == list(shapes).index(
        "model.layers.0.shared_expert.down_proj.weight"
    ) + 1  # streamed after the shared expert, as weight_sync.model_tensors orders it
    hf = init_hf_weights(model, seed=1)
    shards = [to_megatron(hf, model, 2, rank) for rank in range(2)]
    for shard in shards:  # replicated over TP, not split
        assert shard["decoder.layers.1.mlp.shared_experts.gate_weight"].shape == (1, 128)
    back = from_megatron(shards, model)
    assert set(back) == set(hf)
    assert all(back[name].equal(hf[name]) for name in hf)

"""The one layer description (``sim/layer_ops.py``): the memory walk and the time model read the same ops."""

from __future__ import annotations

from dataclasses import replace

import pytest

from skyrl_sim.schema.architecture import PRESETS, ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.description.layer_ops import (
    CAUSAL_FRACTION,
    Setup,
    Work,
    decoder_layer,
    layer_kind,
    lora_parameter_count,
)
from skyrl_sim_plugins.sim.description.moe_routes import moe_layer_dims
from skyrl_sim_plugins.sim.description.trainers import lora_params_per_rank
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, layer_graph

TARGETS = (["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], ["linear_qkv", "linear_fc2"], ["linear_proj"])
MODULES = {"full_attention": "self_attention", "linear_attention": "self_attention", "sliding_attention": "self_attention"}


def endpoint(model: str, tp: int = 1, targets: list[str] | None = None, **trainer: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": model,
            "hardware": {"profile": "h200", "devices": tp},
            "parallelism": {"tp": tp},
            "lora": {"rank": 8, "targets": targets if targets is not None else TARGETS[0]},
            "trainer": {"micro_train_batch_size_per_gpu": 2, **trainer},
        }
    )


def walk_and_time(model: ModelArch, ep: Endpoint, kind: str, moe: bool) -> tuple[set[str], set[str]]:
    """Op names of one layer in the memory graph and in the time model's forward list."""
    d = Dims.of(ep, model, rows=2, seq=96, logits_width=0)
    terms = moe_layer_dims(d.rows * d.seq, ep, model) if moe else None
    memory = {op.name for op in layer_graph(d, model, kind, moe, terms).ops}
    work = Work(192.0, 2 * 96 * 96 * CAUSAL_FRACTION)
    timed = {op.name for op in layer_kind(model, kind, moe).forward(work, Setup.of(ep)).ops}
    return memory, timed


def layer_keys(model: ModelArch) -> set[tuple[str, bool]]:
    return {(model.layer_types[i], model.is_moe_layer(i)) for i in range(model.num_layers)}


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("targets", TARGETS)
def test_both_models_adapt_the_same_linears_and_build_every_described_linear(name: str, targets: list[str]) -> None:
    model = PRESETS[name]
    ep = endpoint(name, targets=targets)
    for kind, moe in layer_keys(model):
        memory, timed = walk_and_time(model, ep, kind, moe)
        layer = layer_kind(model, kind, moe)
        adapted_in_time = {n.removesuffix(".lora").rpartition(".")[2] for n in timed if n.endswith(".lora")}
        adapted_in_memory = {n.removesuffix(".lora_a").rpartition(".")[2] for n in memory if n.endswith(".lora_a")}
        assert adapted_in_time == adapted_in_memory
        assert adapted_in_time == {linear.name for linear, _ in layer.adapted_linears(targets)}
        for linear in layer.attention.linears:
            assert f"{MODULES[kind]}.{linear.name}.base" in memory and linear.name in timed


@pytest.mark.parametrize("flag", ["rotary", "qk_norm"])
def test_an_optional_op_switched_off_in_the_model_leaves_both_walks(flag: str) -> None:
    base = replace(PRESETS["tiny-dense"], extra={})  # rotary positions and q/k norms, as by default
    extra = {"rotary": {"position_embedding": "none"}, "qk_norm": {"qk_layernorm": False}}[flag]
    ep = endpoint("tiny-dense", layer_spec="local")
    with_op = walk_and_time(base, ep, "full_attention", False)
    without = walk_and_time(replace(base, extra=extra), ep, "full_attention", False)
    memory_name = {"rotary": "self_attention.rotary_q", "qk_norm": "self_attention.q_layernorm"}[flag]
    assert memory_name in with_op[0] and memory_name not in without[0]
    if flag == "rotary":  # the time model prices the rotary embedding only where the layer has one
        assert "rope" in with_op[1] and "rope" not in without[1]


def test_a_width_changed_in_the_model_reaches_both_walks() -> None:
    base = PRESETS["tiny-dense"]
    wide = replace(base, ffn_hidden_size=4 * base.ffn_hidden_size)
    ep = endpoint("tiny-dense", tp=2)
    work, setup = Work(100.0, 0.0), Setup.of(ep)
    for model in (base, wide):
        d = Dims.of(ep, model, rows=1, seq=100, logits_width=0)
        fc1 = next(
            t for t in layer_graph(d, model, "full_attention", False).tensors.values() if t.key == "mlp.linear_fc1.base"
        )
        flops = next(op.flops for op in decoder_layer(model, 0).forward(work, setup).ops if op.name == "linear_fc1")
        assert fc1.shape[-1] == 2 * model.ffn_hidden_size // 2
        assert flops == 2 * 100 * model.hidden_size * 2 * model.ffn_hidden_size / 2


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_adapter_parameters_agree_between_static_memory_and_time_model_on_one_rank(name: str) -> None:
    model = PRESETS[name]
    for targets in TARGETS:
        ep = endpoint(name, targets=targets)
        everything = list(range(model.num_layers))
        assert lora_params_per_rank(model, ep, everything) == lora_parameter_count(model, ep) > 0


@pytest.mark.parametrize("name", ["tiny-dense", "qwen3.6-27b"])
def test_sequence_parallel_gathers_and_scatters_once_per_block_in_both_walks(name: str) -> None:
    model = PRESETS[name]
    ep = Endpoint.model_validate(
        {"model": name, "hardware": {"profile": "h200", "devices": 2}, "parallelism": {"tp": 2, "sequence_parallel": True}}
    )
    for kind, moe in layer_keys(model):
        d = Dims.of(ep, model, rows=1, seq=64, logits_width=0)
        terms = moe_layer_dims(64, ep, model) if moe else None
        memory = [op.name.rpartition(".")[2] for op in layer_graph(d, model, kind, moe, terms).ops]
        timed = [c.kind for c in layer_kind(model, kind, moe).forward(Work(64.0, 0.0), Setup.of(ep)).collectives]
        for collective in ("all_gather", "reduce_scatter"):
            assert memory.count(collective) == timed.count(collective) == 2

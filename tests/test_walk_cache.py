"""The allocation walk's caches: a walker shared across models and endpoints never hands one's result to another."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import PRESETS, MlaDims, ModelArch, MoeDims
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk

LENGTHS = [300, 500, 700]


def tiny_endpoint(model: str | dict[str, Any] = "tiny-dense", **trainer: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": model,
            "hardware": {"profile": "cpu", "device_memory_gib": 64, "reserve_gib": 0, "devices": 1},
            "parallelism": {"tp": 1, "sequence_parallel": False},
            "trainer": {"micro_train_batch_size_per_gpu": 2, **trainer},
        }
    )


def one_change(model: ModelArch, name: str) -> ModelArch:
    """``model`` with only field ``name`` changed (to another valid value)."""
    value = getattr(model, name)
    if name == "extra":
        return replace(model, extra={**value, "qk_layernorm": not value.get("qk_layernorm", True)})
    if name == "num_layers":
        return replace(model, num_layers=value + 1, layer_types=())
    if name == "layer_types":
        return replace(
            model,
            layer_types=("full_attention",) * (model.num_layers - 1) + ("linear_attention",),
            linear_attention=PRESETS["qwen3.6-27b"].linear_attention,
        )
    if name == "moe":
        return replace(model, moe=MoeDims(num_experts=8, top_k=2, expert_ffn_hidden_size=64))
    if name == "linear_attention":
        return replace(model, linear_attention=PRESETS["qwen3.6-27b"].linear_attention)
    if name == "mla":
        return replace(model, mla=MlaDims(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32))
    if name in ("num_attention_heads", "num_kv_heads"):  # doubled: query heads stay a multiple of the KV groups
        return replace(model, **{name: value * 2})
    if isinstance(value, bool):
        return replace(model, **{name: not value})
    if isinstance(value, int):
        return replace(model, **{name: value * 2 + 1})
    if isinstance(value, str):
        return replace(model, **{name: value + "-x"})
    raise AssertionError(f"no change written for ModelArch.{name}: add one here")


@pytest.mark.parametrize("name", [f.name for f in fields(ModelArch)])
def test_models_differing_in_any_one_field_never_share_a_cache_key(name: str) -> None:
    model = PRESETS["tiny-dense"]
    assert one_change(model, name).cache_key != model.cache_key


def walk(walker: AllocationWalk, endpoint: Endpoint, model: ModelArch) -> tuple[int, dict[str, int]]:
    shape = shape_call("forward_backward", LENGTHS, endpoint, MEGATRON)
    report = walker.evaluate(shape, endpoint, model)
    return report.peak_bytes, dict(report.breakdown)


@pytest.mark.parametrize("name", ["ffn_hidden_size", "num_attention_heads", "vocab_size", "extra", "num_kv_heads"])
def test_a_shared_walker_gives_each_model_its_own_result(name: str) -> None:
    """The measured bug: one walker saw a model, then the same model with a wider FFN, and reported the first
    model's saved activations. A shared walker must agree with a fresh one for both."""
    endpoint = tiny_endpoint(layer_spec="local", recompute={"granularity": "none"})  # every field shows in the walk
    first = PRESETS["tiny-dense"]
    second = one_change(first, name)
    shared = AllocationWalk()
    assert walk(shared, endpoint, first) == walk(AllocationWalk(), endpoint, first)
    assert walk(shared, endpoint, second) == walk(AllocationWalk(), endpoint, second)
    assert walk(shared, endpoint, first) != walk(shared, endpoint, second)


def test_ffn_x4_on_qwen3_8b_is_not_served_from_the_cache() -> None:
    """The issue's reproduction: qwen3-8b, then the same preset with ffn_hidden_size x4, on one walker."""
    base = PRESETS["qwen3-8b"]
    wide = replace(base, ffn_hidden_size=base.ffn_hidden_size * 4)
    endpoint = tiny_endpoint("qwen3-8b", recompute={"granularity": "none"})  # the FFN's activations are kept
    endpoint.hardware.device_memory_gib = 1000
    shared = AllocationWalk()
    walk(shared, endpoint, base)
    saved_shared = walk(shared, endpoint, wide)[1]["saved_activations"]
    saved_fresh = walk(AllocationWalk(), endpoint, wide)[1]["saved_activations"]
    assert saved_shared == saved_fresh
    assert saved_fresh > walk(AllocationWalk(), endpoint, base)[1]["saved_activations"]


@pytest.mark.parametrize(
    "trainer",
    [{"recompute": {"granularity": "none"}}, {"fused_lm_head_logprob": False}, {"logprobs_chunk_size": 64}],
)
def test_a_shared_walker_gives_each_endpoint_its_own_result(trainer: dict[str, Any]) -> None:
    model = PRESETS["tiny-dense"]
    first, second = tiny_endpoint(), tiny_endpoint(**trainer)
    shared = AllocationWalk()
    walk(shared, first, model)
    assert walk(shared, second, model) == walk(AllocationWalk(), second, model)

"""Recorded routes for routed-expert replay: the scenario key, the synthetic routes, what the real backend ships."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from skyrl_sim.engine import r3_codec
from skyrl_sim.engine.recorded_routes import captured_tokens, synthetic_routes
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import BatchCall
from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.requests import RecordedRoutes
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.executor import routes_message

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "scenarios" / "moe_r3_tiny.yaml"


def test_synthetic_routes_are_a_seeded_captured_prefix_of_distinct_experts():
    model = PRESETS["tiny-moe"]
    routes = synthetic_routes(RecordedRoutes(seed=7, uncaptured=3), 40, model)
    assert routes.shape == (40 + 1 - 3, 2, 2) and routes.dtype == np.uint8  # 8 experts: uint8 on the wire
    assert (routes[..., 0] != routes[..., 1]).all()  # a router never picks one expert twice
    assert routes.min() >= 0 and routes.max() < 8
    assert np.array_equal(routes, synthetic_routes(RecordedRoutes(seed=7, uncaptured=3), 40, model))
    assert not np.array_equal(routes, synthetic_routes(RecordedRoutes(seed=8, uncaptured=3), 40, model))
    assert len(np.unique(routes[:, 0, 0])) > 4  # spread over the experts
    assert captured_tokens(2, 5) == 0
    wide = synthetic_routes(RecordedRoutes(), 10, PRESETS["qwen3.6-35b-a3b"])
    assert wide.shape == (10, 40, 8) and wide.dtype == np.uint8  # 256 experts still fit uint8
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        synthetic_routes(RecordedRoutes(), 10, PRESETS["tiny-dense"])


def test_routes_on_a_dense_model_or_a_non_pass_are_refused_with_the_key_named(tmp_path):
    text = TINY.read_text()
    dense = tmp_path / "dense.yaml"
    dense.write_text(text.replace("endpoint: tiny-moe-cpu", "endpoint: tiny-cpu-tp1"))
    with pytest.raises(ScenarioError, match=r"workload.clients\[0\].requests\[0\].routed_experts.*no mixture-of-experts"):
        load_scenario(dense).resolve("compact")
    sample = tmp_path / "sample.yaml"
    sample.write_text(text.replace("{type: optim_step, learning_rate: 1.0e-4}", "{type: optim_step, routed_experts: {}}", 1))
    with pytest.raises(ScenarioError, match="optim_step request takes no 'routed_experts'"):
        load_scenario(sample).resolve("compact")


def _call(*requests: Request) -> BatchCall:
    return BatchCall("forward_backward", requests[0].model_id, tuple(requests))


def test_the_real_backend_ships_each_datums_routes_in_the_r3_wire_format():
    variant = load_scenario(TINY).resolve("compact")
    routed = Request(1, "forward_backward", "policy", (30, 12), routed_experts=RecordedRoutes(seed=3, uncaptured=2))
    plain = Request(2, "forward_backward", "policy", (9,))
    message = routes_message(_call(routed, plain), variant.endpoint, variant.model)
    assert message is not None and message[2] is None  # the datum of a request without routes carries none
    first = r3_codec.decode_routes(message[0])  # the strict decoder the workers use
    assert first.shape == (29, 2, 2) and message[0]["dtype"] == "uint8"
    assert np.array_equal(first, synthetic_routes(RecordedRoutes(seed=3, uncaptured=2), 30, variant.model))
    assert routes_message(_call(plain), variant.endpoint, variant.model) is None
    off = load_scenario(TINY).resolve("off")
    assert routes_message(_call(routed), off.endpoint, off.model) is None  # replay off: the routers route themselves


def test_memory_bands_of_moe_and_dense_endpoints_come_from_their_own_family():
    """A validated MoE endpoint measures the MoE walk (routing included): it lends its band to MoE endpoints only, and
    a dense endpoint never borrows it; an EP 2 variant borrows the EP 2 validation."""
    from skyrl_sim.results.band import band_for

    moe = load_scenario(TINY).resolve("compact").endpoint
    assert (band_for(moe, TINY).kind, band_for(moe, TINY).source) == ("validated", "tiny-moe-cpu")
    ep2 = load_scenario(ROOT / "scenarios" / "moe_r3_tiny_ep2.yaml").resolve("compact").endpoint
    assert band_for(ep2, TINY).source == "tiny-moe-cpu-ep2"
    renamed = moe.model_copy(update={"name": "another-moe"})
    assert band_for(renamed, TINY).source == "tiny-moe-cpu"  # the nearest MoE one at EP 1
    dense = load_scenario(ROOT / "scenarios" / "queue_drain_17_tiny.yaml").resolve("no-cap").endpoint
    assert not band_for(dense.model_copy(update={"name": "another-dense"}), TINY).source.startswith("tiny-moe")


def test_a_band_is_borrowed_from_the_same_attention_family_first():
    """An MoE model with plain attention borrows a plain-attention MoE validation before an MLA one, though the MLA
    one's band is wider (the widest wins only among equally near ones): each attention family is walked by its own
    ops."""
    from skyrl_sim.results.band import band_for, model_attention, validated_endpoints

    known = validated_endpoints(TINY)
    assert {v.attention for v in known if v.moe} >= {("full_attention",), ("mla",)}
    plain = load_scenario(TINY).resolve("compact").endpoint.model_copy(update={"name": "another-moe"})
    assert model_attention(plain.model) == ("full_attention",)
    borrowed = band_for(plain, TINY, known)
    assert [v.attention for v in known if v.name == borrowed.source] == [("full_attention",)]
    mla = {v.name: v for v in known}["tiny-mla-moe-cpu"]
    assert mla.fraction > borrowed.fraction  # the wider band, not taken: another family

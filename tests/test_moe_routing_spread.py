"""The spread of a call's tokens over the experts: even, skewed (the busiest expert-parallel rank and its busiest
expert), or the replayed routes'; the walk prices the busiest rank and the call's record says which spread it used."""

from __future__ import annotations

import pytest

from skyrl_sim.api import Endpoint
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim_plugins.sim.description.moe_routes import moe_call_extra, moe_layer_dims, routing_split


def endpoint(ep: int = 2, replay: str = "off", **routing: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "name": "e",
            "model": "tiny-moe",
            "hardware": {"profile": "cpu", "device_memory_gib": 24, "devices": 2},
            "parallelism": {"tp": 1, "dp": 2, "ep": ep},
            "trainer": {"layer_spec": "local", "routed_expert_replay": replay, "moe_routing": routing},
        }
    )


def test_the_default_is_skewed_without_replay_and_the_recorded_spread_with_it() -> None:
    assert endpoint().trainer.routing_spread == "skew"
    assert endpoint(replay="compact").trainer.routing_spread == "recorded"
    assert endpoint(spread="even").trainer.routing_spread == "even"


def test_even_gives_the_rank_its_share() -> None:
    assert routing_split(800, 8, 4, 2, endpoint(spread="even")) == (100, 100, 100, 100)


def test_a_skew_loads_the_busiest_rank_and_its_busiest_expert() -> None:
    split = routing_split(800, 8, 4, 2, endpoint(spread="skew", busiest_rank_share=1.5, busiest_expert_load=3.0))
    assert sum(split) == 600 and split[0] == 300 and split[1:] == (100, 100, 100)


def test_a_skew_is_capped_by_what_routing_can_do() -> None:
    """Every pair on one rank at most, one pair per token per expert at most (pairs / top_k)."""
    split = routing_split(800, 8, 4, 2, endpoint(spread="skew", busiest_rank_share=9.0, busiest_expert_load=99.0))
    assert sum(split) == 800 and split[0] == 400
    # EP 1: the rank holds every pair whatever the spread; only the experts' split moves
    one = routing_split(800, 8, 8, 2, endpoint(ep=1, spread="skew", busiest_expert_load=2.0))
    assert sum(one) == 800 and one[0] == 200


@pytest.mark.parametrize("spread", ["even", "skew"])
def test_the_layer_dims_and_the_record_carry_the_spread(spread: str) -> None:
    e = endpoint(spread=spread)
    dims = moe_layer_dims(256, e, PRESETS["tiny-moe"])
    even = 256 * 2 * 2 * 4 // 8
    assert (dims.pairs > even) == (spread == "skew")
    assert dims.pairs == sum(dims.expert_tokens)


def test_a_skewed_walk_prices_more_than_an_even_one() -> None:
    from skyrl_sim_plugins.sim.description.moe_routes import moe_layer_terms

    model = PRESETS["tiny-moe"]
    skew = sum(moe_layer_terms(512, endpoint(spread="skew"), model).values())
    even = sum(moe_layer_terms(512, endpoint(spread="even"), model).values())
    assert skew > even


def test_the_call_record_names_the_spread() -> None:
    extra_skew = moe_call_extra_for(endpoint(spread="skew", busiest_rank_share=1.4))
    assert extra_skew["routing"] == {"spread": "skew", "busiest_rank_share": 1.4, "busiest_expert_load": 2.0}
    assert moe_call_extra_for(endpoint(spread="even"))["routing"]["spread"] == "even"


def moe_call_extra_for(e: Endpoint) -> dict:
    from skyrl_sim.engine.shapes import MEGATRON, shape_call

    shape = shape_call("forward_backward", [100, 100], e, MEGATRON)
    extra = moe_call_extra(shape, e, PRESETS["tiny-moe"])
    assert extra is not None
    return extra


def test_skewed_recorded_routes_favour_the_weighted_experts() -> None:
    from skyrl_sim.engine.recorded_routes import busiest_shares, expert_pairs, synthetic_routes
    from skyrl_sim.schema.requests import RecordedRoutes

    model = PRESETS["tiny-moe"]
    skewed = RecordedRoutes(seed=1, expert_weights=[4, 4, 2, 2, 1, 1, 1, 1])
    ids = synthetic_routes(skewed, 400, model)
    assert ids.shape == (400, 2, 2) and (ids[:, :, 0] != ids[:, :, 1]).all()  # two distinct experts per token
    counts = expert_pairs([(skewed, 400)], 401, 0, model)
    assert counts[0, :2].sum() > counts[0, 4:6].sum() * 2
    uniform = expert_pairs([(RecordedRoutes(seed=1), 400)], 401, 0, model)
    assert busiest_shares(counts, 2)[0] > busiest_shares(uniform, 2)[0]
    # the padding route (experts 0 and 1) on the positions past each row's routes, and pad rows copying the first
    padded = expert_pairs([(RecordedRoutes(seed=1, uncaptured=3), 10)], 20, 2, model)
    alone = expert_pairs([(RecordedRoutes(seed=1, uncaptured=3), 10)], 20, 0, model)
    assert (padded == 3 * alone).all() and alone[0, :2].sum() >= (20 - 8) * 2


def test_the_simulator_prices_a_call_with_its_recorded_spread() -> None:
    from pathlib import Path

    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.schema.scenario import load_scenario

    scenarios = Path(__file__).resolve().parent.parent / "scenarios"
    skewed = PluginHost().run(load_scenario(scenarios / "moe_r3_tiny_ep2_skewed.yaml").resolve("compact"), "sim")
    even = PluginHost().run(load_scenario(scenarios / "moe_r3_tiny_ep2.yaml").resolve("compact"), "sim")
    trained = [c for c in skewed.calls if c.kind == "forward_backward"]
    assert all(c.extra["moe"]["routing"]["spread"] == "skew" for c in trained)
    assert all(c.extra["moe"]["routing"]["busiest_rank_share"] > 1.3 for c in trained)
    assert all(c.extra["moe"]["routing"]["spread"] == "recorded" for c in even.calls if c.kind == "forward_backward")
    uniform = [c for c in even.calls if c.kind == "forward_backward"]
    assert sum(c.peak_bytes or 0 for c in trained) > sum(c.peak_bytes or 0 for c in uniform)

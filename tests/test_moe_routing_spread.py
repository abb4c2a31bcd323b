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

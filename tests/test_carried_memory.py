"""Memory that lives across calls: megatron-core's persistent attention-scores buffer, carried call to call per rank.

A call after a longer one holds the longer call's buffer; a sequence of calls can fail where each call alone fits,
and the run reports that it fails only in sequence.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.plugin_host.costs import CarriedMemory
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.reports.memory_explain import explain_table
from skyrl_sim.reports.report import sequence_failures
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.reference.allocator import round_allocated

GIB = 2**30


def _variant(endpoint: str = "mid-cuda", sets: dict | None = None):
    scenario = load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", endpoint)
    return scenario.resolve("cap-aware", {"memory_limit_gib": 130, **(sets or {})})


def test_a_call_after_a_longer_one_holds_the_larger_buffer():
    variant = _variant()
    ep, model = variant.endpoint, variant.model
    walk = AllocationWalk()
    long = walk.evaluate(shape_call("forward_backward", [3000], ep, MEGATRON), ep, model)
    short_shape = shape_call("forward_backward", [500], ep, MEGATRON)
    alone = walk.evaluate(short_shape, ep, model)
    after = walk.evaluate(short_shape, ep, model, long.carried)
    heads = model.num_attention_heads
    assert long.carried.total(0) == round_allocated(heads * 3001**2 * 2)  # [1 x heads, s, s] bf16 (s = tokens + 1)
    assert after.carried == long.carried  # a smaller request leaves the buffer as it is
    assert alone.breakdown["persistent_buffers"] == round_allocated(heads * 501**2 * 2)
    assert after.breakdown["persistent_buffers"] == long.carried.total(0)
    grown = long.carried.total(0) - alone.breakdown["persistent_buffers"]
    assert after.peak_bytes - alone.peak_bytes == grown


def test_the_buffer_is_per_rank_and_only_for_unfused_attention():
    variant = _variant(sets={"trainer.attention": "flash"})
    shape = shape_call("forward_backward", [2000], variant.endpoint, MEGATRON)
    report = AllocationWalk().evaluate(shape, variant.endpoint, variant.model)
    assert report.carried == CarriedMemory() and "persistent_buffers" not in report.breakdown
    state = CarriedMemory().with_rank(1, {"mpu": 10}).with_rank(0, {"mpu": 5})
    assert state.held(0) == {"mpu": 5} and state.held(1) == {"mpu": 10} and state.total(1) == 10


def _sequence_scenario(tmp_path: Path, lengths: list[list[int]], limit_gib: float) -> Path:
    """One client, back to back, each entry one forward_backward request (a request with several datums is one
    multi-row call), on mid-cuda with cap 1 and cap-aware padding."""
    data = {
        "name": "carried_sequence",
        "endpoint": str(SCENARIOS / "endpoints" / "mid-cuda.yaml"),
        "workload": {
            "clients": [
                {
                    "name": "c",
                    "model_id": "m",
                    "submit": {"mode": "after_previous"},
                    "requests": [{"type": "forward_backward", "datums": datums} for datums in lengths],
                }
            ]
        },
        "variants": {"seq": {"set": {"memory_limit_gib": limit_gib, "engine.forward_backward_max_request_count": 1,
                                    "engine.cap_aware_padding": True}}},
    }
    path = tmp_path / "carried_sequence.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_sequence_that_fits_call_by_call_can_fail_in_order(tmp_path):
    # A long single row grows the buffer; a wide short call (its peak in the LM head, not the attention) then carries
    # that buffer on top of its own peak. The limit is set from the walk itself: above each call alone, below the
    # short call after the long one.
    variant = _variant()
    ep, model = variant.endpoint, variant.model
    walk = AllocationWalk()
    long_shape = shape_call("forward_backward", [4000], ep, MEGATRON)
    wide_shape = shape_call("forward_backward", [600] * 16, ep, MEGATRON)
    long = walk.evaluate(long_shape, ep, model)
    wide_alone = walk.evaluate(wide_shape, ep, model)
    wide_after = walk.evaluate(wide_shape, ep, model, long.carried)
    assert wide_after.peak_bytes > wide_alone.peak_bytes and wide_after.peak_bytes > long.peak_bytes
    limit = (max(long.peak_bytes, wide_alone.peak_bytes) + wide_after.peak_bytes) / 2 / GIB + ep.hardware.reserve_gib
    scenario = load_scenario(_sequence_scenario(tmp_path, [[4000], [600] * 16], limit))
    result = PluginHost().run(scenario.resolve("seq"), "sim")
    assert [c.oom is None for c in result.calls] == [True, False]
    failed = result.calls[1]
    assert failed.oom.where["fails_only_after_earlier_calls"] is True
    assert failed.oom.where["carried_bytes"] == long.carried.total(0)
    assert sequence_failures(result) and "fails only after earlier calls" in sequence_failures(result)[0]
    assert "fails only because earlier calls left" in explain_table(result)[0].title
    # in the other order both fit: the wide call's smaller buffer is replaced by the long one's
    reversed_path = _sequence_scenario(tmp_path, [[600] * 16, [4000]], limit)
    reverse = PluginHost().run(load_scenario(reversed_path).resolve("seq"), "sim")
    assert all(c.oom is None for c in reverse.calls) and not sequence_failures(reverse)

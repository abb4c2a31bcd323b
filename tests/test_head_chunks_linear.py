"""The LM head's log-prob chunks (one op per ``logprobs_chunk_size`` positions: about 10,000 for a 10M-token row)
are planned in linear work: twice the chunks cost about twice the Python calls, not four times.

Counted, not timed: ``sys.setprofile`` counts every function call the plan makes, which is deterministic."""

from __future__ import annotations

import sys
from pathlib import Path

from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.reference.memory_ops import Dims
from skyrl_sim_plugins.sim.reference.segments import head_specs

ROOT = Path(__file__).resolve().parents[1]


def calls_to_plan(width: int) -> int:
    scenario = load_scenario(ROOT / "scenarios" / "queue_drain_17_tiny.yaml")
    variant = scenario.resolve(scenario.variant_names[0])
    assert not variant.endpoint.trainer.fused_lm_head_logprob  # the chunked log-prob head: one op per chunk
    d = Dims.of(variant.endpoint, variant.model, 1, width, width)
    count = 0

    def counter(frame, event, arg) -> None:  # noqa: ANN001
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    specs = head_specs(d, variant.model)
    sys.setprofile(counter)
    try:
        for spec in specs:
            for recipe in spec.recipes:
                spec.graph.plan(recipe)
    finally:
        sys.setprofile(None)
    return count


def test_planning_the_head_is_linear_in_its_chunks() -> None:
    chunk = 1024
    small, large = calls_to_plan(400 * chunk), calls_to_plan(1600 * chunk)
    assert large < 4.6 * small  # 4x the chunks: linear is ~4x; the per-op scans it replaced made it ~16x

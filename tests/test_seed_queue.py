"""The seed's queue drains, call by call: which requests each call holds and the shapes that reach Megatron."""

from __future__ import annotations

from cost_fakes import FixedCallTime
from project_paths import SCENARIOS
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.backend import SimBackend

SEED_193_TOKENS = 816_247


def passes(result):
    return [c for c in result.calls if c.kind == "forward_backward"]


def test_193_no_cap_blocker_runs_alone_then_one_call_of_193(host):
    # The blocker keeps the engine busy longer than the 193 submissions take (193 x 5 ms after a 0.5 s lead).
    variant = load_scenario(SCENARIOS / "queue_drain_193.yaml").resolve("no-cap")
    result = SimBackend(time=FixedCallTime(3.0)).run(variant, RunContext(host=host, options={}))
    calls = passes(result)
    assert [len(c.request_ids) for c in calls] == [1, 193]
    blocker = result.request(calls[0].request_ids[0])
    assert blocker.tokens == 10_000
    drain = calls[1]
    assert (drain.rows, drain.padded_rows, drain.width, drain.microbatches) == (193, 208, 35_001, 13)
    assert "process_batch_requests(forward_backward, n=193)" in result.log
    assert "Padded batch from 193 to 208 (alignment=16)" in result.log


def test_193_workload_totals_and_repro_slot_count():
    variant = load_scenario(SCENARIOS / "queue_drain_193.yaml").resolve("no-cap")
    totals = variant.workload_totals()
    assert totals == {"requests": 193, "tokens": SEED_193_TOKENS, "unpadded_slots": 193 * 35_000}
    assert totals["unpadded_slots"] == 6_755_000


def test_17_no_cap_warmup_then_sixteen(run_sim):
    result = run_sim("queue_drain_17.yaml", "no-cap")
    calls = passes(result)
    assert [len(c.request_ids) for c in calls] == [1, 16]
    assert calls[0].request_ids == [1]
    assert calls[1].request_ids == list(range(2, 18))
    assert (calls[1].rows, calls[1].padded_rows, calls[1].width, calls[1].microbatches) == (16, 16, 35_001, 1)
    assert result.totals["tokens"] == 101_939


def test_17_cap_only_pads_every_one_row_call_back_to_sixteen(run_sim):
    result = run_sim("queue_drain_17.yaml", "cap-only")
    calls = passes(result)
    assert len(calls) == 17
    assert all(len(c.request_ids) == 1 and c.rows == 1 and c.padded_rows == 16 for c in calls)
    assert result.log.count("Padded batch from 1 to 16 (alignment=16)") == 17
    assert "forward_backward request batch split 16" in result.log


def test_17_cap_aware_never_pads_rows(run_sim):
    result = run_sim("queue_drain_17.yaml", "cap-aware")
    calls = passes(result)
    assert len(calls) == 17
    assert all(c.rows == 1 and c.padded_rows == 1 for c in calls)
    assert not any(line.startswith("Padded batch") for line in result.log)
    long_call = next(c for c in calls if c.width == 35_001)
    assert long_call.request_ids == [9]


def test_requests_keep_arrival_order_and_submission_costs(run_sim):
    result = run_sim("queue_drain_17.yaml", "no-cap")
    submitted = [r.submitted_s for r in result.requests]
    assert submitted == sorted(submitted)
    # back to back after the warm-up: one submission cost apart
    gaps = {round(b - a, 6) for a, b in zip(submitted[1:], submitted[2:], strict=False)}
    assert gaps == {0.001}

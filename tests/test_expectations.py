"""Every ``expect:`` key means what docs/verdict.md says, and nothing is met vacuously: for each key a run that has
the property passes and a run that lacks it fails (``results.expectations.unmet``); an expectation no run of the
workload can meet is bad input (exit 2, naming the key); ``check`` exits 1 on the vacuous forms it used to pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from scenario_text import run_cli, write
from skyrl_sim.errors import UserError
from skyrl_sim.results.expectations import unmet
from skyrl_sim.results.result import CallRecord, OomRecord, RequestRecord, RunResult
from skyrl_sim.schema.expect import Expectations, OomExpectation
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.units import GIB


def run(
    failed: tuple[int, ...] = (),
    calls: list[CallRecord] | None = None,
    requests: int = 5,
    capacity_gib: float | None = 4.0,
    metrics: dict[int, dict[str, float]] | None = None,
    host_peak_gib: float | None = None,
    end_s: float = 5.0,
) -> RunResult:
    """A run of ``requests`` forward_backward requests, one a second, where ``failed`` failed."""
    records = [
        RequestRecord(
            id=i,
            type="forward_backward",
            model_id="m",
            tokens=10,
            submitted_s=0.0,
            started_s=0.0,
            completed_s=end_s * i / requests,
            status="failed" if i in failed else "completed",
            metrics=(metrics or {}).get(i, {}),
        )
        for i in range(1, requests + 1)
    ]
    if calls is None:
        oom = oom_at("forward", "mlp.linear_fc1", 1.0)
        calls = [fb(i, oom=oom if i in failed else None) for i in range(1, requests + 1)]
    tenancy = {} if host_peak_gib is None else {"slot_bytes": 1, "host_bytes_peak": int(host_peak_gib * GIB)}
    capacity = None if capacity_gib is None else int(capacity_gib * GIB)
    return RunResult("s", "v", "sim", "e", calls=calls, requests=records, capacity_bytes=capacity, tenancy=tenancy)


def oom_at(phase: str, op: str, gib: float) -> OomRecord:
    return OomRecord(attempted_bytes=int(gib * GIB), where={"phase": phase, "op": op}, message="out of memory")


def fb(
    request_id: int, padded: int = 1, peak_gib: float | None = 1.0, oom: OomRecord | None = None, swap: bool = False
) -> CallRecord:
    """One forward_backward call of one request."""
    return CallRecord(
        index=request_id - 1,
        kind="forward_backward",
        model_id="m",
        request_ids=[request_id],
        rows=1,
        padded_rows=padded,
        peak_bytes=None if peak_gib is None else int(peak_gib * GIB),
        oom=oom,
        extra={"swap": {"seconds": 0.1, "bytes": 1}} if swap else {},
    )


def no_peaks() -> list[CallRecord]:
    return calls_with(**{f"c{i}": {"peak_gib": None} for i in range(1, 6)})


def calls_with(**changes: Any) -> list[CallRecord]:
    """Five one-request calls, call ``i`` changed by ``changes[f"c{i}"]`` (keyword arguments of ``fb``)."""
    return [fb(i, **changes.get(f"c{i}", {})) for i in range(1, 6)]


OOM_BACKWARD = oom_at("backward", "mlp.linear_fc1.lora_b", 2.0)

# (the key, the expectation, a run that has the property, runs that lack it)
CASES: list[tuple[str, dict[str, Any], RunResult, list[RunResult]]] = [
    ("(none)", {}, run(), [run(failed=(2, 3, 4, 5))]),
    ("all_completed", {"all_completed": True}, run(), [run(failed=(3,))]),
    ("all_completed", {"all_completed": False}, run(failed=(3,)), [run()]),
    ("completed", {"completed": 4}, run(failed=(3,)), [run(), run(failed=(2, 3))]),
    ("failed", {"failed": 1}, run(failed=(3,)), [run(), run(failed=(2, 3))]),
    ("failed_requests", {"failed_requests": [3]}, run(failed=(3,)), [run(failed=(2,)), run(), run(failed=(2, 3))]),
    ("calls", {"calls": 5}, run(), [run(calls=calls_with()[:4])]),
    ("oom_calls", {"oom_calls": 1}, run(failed=(3,)), [run(), run(failed=(2, 3))]),
    ("oom", {"oom": {}}, run(failed=(3,)), [run()]),
    (
        "oom.phase",
        {"oom": {"phase": "backward"}},
        run(failed=(3,), calls=calls_with(c3={"oom": OOM_BACKWARD})),
        [run(), run(failed=(3,))],  # no OOM at all (the vacuous pass), an OOM in forward
    ),
    (
        "oom.op_contains",
        {"oom": {"op_contains": "lora_b"}},
        run(failed=(3,), calls=calls_with(c3={"oom": OOM_BACKWARD})),
        [run(), run(failed=(3,))],
    ),
    (
        "oom.attempted_gib",
        {"oom": {"attempted_gib": {"min": 1.5}}},
        run(failed=(3,), calls=calls_with(c3={"oom": OOM_BACKWARD})),
        [run(), run(failed=(3,))],  # no OOM, an OOM of 1 GiB
    ),
    ("padded_rows", {"padded_rows": [1, 1, 16, 1, 1]}, run(calls=calls_with(c3={"padded": 16})), [run()]),
    (
        "request_metrics",
        {"request_metrics": {2: {"loss:sum": 2.5}}},
        run(metrics={2: {"loss:sum": 2.5}}),
        [run(), run(metrics={2: {"loss:sum": 2.6}}), run(metrics={1: {"loss:sum": 2.5}})],
    ),
    (
        "min_headroom_gib",
        {"min_headroom_gib": 2.0},
        run(),  # 4 GiB, every peak 1 GiB: 3 GiB left
        # a call with 1.5 GiB left; no capacity reported; no call reporting its peak (the vacuous pass)
        [run(calls=calls_with(c4={"peak_gib": 2.5})), run(capacity_gib=None), run(calls=no_peaks())],
    ),
    ("makespan_s", {"makespan_s": {"max": 6.0}}, run(), [run(end_s=7.0)]),
    ("makespan_s", {"makespan_s": {"min": 4.0, "max": 6.0}}, run(), [run(end_s=3.0), run(end_s=7.0)]),
    (
        "swaps",
        {"swaps": 2},
        run(calls=calls_with(c2={"swap": True}, c4={"swap": True})),
        [run(), run(calls=calls_with(c2={"swap": True}))],
    ),
    (
        "host_memory_peak_gib",
        {"host_memory_peak_gib": {"max": 1.0}},
        run(host_peak_gib=0.5),
        [run(host_peak_gib=1.5), run()],  # above, and no adapter store at all
    ),
]


@pytest.mark.parametrize(("key", "expect", "has", "lacks"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_run_that_has_the_property_passes_and_one_that_lacks_it_fails(key, expect, has, lacks):
    expectations = Expectations.model_validate(expect)
    assert unmet(has, expectations) == [], key
    for lacking in lacks:
        assert unmet(lacking, expectations), f"{key}: a run that lacks it passed"


def test_every_expect_key_has_a_case():
    """A new ``expect:`` key needs its row in ``CASES`` (a run that lacks it must fail it)."""
    keys = set(Expectations.model_fields) - {"oom"} | {f"oom.{k}" for k in OomExpectation.model_fields} | {"oom"}
    assert keys <= {case[0] for case in CASES}


def test_completion_is_the_default_unless_the_expectation_says_otherwise():
    assert Expectations().effective().all_completed is True
    assert Expectations(makespan_s={"max": 9.0}).effective().all_completed is True
    assert Expectations(oom_calls=0).effective().all_completed is True  # no OOM is no statement about completion
    for stated in ({"failed": 1}, {"completed": 3}, {"failed_requests": [2]}, {"all_completed": False}):
        assert Expectations.model_validate(stated).effective().all_completed is stated.get("all_completed")
    for oom in ({"oom_calls": 2}, {"oom": {}}):  # an OOM fails its call's requests: completion cannot be implied
        assert Expectations.model_validate(oom).effective().all_completed is None
    # a range alone still requires completion: a run where 4 of 5 fail fails it
    assert unmet(run(failed=(1, 2, 3, 4), end_s=1.0), Expectations(makespan_s={"max": 9.0}))


TINY = """
name: tiny
endpoint:
  model: tiny-dense
  hardware: {profile: cpu, devices: 1, device_memory_gib: 8, reserve_gib: 0}
workload:
  clients:
    - submit: {mode: after_previous}
      requests:
        - {type: forward_backward, lengths: [10, 20, 3000, 30, 40]}
"""
"""Five requests; with ``memory_limit_gib: 0.012`` the third (3,000 tokens) runs out of memory in forward."""
TIGHT = {"memory_limit_gib": 0.012}


def scenario(tmp_path: Path, variants: dict[str, Any], expect: dict[str, Any] | None = None) -> Path:
    data = yaml.safe_load(TINY)
    data["variants"] = variants
    if expect is not None:
        data["expect"] = expect
    return write(tmp_path, yaml.safe_dump(data, sort_keys=False))


UNMEETABLE: list[tuple[dict[str, Any], str]] = [
    ({"failed": 1, "failed_requests": [1, 2, 3]}, "expect.failed"),
    ({"failed_requests": [2, 2]}, "expect.failed_requests"),
    ({"failed_requests": [6]}, "expect.failed_requests"),
    ({"completed": 6}, "expect.completed"),
    ({"completed": 4, "failed": 2}, "expect.completed"),
    ({"completed": 3, "failed_requests": [1, 2, 3]}, "expect.completed"),
    ({"all_completed": True, "failed": 1}, "expect.all_completed"),
    ({"all_completed": True, "oom_calls": 1}, "expect.all_completed"),
    ({"all_completed": False, "failed": 0}, "expect.all_completed"),
    ({"all_completed": False, "completed": 5}, "expect.all_completed"),
    ({"oom": {}, "oom_calls": 0}, "expect.oom"),
    ({"oom_calls": 1, "failed": 0}, "expect.oom_calls"),
    ({"oom": {"phase": "forward"}, "failed_requests": []}, "expect.oom"),
    ({"oom_calls": 3, "calls": 2, "failed": 3}, "expect.oom_calls"),
    ({"oom_calls": 2, "failed_requests": [3]}, "expect.oom_calls"),
    ({"oom_calls": 6}, "expect.oom_calls"),
    ({"padded_rows": [1, -1]}, "expect.padded_rows[1]"),
    ({"padded_rows": [0]}, "expect.padded_rows[0]"),
    ({"padded_rows": [1, 1, 1], "calls": 2, "failed": 3}, "expect.padded_rows"),
    ({"padded_rows": []}, "expect.padded_rows"),  # every request completes: some forward_backward ran
    ({"padded_rows": [1, 1, 1, 1, 1, 1]}, "expect.padded_rows"),  # six forward-pass calls of five requests
    ({"calls": 0}, "expect.calls"),
    ({"calls": 0, "completed": 2}, "expect.calls"),
    ({"request_metrics": {}}, "expect.request_metrics"),
    ({"request_metrics": {1: {}}}, "expect.request_metrics.1"),
    ({"request_metrics": {9: {"loss:sum": 1.0}}}, "expect.request_metrics"),
    ({"min_headroom_gib": 8.0}, "expect.min_headroom_gib"),  # the capacity is 8 GiB
    ({"swaps": 6}, "expect.swaps"),
]
"""Expectations no run of ``TINY`` can meet, and the key each error names."""

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"makespan_s": {}}, "makespan_s"),
    ({"makespan_s": {"min": 0}}, "makespan_s"),
    ({"makespan_s": {"min": -5}}, "makespan_s"),
    ({"makespan_s": {"max": 0}}, "makespan_s"),
    ({"makespan_s": {"min": 5, "max": 2}}, "makespan_s"),
    ({"host_memory_peak_gib": {}}, "host_memory_peak_gib"),
    ({"oom": {"attempted_gib": {}}}, "attempted_gib"),
    ({"oom": {"phase": ""}}, "phase"),
    ({"oom": {"op_contains": ""}}, "op_contains"),
    ({"min_headroom_gib": -1000}, "min_headroom_gib"),
    ({"min_headroom_gib": 0}, "min_headroom_gib"),
    ({"failed": -1}, "failed"),
]
"""Expectations the schema refuses as written (checks nothing, or cannot hold for the quantity), and the key named."""


@pytest.mark.parametrize(("expect", "key"), UNMEETABLE + INVALID, ids=[str(e) for e, _ in UNMEETABLE + INVALID])
def test_an_expectation_no_run_can_meet_is_bad_input_naming_the_key(tmp_path, expect, key):
    path = scenario(tmp_path, {"v": {"expect": expect}})
    with pytest.raises(UserError) as error:
        load_scenario(path)
    assert key in str(error.value) and str(path) in str(error.value)


@pytest.mark.parametrize(("expect", "key"), [UNMEETABLE[0], INVALID[0], INVALID[9]])
def test_check_exits_2_naming_the_key(tmp_path, capsys, expect, key):
    code, out = run_cli(["check", str(scenario(tmp_path, {"v": {"expect": expect}})), "--quiet"], capsys)
    assert code == 2 and key in out and "Traceback" not in out


def test_the_scenario_level_expectation_is_checked_for_the_variants_that_use_it(tmp_path):
    with pytest.raises(UserError, match="'expect.failed'"):
        load_scenario(scenario(tmp_path, {"v": {}}, expect={"failed": 1, "failed_requests": [1, 2]}))


def verdicts(tmp_path: Path, capsys, variants: dict[str, Any], expect: dict[str, Any] | None = None) -> tuple[int, str]:
    return run_cli(["check", str(scenario(tmp_path, variants, expect)), "--quiet", "--no-progress"], capsys)


def test_an_oom_expectation_is_not_met_by_a_run_without_oom(tmp_path, capsys):
    code, out = verdicts(tmp_path, capsys, {"roomy": {"expect": {"oom": {"phase": "backward"}}}})
    assert code == 1 and "FAIL roomy: expected a call to run out of memory (in backward); none did" in out


def test_an_empty_expectation_means_every_request_completes(tmp_path, capsys):
    code, out = verdicts(tmp_path, capsys, {"tight": {"set": TIGHT, "expect": {}}})
    assert code == 1 and "FAIL tight: expected every request to complete; 1 failed" in out


def test_all_completed_false_is_not_met_by_a_run_that_completes(tmp_path, capsys):
    code, out = verdicts(tmp_path, capsys, {"roomy": {"expect": {"all_completed": False}}})
    assert code == 1 and "expected some request not to complete; all 5 completed" in out


def test_an_empty_variant_block_inherits_the_scenarios_expectations(tmp_path, capsys):
    """``expect: {}`` and no ``expect`` at all both take the scenario's (here: request 3 fails in forward)."""
    scenario_expect = {"failed_requests": [3], "oom": {"phase": "forward"}}
    variants = {"empty": {"set": TIGHT, "expect": {}}, "none": {"set": TIGHT}}
    code, out = verdicts(tmp_path, capsys, variants, expect=scenario_expect)
    assert code == 0 and "PASS empty" in out and "PASS none" in out
    variants["roomy"] = {"expect": {}}  # inherits the failure it does not have
    code, out = verdicts(tmp_path, capsys, variants, expect=scenario_expect)
    assert code == 1 and "FAIL roomy: expected failed requests [3], got []" in out


def test_a_missing_metric_is_said_to_be_missing_with_the_metrics_the_request_has():
    problems = unmet(run(metrics={2: {"loss:sum": 2.5}}), Expectations(request_metrics={2: {"loss:mean": 2.5}}))
    assert problems == ["request 2: expected loss:mean = 2.5; it has no such metric (it has: loss:sum)"]

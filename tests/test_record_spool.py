"""A spooled run (request records in a temporary file, ``RecordSpool``) gives the bytes of the same run held in
memory, really drops its records, and reads back what it wrote; reports, pickling and the CLI work on it."""

from __future__ import annotations

import copy
import lzma
import math
import pickle
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from project_paths import SCENARIOS
from scenario_text import run_cli
from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.plugin_host.driver import Process, drive
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.plugin_host.virtual_clock import VirtualClock
from skyrl_sim.results.record_spool import RecordSpool
from skyrl_sim.results.result import JSON_OPTIONS, SCHEMA, RequestRecord, RunResult, write_results
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.variant import ResolvedVariant
from skyrl_sim.traffic.synthetic import VARIANT, multi_tenant_document
from skyrl_sim_plugins.sim.options import SPOOL_ABOVE_REQUESTS, SimOptions
from test_result_identity import FIXTURE
from test_virtual_clock import FailsAfter, sim_executor, synthetic, with_submit

QUEUE_DRAIN = SCENARIOS / "queue_drain_17.yaml"

# -- the spool alone -------------------------------------------------------------------------------------------------
times = st.one_of(st.none(), st.floats(min_value=0, max_value=1e7, allow_nan=False))
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def records(draw: Any, count: int) -> list[RequestRecord]:
    made = []
    for request_id in range(1, count + 1):
        made.append(
            RequestRecord(
                id=request_id,
                type=draw(st.sampled_from(["forward", "forward_backward", "optim_step", "sample"])),
                model_id=draw(st.text(max_size=6)),
                tokens=draw(st.integers(0, 10**6)),
                submitted_s=draw(times),
                started_s=draw(times),
                completed_s=draw(times),
                status=draw(st.sampled_from(["pending", "completed", "failed"])),
                error=draw(st.one_of(st.none(), st.text(max_size=12))),
                metrics=draw(
                    st.dictionaries(st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False), max_size=3)
                ),
                client=draw(st.text(max_size=5)),
                datums=draw(st.lists(st.integers(0, 10**5), max_size=4)),
                outputs=draw(st.dictionaries(st.text(max_size=6), json_value, max_size=3)),
            )
        )
    return made


@settings(max_examples=60, deadline=None)
@given(data=st.data(), count=st.integers(1, 40))
def test_the_spool_reads_back_in_id_order_what_was_written_in_any_order_with_the_late_facts(data: Any, count: int) -> None:
    written = data.draw(records(count))
    order = data.draw(st.permutations(written))
    late_start = {r.id: data.draw(times) for r in written if r.started_s is None and data.draw(st.booleans())}
    seen = {
        r.id: data.draw(st.lists(st.floats(0, 1e6), min_size=1, max_size=2)) for r in written if data.draw(st.booleans())
    }

    spool = RecordSpool()
    expected = {r.id: copy.deepcopy(r) for r in written}
    for record in order:
        assert orjson.dumps(record) == orjson.dumps(asdict(record))  # iter_json dumps records as they are
        spool.add(record)
    for request_id, at in late_start.items():
        if at is not None:
            spool.started(request_id, at)
            expected[request_id].started_s = at
    for request_id, times_seen in seen.items():
        for at in times_seen:
            spool.retrieved(request_id, at)
            expected[request_id].outputs.setdefault("retrieved_s", at)

    want = [expected[i] for i in range(1, count + 1)]
    assert len(spool) == count
    assert list(spool) == want
    assert list(spool.dicts()) == [asdict(r) for r in want]
    assert [spool[i] for i in range(count)] == want and spool[-1] == want[-1] and spool[1:3] == want[1:3]
    assert spool.by_id(count) == want[-1]
    assert list(spool.request_times()) == [(r.submitted_s, r.started_s, r.completed_s, r.status) for r in want]
    assert [list(r.outputs) for r in spool] == [list(r.outputs) for r in want]  # retrieved_s last, as setdefault puts it
    with pytest.raises(IndexError):
        spool[count]
    with pytest.raises(KeyError):
        spool.by_id(count + 1)


def test_the_spool_reads_blocks_whose_records_lie_far_apart_and_refuses_gaps_and_repeats(monkeypatch: Any) -> None:
    monkeypatch.setattr("skyrl_sim.results.record_spool.READ_BLOCK", 3)
    monkeypatch.setattr("skyrl_sim.results.record_spool.MAX_BLOCK_SPAN", 200)  # some blocks are read record by record
    made = [
        RequestRecord(i, "forward", "m", i, 0.5 * i, None, None, outputs={"pad": "x" * (i * 17 % 90)}) for i in range(1, 12)
    ]
    spool = RecordSpool()
    for record in reversed(made):
        spool.add(record)
    assert list(spool) == made
    with pytest.raises(ValueError, match="already in the spool"):
        spool.add(made[0])
    gappy = RecordSpool()
    gappy.add(made[2])
    with pytest.raises(ValueError, match="no record of request 1"):
        list(gappy)
    with pytest.raises(ValueError, match="NaN"):
        RecordSpool().add(replace(made[0], submitted_s=math.nan))


# -- runs: spooled and in memory give the same bytes ------------------------------------------------------------------
class WatchedClock(VirtualClock):
    """A VirtualClock that checks, whenever a result is written, that the table holds only the records of requests in
    flight (pending and still awaited: a request whose client gave up stays pending, its record already spooled)."""

    def __init__(self) -> None:
        super().__init__(cap_s=1e9)
        self.most_held = 0
        self.finished = 0

    def run(self, table: FuturesTable, clients: list[Process], engine: Process, wait_limit_s: float) -> None:
        def check(request_id: int) -> None:
            self.finished += 1
            assert request_id not in table.records
            assert set(table.records) == {r.id for r in table.pending() if not table.is_done(r.id)}
            self.most_held = max(self.most_held, len(table.records))

        table.on_done(check)
        super().run(table, clients, engine, wait_limit_s)


def drive_both(variant: ResolvedVariant, make_executor: Any) -> tuple[RunResult, RunResult, WatchedClock]:
    def result() -> RunResult:
        return RunResult(variant.scenario.name, variant.variant_name, "sim", variant.endpoint.name)

    context = RunContext(host=PluginHost(), options={})
    held = drive(variant, context, result(), make_executor(), VirtualClock(cap_s=1e9))
    clock = WatchedClock()
    spooled = drive(variant, context, result(), make_executor(), clock, spool=True)
    assert isinstance(spooled.requests, RecordSpool) and isinstance(held.requests, list)
    return held, spooled, clock


def test_the_5k_fixture_workload_spooled_writes_the_fixture_bytes(tmp_path: Path) -> None:
    path = tmp_path / "multi_tenant.yaml"
    path.write_text(yaml.safe_dump(multi_tenant_document(5000), sort_keys=False))
    result = PluginHost().run(load_scenario(path).resolve(VARIANT), "sim", {"spool": "always"})
    assert isinstance(result.requests, RecordSpool)
    result.versions = {}
    expected = lzma.decompress(FIXTURE.read_bytes())
    assert result.to_json() == expected
    result.write(tmp_path / "streamed.json")
    assert (tmp_path / "streamed.json").read_bytes() == expected


@pytest.mark.parametrize(
    ("submit", "seconds", "timeout_s"),
    [
        ({}, 90.0, 100.0),  # slow calls, short result timeout: waits give up, calls start requests already failed
        ({"mode": "back_to_back", "warmup": 2, "times_s": None}, 0.1, 0.5),
    ],
)
def test_a_run_with_time_outs_spooled_gives_the_same_bytes_and_holds_only_requests_in_flight(
    tmp_path: Path, submit: dict[str, Any], seconds: float, timeout_s: float
) -> None:
    variant = with_submit(synthetic(tmp_path, 600, result_timeout_s=timeout_s), **submit)
    held, spooled, clock = drive_both(variant, sim_executor(variant, seconds))
    assert spooled.to_json() == held.to_json()
    timed_out = [r for r in held.requests if r.error and r.error.startswith("timed out")]
    assert timed_out and any(r.started_s is not None and r.started_s > r.completed_s for r in timed_out)  # late start
    assert any("retrieved_s" in r.outputs for r in held.requests)
    assert clock.finished >= 600 and 0 < clock.most_held < 600
    assert spooled.summary() == held.summary() and spooled.makespan_s == held.makespan_s


def test_a_fatal_stop_spooled_gives_the_same_bytes(tmp_path: Path) -> None:
    variant = with_submit(synthetic(tmp_path, 400), gap_s=0.0)
    held, spooled, _ = drive_both(variant, lambda: FailsAfter(variant, 40))
    assert b"not run: backend stopped (worker died)" in held.to_json()
    assert spooled.to_json() == held.to_json()


def test_a_shipped_scenario_spooled_gives_the_same_bytes_one_run_and_all_variants(tmp_path: Path) -> None:
    scenario = load_scenario(QUEUE_DRAIN)
    host = PluginHost()
    held = [host.run(scenario.resolve(name), "sim", {"spool": "never"}) for name in scenario.variant_names]
    spooled = [host.run(scenario.resolve(name), "sim", {"spool": "always"}) for name in scenario.variant_names]
    assert len(held) > 1 and all(isinstance(r.requests, RecordSpool) for r in spooled)
    for a, b in zip(held, spooled, strict=True):
        assert b.to_json() == a.to_json()
        assert b.to_dict() == a.to_dict()
    old_writer = orjson.dumps({"schema": SCHEMA, "runs": [r.to_dict() for r in held]}, option=JSON_OPTIONS)
    write_results(spooled, tmp_path / "all.json")
    write_results(held, tmp_path / "all_held.json")
    assert (tmp_path / "all.json").read_bytes() == old_writer == (tmp_path / "all_held.json").read_bytes()


def test_a_spooled_result_pickles_and_copies_as_a_plain_list() -> None:
    scenario = load_scenario(QUEUE_DRAIN)
    result = PluginHost().run(scenario.resolve(scenario.variant_names[0]), "sim", {"spool": "always"})
    for copied in (pickle.loads(pickle.dumps(result)), copy.deepcopy(result)):
        assert isinstance(copied.requests, list)
        assert copied.requests == list(result.requests)
        assert copied.to_json() == result.to_json()
    assert result.request(3) == result.requests[2] and result.request(3).id == 3


def test_the_simulator_spools_only_above_the_threshold_unless_told() -> None:
    assert not SimOptions().spools(SPOOL_ABOVE_REQUESTS) and SimOptions().spools(SPOOL_ABOVE_REQUESTS + 1)
    assert SimOptions(spool="always").spools(1) and not SimOptions(spool="never").spools(10**7)
    scenario = load_scenario(QUEUE_DRAIN)
    result = PluginHost().run(scenario.resolve(scenario.variant_names[0]), "sim")
    assert isinstance(result.requests, list)  # 17 requests: held in memory


def test_the_cli_reports_and_writes_a_spooled_run_as_an_unspooled_one(tmp_path: Path, capsys: Any) -> None:
    outputs = {}
    for mode in ("never", "always"):
        target, trace = tmp_path / f"{mode}.json", tmp_path / "trace.json"  # the report names the trace file
        argv = ["run", str(QUEUE_DRAIN), "--all-variants", "--option", f"spool={mode}", "--json", str(target)]
        code, text = run_cli([*argv, "--trace", str(trace)], capsys)
        assert code == 0, text
        outputs[mode] = (text, target.read_bytes(), trace.read_bytes())
    assert outputs["always"] == outputs["never"]
    assert b'"runs"' in outputs["always"][1] and b"forward_backward" in outputs["always"][2]
    assert "latency" in outputs["always"][0]  # the text report
    code, text = run_cli(["run", str(QUEUE_DRAIN), "--option", "spool=sometimes"], capsys)
    assert code == 2 and "--option spool=sometimes" in text and "Traceback" not in text

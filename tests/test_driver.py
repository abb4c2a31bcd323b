"""The host's run driver: the simulator's executor on the driver's simpy clock gives the simulator backend's result
byte for byte; on the wall clock (threads, real sleeps) it forms the same calls."""

from __future__ import annotations

import time

import pytest
import yaml

from cost_fakes import FixedCallTime
from project_paths import SCENARIOS
from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.plugin_host.driver import MeasuredTime, SimpyClock, WallClock, drive
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.plugin_host.virtual_clock import VirtualClock
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario
from skyrl_sim.schema.variant import ResolvedVariant
from skyrl_sim.traffic.synthetic import VARIANT, multi_tenant_document
from skyrl_sim_plugins.sim.backend import SimBackend, SimExecutor
from skyrl_sim_plugins.sim.bound.memory import default_memory_model
from test_virtual_clock import result_of, sim_executor, synthetic, with_submit

CASES = [
    (name, variant)
    for name in ("queue_drain_17.yaml", "moe_r3.yaml", "queue_drain_17_tiny.yaml")
    for variant in load_scenario(SCENARIOS / name).variant_names
]


def fresh_result(variant: ResolvedVariant, backend: str) -> RunResult:
    endpoint = variant.endpoint
    return RunResult(
        variant.scenario.name, variant.variant_name, backend, endpoint.name, capacity_bytes=endpoint.capacity_bytes
    )


@pytest.mark.parametrize(("scenario", "name"), CASES)
def test_the_driver_on_a_simpy_clock_is_the_simulator(scenario: str, name: str) -> None:
    host = PluginHost()
    variant = load_scenario(SCENARIOS / scenario).resolve(name)
    expected = SimBackend().run(variant, RunContext(host=host, options={}))
    backend = SimBackend()
    executor = SimExecutor(variant.endpoint, variant.model, backend.memory, backend.time)
    got = drive(variant, RunContext(host=host, options={}), fresh_result(variant, "sim"), executor, SimpyClock())
    assert got.to_json() == expected.to_json()


def test_the_wall_clock_forms_the_same_calls_as_the_simpy_clock() -> None:
    """Fast fixed-time calls and no real sleeping: the calls depend on the engine rules, not on the clock."""
    host = PluginHost()
    variant = load_scenario(SCENARIOS / "queue_drain_17.yaml").resolve("cap-aware")
    memory = default_memory_model()

    def run(clock: SimpyClock | WallClock) -> RunResult:
        executor = SimExecutor(variant.endpoint, variant.model, memory, FixedCallTime(0.0))
        return drive(variant, RunContext(host=host, options={}), fresh_result(variant, "x"), executor, clock)

    simulated = run(SimpyClock())
    walled = run(WallClock(sleep=lambda seconds: None))
    assert [(c.kind, c.request_ids) for c in walled.calls] == [(c.kind, c.request_ids) for c in simulated.calls]
    assert all(r.status == "completed" for r in walled.requests)


def test_an_idle_engine_passes_its_no_op_ticks_at_once_and_wakes_at_the_tick_it_would_have_reached() -> None:
    from skyrl_sim.plugin_host.driver import idle_delay

    assert idle_delay(5.0, 0.1, 5.05) == 0.1  # the next event comes before the first tick: one ordinary tick
    assert idle_delay(5.0, 0.1, float("inf")) == 0.1  # nothing scheduled: no skipping
    for now, horizon in ((100.0, 107.33), (1234.5678, 1300.0), (0.30000000000000004, 0.55)):
        tick = now + 0.1
        while tick < horizon:  # the ticks one by one, as the clock adds them
            tick = tick + 0.1
        delay = idle_delay(now, 0.1, horizon)
        assert now + delay == tick or delay == 0.1  # lands on that tick exactly, or falls back to one tick
    assert 100.0 + idle_delay(100.0, 0.1, 107.33) >= 107.33  # this one skips: every tick before the horizon


def test_a_request_whose_client_gave_up_still_runs_on_the_engine(tmp_path) -> None:
    """A client that stops waiting fails its request as it sees it, but the service does not know: the engine still
    runs the request later, and that call costs engine time. Every submitted pass runs exactly once, on both clocks;
    the record keeps the client's failure and the engine's later start."""
    variant = with_submit(synthetic(tmp_path, 300, result_timeout_s=100.0), gap_s=0.0)
    for clock in (SimpyClock(1e9), VirtualClock(1e9)):
        result = result_of(variant, sim_executor(variant, 90.0)(), clock)
        given_up = {r.id: r for r in result.requests if r.error and r.error.startswith("timed out")}
        assert given_up
        runs: dict[int, float] = {}
        for call in result.calls:
            for request_id in call.request_ids:
                assert request_id not in runs  # nothing runs twice
                runs[request_id] = call.start_s
        passes = [r for r in result.requests if r.type in ("forward_backward", "forward")]
        assert all(r.id in runs for r in passes)  # every pass ran, given up or not
        late = [r for r in given_up.values() if runs[r.id] > r.completed_s]
        assert late and all(r.started_s == runs[r.id] and r.status == "failed" for r in late)
        # the service is busy until its last call ends, though every client has long stopped waiting
        last_result = max(r.completed_s for r in result.requests if r.completed_s is not None)
        last_call = max(call.end_s for call in result.calls)
        first = min(r.submitted_s for r in result.requests if r.submitted_s is not None)
        assert last_call > last_result
        assert result.makespan_s == result.summary()["makespan_s"] == last_call - first
        assert result.summary()["engine_busy_fraction"] <= 1.0


@pytest.mark.parametrize(
    ("seconds", "timeout_s", "sampling"), [(30.0, 3600.0, "continuous"), (90.0, 100.0, "serial"), (60.0, 1e6, "serial")]
)
def test_the_engine_plans_a_backlog_as_from_the_whole_queue(tmp_path, monkeypatch, seconds, timeout_s, sampling) -> None:
    """The engine reads only the requests an iteration can act on (``FuturesTable.actionable``); with a deep backlog
    behind the barriers, clients that give up, and samples, the run is the run that reads the whole queue."""
    document = multi_tenant_document(600)
    document["workload"]["result_timeout_s"] = timeout_s
    variant = ScenarioFile(tmp_path / "s.yaml", raw=document).resolve(VARIANT, {"engine.sampling": sampling})
    fast = result_of(variant, sim_executor(variant, seconds)(), VirtualClock(1e9))
    monkeypatch.setattr(FuturesTable, "actionable", lambda table, continuous=False: table.pending())
    whole = result_of(variant, sim_executor(variant, seconds)(), VirtualClock(1e9))
    assert fast.to_json() == whole.to_json()
    assert fast.summary()["queue_wait_max_s"] > 20 * seconds  # a real backlog: many iterations behind barriers


def test_actionable_never_offers_a_finished_request(tmp_path) -> None:
    """A request finished out of order (not at the front of its model's queue) is not offered again."""
    variant = ScenarioFile(tmp_path / "s.yaml", raw=multi_tenant_document(200)).resolve(VARIANT)
    table = FuturesTable(variant, clock=lambda: 0.0)
    submitted = [table.submit(planned) for planned in variant.client_requests(0)[:6]]
    middle = submitted[2]
    table.finish([middle.id])
    assert middle.id not in {r.id for r in table.actionable()}
    assert {r.id for r in table.actionable()} <= {r.id for r in table.pending()}


class SlowMeasuredCalls:
    """An executor that spends real time on each call and reports it as measured (``wait_s`` 0), as the real
    backend's does: the simulator's memory for each call, and a wall-clock duration the machine decides."""

    def __init__(self, inner: SimExecutor, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def _measured(self, run) -> object:
        started = time.perf_counter()
        outcome = run()
        time.sleep(self.seconds)
        outcome.duration_s, outcome.wait_s = time.perf_counter() - started, 0.0
        return outcome

    def batch(self, call, shape):
        return self._measured(lambda: self.inner.batch(call, shape))

    def single(self, request):
        return self._measured(lambda: self.inner.single(request))


@pytest.mark.parametrize("name", ["no-cap", "cap-only"])
def test_measured_time_batches_as_the_simulator_whatever_the_calls_really_take(name: str) -> None:
    """Real calls on simulated time (``MeasuredTime``, the real backend's ``clock=measured``): calls that really take
    0.05 s and report it batch exactly as the simulator's calls of the same durations, and each call's recorded
    duration is its measured one."""
    host = PluginHost()
    variant = load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml").resolve(name)
    memory = default_memory_model()
    inner = SimExecutor(variant.endpoint, variant.model, memory, FixedCallTime(0.0))
    measured = drive(
        variant,
        RunContext(host=host, options={}),
        fresh_result(variant, "x"),
        MeasuredTime(SlowMeasuredCalls(inner, 0.05)),
        VirtualClock(),
    )
    modelled = SimBackend().run(variant, RunContext(host=host, options={}))
    assert [(c.kind, c.request_ids) for c in measured.calls] == [(c.kind, c.request_ids) for c in modelled.calls]
    assert all(c.duration_s >= 0.05 for c in measured.calls)
    assert all(c.end_s - c.start_s == pytest.approx(c.duration_s) for c in measured.calls)  # the clock advanced by it
    assert [c.oom is not None for c in measured.calls] == [c.oom is not None for c in modelled.calls]


def test_actionable_offers_the_samples_left_in_id_order_as_admitted_ones_leave(tmp_path) -> None:
    """The table rebuilds its dict of waiting samples as they leave it (admitted, or finished without being admitted):
    what ``actionable`` offers stays every waiting sample, in id order, at each step."""
    raw = yaml.safe_load((SCENARIOS / "sampling_heavy_tiny.yaml").read_text())
    raw["workload"]["clients"][0]["requests"][0]["count"] = 400
    variant = ScenarioFile(SCENARIOS / "sampling_heavy_tiny.yaml", raw=raw).resolve("roomy")
    table = FuturesTable(variant, clock=lambda: 0.0)
    for planned in variant.client_requests(0):
        table.submit(planned)
    samples = table.pending()
    assert len(samples) > 400 and all(r.type == "sample" for r in samples)  # the dict is rebuilt several times
    left = list(samples)
    for step in range(12):
        gone, left = left[step % 3 :: 4], [r for i, r in enumerate(left) if (i - step % 3) % 4 != 0]
        admitted, finished = gone[::2], gone[1::2]
        table.admit(admitted)
        table.finish([r.id for r in finished])
        offered = [r for r in table.actionable() if r.type == "sample"]
        assert offered == left
        assert [r.id for r in offered] == sorted(r.id for r in offered)

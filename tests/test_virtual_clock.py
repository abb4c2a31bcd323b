"""The simulator's heap clock (``VirtualClock``) runs events in simpy's order: every run gives the bytes the simpy
clock (``SimpyClock``) gives, on the shipped scenarios and on workloads built to stress same-time ordering (zero gaps,
waits that time out, an engine that stops on a fatal failure, the simulated-time cap)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cost_fakes import FixedCallTime, FlatMemory
from project_paths import SCENARIOS
from skyrl_sim.engine.clients import Await, Idle, Sleep, Submit
from skyrl_sim.engine.loop import CallOutcome
from skyrl_sim.engine.rules import BatchCall
from skyrl_sim.engine.shapes import CallShape
from skyrl_sim.plugin_host.driver import SimpyClock, SimulatedTimeExceeded, drive
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.plugin_host.virtual_clock import VirtualClock
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario
from skyrl_sim.schema.variant import ResolvedVariant
from skyrl_sim.traffic.synthetic import VARIANT, multi_tenant_document
from skyrl_sim_plugins.sim.backend import SimBackend, SimExecutor

SHIPPED = [
    (path.name, name) for path in sorted(SCENARIOS.glob("*.yaml")) for name in load_scenario(path).variant_names
]


def result_of(variant: ResolvedVariant, executor: Any, clock: SimpyClock | VirtualClock) -> RunResult:
    result = RunResult(variant.scenario.name, variant.variant_name, "sim", variant.endpoint.name)
    return drive(variant, RunContext(host=PluginHost(), options={}), result, executor, clock)


def both(variant: ResolvedVariant, make_executor: Any, cap_s: float = float("inf")) -> tuple[bytes, bytes]:
    simpy_run = result_of(variant, make_executor(), SimpyClock(cap_s)).to_json()
    heap_run = result_of(variant, make_executor(), VirtualClock(cap_s)).to_json()
    return simpy_run, heap_run


def sim_executor(variant: ResolvedVariant, seconds: float | None = None) -> Any:
    backend = SimBackend()
    time = FixedCallTime(seconds) if seconds is not None else backend.time
    memory = FlatMemory() if seconds is not None else backend.memory
    return lambda: SimExecutor(variant.endpoint, variant.model, memory, time)


@pytest.mark.parametrize(("scenario", "name"), SHIPPED)
def test_every_shipped_variant_runs_identically_on_both_clocks(scenario: str, name: str) -> None:
    variant = load_scenario(SCENARIOS / scenario).resolve(name)
    simpy_run, heap_run = both(variant, sim_executor(variant), cap_s=1e9)
    assert heap_run == simpy_run


def synthetic(tmp_path: Path, total: int, **workload: Any) -> ResolvedVariant:
    document = multi_tenant_document(total)
    document["workload"].update(workload)
    return ScenarioFile(tmp_path / "synthetic.yaml", raw=document).resolve(VARIANT)


def with_submit(variant: ResolvedVariant, **submit: Any) -> ResolvedVariant:
    """Every client submits with these settings (a ``times_s`` list is dropped unless the mode keeps it)."""
    clients = [
        client.model_copy(update={"submit": client.submit.model_copy(update=submit)}) for client in variant.workload.clients
    ]
    return replace(variant, workload=variant.workload.model_copy(update={"clients": clients}))


@pytest.mark.parametrize(
    ("submit", "seconds", "timeout_s"),
    [
        ({}, 30.0, 3600.0),  # a backlog: the engine is busy, clients wait on results
        ({"gap_s": 0.0}, 5.0, 3600.0),  # zero gaps: many events at one time
        ({}, 90.0, 100.0),  # slow calls and a short result timeout: some waits give up, late results are ignored
        ({"mode": "after_previous", "gap_s": 0.0, "times_s": None}, 0.25, 3600.0),
        ({"mode": "back_to_back", "warmup": 2, "times_s": None}, 0.1, 0.5),
    ],
)
def test_synthetic_workloads_run_identically_on_both_clocks(
    tmp_path: Path, submit: dict[str, Any], seconds: float, timeout_s: float
) -> None:
    variant = with_submit(synthetic(tmp_path, 600, result_timeout_s=timeout_s), **submit)
    simpy_run, heap_run = both(variant, sim_executor(variant, seconds), cap_s=1e9)
    assert heap_run == simpy_run
    assert b'"status": "completed"' in heap_run


class FailsAfter(SimExecutor):
    """A simulator executor whose ``calls``-th batch call fails fatally (a worker died): the engine stops."""

    def __init__(self, variant: ResolvedVariant, calls: int) -> None:
        super().__init__(variant.endpoint, variant.model, FlatMemory(), FixedCallTime(1.0))
        self.left = calls

    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        self.left -= 1
        if self.left == 0:
            return CallOutcome(duration_s=0.5, wait_s=0.5, error="worker died", fatal=True)
        return super().batch(call, shape)


@pytest.mark.parametrize("cap_s", [float("inf"), 1e9])
def test_a_fatal_stop_ends_the_run_at_the_same_event_on_both_clocks(tmp_path: Path, cap_s: float) -> None:
    variant = with_submit(synthetic(tmp_path, 400), gap_s=0.0)
    simpy_run, heap_run = both(variant, lambda: FailsAfter(variant, 40), cap_s=cap_s)
    assert heap_run == simpy_run
    assert b"not run: backend stopped (worker died)" in heap_run


def test_both_clocks_stop_at_the_simulated_time_cap(tmp_path: Path) -> None:
    variant = synthetic(tmp_path, 200)
    for clock in (SimpyClock(cap_s=500.0), VirtualClock(cap_s=500.0)):
        with pytest.raises(SimulatedTimeExceeded):
            result_of(variant, sim_executor(variant, 1.0)(), clock)


class Submitted:
    def __init__(self, request_id: int) -> None:
        self.id = request_id


class ResultsTable:
    """The part of the futures table a clock reads and writes: a submission's id (the next in arrival order), whether
    a result is written, and who to tell when one is."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.listeners: list[Any] = []
        self.submitted: list[Any] = []

    def submit(self, planned: Any) -> Submitted:
        self.submitted.append(planned)
        return Submitted(len(self.submitted))

    def on_done(self, listener: Any) -> None:
        self.listeners.append(listener)

    def is_done(self, request_id: int) -> bool:
        return request_id in self.done

    def finish(self, request_id: int) -> None:
        self.done.add(request_id)
        for listener in self.listeners:
            listener(request_id)


def random_process(
    rng: random.Random, name: str, table: ResultsTable, clock: Any, log: list[Any], idle: bool = False, clients: int = 0
) -> Any:
    """A process of random sleeps (many of them zero, so many events share a time), each followed by a submission,
    waits on results, and result writes; it logs every resume with the time and the reply (a submission's: the id
    the clock sent back), so two clocks' logs differ if their event orders do.

    With ``idle`` it is an engine: when nothing has happened since it last looked (the log has not grown), it sleeps
    an ``Idle`` tick and looks again, the contract an idle engine keeps (a clock may pass a run of such ticks at
    once) while a client is still running."""
    for _ in range(rng.randint(5, 40)):
        while idle and log and log[-1][0] == name and rng.random() < 0.7:
            seen = len(log)
            while len(log) == seen and sum(entry[1] == "end" for entry in log) < clients:
                yield Idle(0.25)
        roll = rng.random()
        if roll < 0.3:
            table.finish(rng.randint(1, 30))
            log.append((name, "wrote", clock.now()))
            continue
        if roll < 0.6:
            reply = yield Await(rng.randint(1, 30))
        else:
            reply = yield Sleep(rng.choice([0.0, 0.0, 0.5, 1.0]))
            if not idle:
                log.append((name, reply, clock.now()))
                reply = yield Submit(name)  # type: ignore[arg-type]
                assert isinstance(reply, int)
        log.append((name, reply, clock.now()))
    log.append((name, "end", clock.now()))


@pytest.mark.parametrize("seed", range(40))
def test_random_processes_resume_in_the_same_order_on_both_clocks(seed: int) -> None:
    logs = []
    for make in (SimpyClock, VirtualClock):
        rng = random.Random(seed)
        clock = make(cap_s=1e6 if seed % 2 else float("inf"))
        table = ResultsTable()
        log: list[Any] = []
        clients = [random_process(rng, f"client-{i}", table, clock, log) for i in range(rng.randint(2, 8))]
        engine = random_process(rng, "engine", table, clock, log, idle=True, clients=len(clients))
        clock.run(table, clients, engine, wait_limit_s=rng.choice([0.5, 1.5, 100.0]))  # type: ignore[arg-type]
        logs.append(log)
    assert logs[0] == logs[1]
    assert any(reply is False for _, reply, _ in logs[0]) or seed % 4  # time-outs happen in the mix


def test_the_collector_is_paused_for_a_run_and_comes_back_able_to_collect_what_the_run_made():
    import gc
    import weakref

    from skyrl_sim.plugin_host.virtual_clock import cyclic_gc_paused

    class Node:
        pass

    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
        cycle = Node()
        cycle.self = cycle  # garbage only the cyclic collector can free
        alive = weakref.ref(cycle)
        del cycle
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert alive() is not None  # not collected while paused, nor by coming back
    gc.collect()
    assert alive() is None
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # a process that had it off keeps it off
    finally:
        gc.enable()

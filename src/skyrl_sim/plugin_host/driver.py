"""The run driver: the scenario's clients and SkyRL's engine loop over one futures table, on a backend's clock.

A backend that runs the engine itself (the simulator, the real backend) differs from another only in how time passes
and in what a call does. So the host owns the run: the futures table, the client scripts (``clients.client_script``),
the engine loop (``engine_loop.EngineLoop``) and the hook calls; a backend supplies

* a ``Clock``: how a process waits (simpy's virtual time, or the wall clock with threads), and
* a call executor (``engine_loop.CallExecutor``): what one backend call costs or does, and, when it has one, its
  sampler (``executor.sampler(table, clock)``, an ``engine.sampler.Sampler``): where samples run concurrently.

``drive(variant, context, result, executor, clock)`` runs the variant and fills ``result``. The clients and the
engine are written once, as generators of ``Sleep``/``Submit``/``Await`` steps; a clock only executes those steps.
The clients are interpreted here and nowhere else: a backend that drives a live service (``--backend tinker``) runs
the same ``client_processes`` on an ``asyncio_clock.AsyncioClock``, which hands each ``Submit`` to the backend's own
submit callback and waits on its results, without an engine process (the service runs its engine).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import simpy

from skyrl_sim.engine.clients import Await, Idle, Sleep, SleepUntil, Submit, client_script
from skyrl_sim.engine.futures import FuturesTable, poll_tick
from skyrl_sim.engine.loop import CallExecutor, CallOutcome, EngineLoop
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import BatchCall, sampling_mode
from skyrl_sim.engine.sampler import Sampler
from skyrl_sim.engine.shapes import CallShape
from skyrl_sim.engine.tenancy import TenantStore
from skyrl_sim.errors import UserError
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.results.record_spool import RecordSpool
from skyrl_sim.results.result import CallRecord, RunResult
from skyrl_sim.results.tenants import tenancy_section
from skyrl_sim.schema.variant import ResolvedVariant

Step = Sleep | Submit | Await
"""What a clock executes: let seconds pass (``Sleep``), hand a request to the service (``Submit``; the clock sends
back its id: the simulated and wall clocks insert it in the futures table and go on at once, a live service's clock
awaits the submission), or wait for a request's result (``Await``; the clock sends back True once it is written, or
False if it gave up waiting). The clients' own vocabulary, so a clock needs no other."""
Process = Generator[Step, bool | int | None, None]


class ClientTable(Protocol):
    """What a client process reads and writes besides its steps: the run's clock (``SleepUntil``), and what the
    client saw of a result: that it gave up waiting (``give_up``), or when it saw it (``retrieved``, with a poller
    only). ``engine.futures.FuturesTable`` is one; a live service's backend keeps its own records."""

    clock: Callable[[], float]

    def give_up(self, request_id: int, error: str) -> None: ...

    def retrieved(self, request_id: int, seen_s: float) -> None: ...


class Clock(Protocol):
    """How a backend's processes wait. ``now`` is seconds since the run started."""

    def now(self) -> float: ...

    def run(self, table: FuturesTable, clients: list[Process], engine: Process, wait_limit_s: float) -> None:
        """Run every client process and the engine process to their end. ``Submit`` inserts the request in ``table``
        and answers its id at once; ``Await`` answers True once the request's result is written, or False after
        ``wait_limit_s``."""
        ...

    def call_at(self, at_s: float, action: Callable[[], None]) -> None:
        """Call ``action()`` when the clock reaches ``at_s`` (at once if it has passed), while ``run`` runs: how a
        modelled sampler writes each sample's result at the moment its generation ends, whatever the engine and the
        clients are doing then. Same-time events keep the order they were scheduled in."""
        ...


def next_step(process: Process, reply: bool | int | None) -> Step | None:
    """The process's next step after sending it ``reply`` (None: it has finished)."""
    try:
        return process.send(reply)
    except StopIteration:
        return None


def client_process(
    variant: ResolvedVariant,
    index: int,
    table: ClientTable,
    wait_limit_s: float,
    poll: float | None,
    on_end: Callable[[], None] | None = None,
    on_first_await: Callable[[], None] | None = None,
) -> Process:
    """One client: its script's actions (``clients.client_script``) as a clock's steps. ``Submit`` goes to the clock,
    which sends back the request's id. An ``Await`` the clock gives up on (False) fails the request as the client sees
    it (``table.give_up``). With ``poll`` (the simulated service's result poller, ``engine.poll_interval_s``) a result
    is seen at the poller's next tick, recorded as ``retrieved``; with None (a live service) the retrieve's own latency
    is that delay and there is nothing to add. ``on_first_await`` is called once, when the client first waits on a
    result or ends without ever waiting (a harness holding a live engine releases it once every client is there);
    ``on_end`` when the client has finished (or its process is closed unfinished)."""
    script = client_script(variant, index)
    send = script.send
    clock = table.clock
    reply: int | None = None
    waited = on_first_await is None
    try:
        while True:
            try:
                action = send(reply)
            except StopIteration:
                return
            reply = None
            kind = type(action)
            if kind is Sleep:
                yield action  # type: ignore[misc]
            elif kind is SleepUntil:
                yield Sleep(max(0.0, action.at_s - clock()))  # type: ignore[union-attr]
            elif kind is Submit:
                reply = yield action  # type: ignore[misc]
            elif kind is Await:
                if not waited:
                    waited = True
                    on_first_await()  # type: ignore[misc]
                request_id = action.request_id  # type: ignore[union-attr]
                if not (yield action):  # type: ignore[misc]
                    # the client gives up (workload.result_timeout_s): the request fails as it sees it; the engine
                    # still runs it (the service does not know), and that later result is never seen
                    table.give_up(request_id, f"timed out: no result within {wait_limit_s:g} s")
                    continue
                if poll is not None:
                    seen = poll_tick(clock(), poll)
                    table.retrieved(request_id, seen)
                    yield Sleep(max(0.0, seen - clock()))
            else:
                raise TypeError(f"a client script yielded {action!r}, not an action")
    finally:
        if not waited:
            on_first_await()  # type: ignore[misc]
        if on_end is not None:
            on_end()


def client_processes(
    variant: ResolvedVariant,
    table: ClientTable,
    wait_limit_s: float,
    poll: float | None,
    on_end: Callable[[], None] | None = None,
    on_first_await: Callable[[], None] | None = None,
) -> list[Process]:
    """Every client of ``variant`` as a process (``client_process``), in the workload's order: the clients-only half
    of ``drive``, which a backend whose service runs its own engine runs on its clock by itself."""
    return [
        client_process(variant, i, table, wait_limit_s, poll, on_end, on_first_await)
        for i in range(len(variant.workload.clients))
    ]


def engine_process(loop: EngineLoop, table: FuturesTable) -> Process:
    """The engine loop's steps; when the loop stops early, whatever is pending fails."""
    yield from loop.run()
    if loop.stopped:
        table.close(loop.stopped)


def drive(
    variant: ResolvedVariant,
    context: RunContext,
    result: RunResult,
    executor: CallExecutor,
    clock: Clock,
    spool: bool = False,
) -> RunResult:
    """Run ``variant``'s clients and engine on ``clock`` with ``executor``; fill ``result``'s calls, requests, log,
    totals and, for an executor with an adapter store (``executor.tenants``), its tenancy (log lines the backend
    already wrote stay after the engine's). ``spool``: each finished request's record
    goes to a ``RecordSpool`` (a temporary file) at once, and ``result.requests`` is that spool (same results, a
    fraction of the memory; the simulator's choice, ``SimOptions``)."""
    table = FuturesTable(variant, clock=clock.now, spool=RecordSpool() if spool else None)
    count = len(variant.workload.clients)
    finished = [0]
    lock = threading.Lock()
    wait_limit_s = variant.workload.result_timeout_s

    def client_finished() -> None:
        with lock:
            finished[0] += 1

    def call_finished(call: CallRecord) -> None:
        context.call_finished(call, result)  # every finished call told to the hooks

    tenants: TenantStore | None = getattr(executor, "tenants", None)  # an executor that keeps an adapter store
    if tenants is not None:
        tenants.start(variant.workload.initial_loaded_ids())  # raises TenancyError when they do not fit
    rule = context.padding_rule(variant.endpoint.trainer.strategy)
    on_call = call_finished if observes_calls(context) else None
    progress = getattr(context, "progress", None)
    if progress is not None:
        on_call = _telling_progress(progress, on_call)
    sampler = make_sampler(executor, table, clock, variant)
    loop = EngineLoop(
        variant, table, executor, rule, clients_done=lambda: finished[0] == count, on_call=on_call, sampler=sampler
    )
    if sampler is not None and loop.mode == "forwarded":
        table.forward = lambda request: sampler.submit([request])
    clients = client_processes(variant, table, wait_limit_s, variant.endpoint.engine.poll_interval_s, client_finished)
    clock.run(table, clients, engine_process(loop, table), wait_limit_s)
    result.calls = loop.calls
    result.requests = table.ordered_records()
    result.log = loop.log + result.log
    result.totals = variant.workload_totals()
    if tenants is not None:
        result.tenancy = tenancy_section(variant.endpoint, tenants.report())
    report = sampler.report() if sampler is not None else {}
    colocation = getattr(executor, "colocation_report", None)
    switching = colocation() if callable(colocation) else None
    if switching:
        report = {**report, "colocation": switching}
    if report:
        result.inference = {"mode": loop.mode, **report}
    finish = getattr(executor, "finish_result", None)  # what an executor knows about the whole run once it is over
    if callable(finish):
        finish(result)
    return result


def make_sampler(executor: CallExecutor, table: FuturesTable, clock: Clock, variant: ResolvedVariant) -> Sampler | None:
    """The executor's sampler for this run (``executor.sampler(table, clock)``), or None when it has none. Forwarded
    sampling needs one: samples bypass the engine, so there is no call to run them in."""
    factory = getattr(executor, "sampler", None)
    sampler = factory(table, clock) if callable(factory) else None
    if sampler is None and sampling_mode(variant.endpoint) == "forwarded":
        raise UserError(
            f"{variant.source} (variant {variant.variant_name}): this backend has no sampler to forward samples to "
            "(engine.sampling forwarded, or placement.colocate_all false on a SkyRL-Train strategy); set "
            "engine.sampling to continuous or serial"
        )
    return sampler
def _telling_progress(
    progress: Callable[[int], None], then: Callable[[CallRecord], None] | None
) -> Callable[[CallRecord], None]:
    """An ``on_call`` that counts the requests of every finished call for ``progress``, then calls ``then``."""
    done = [0]

    def on_call(call: CallRecord) -> None:
        done[0] += len(call.request_ids)
        progress(done[0])
        if then is not None:
            then(call)

    return on_call


def observes_calls(context: RunContext) -> bool:
    """Whether a plugin implements ``skyrl_sim_call_finished``: with none, the engine skips telling the hooks about each
    call (a hook call costs about as much as shaping the call). A host without pluggy hooks is always told."""
    hook = getattr(getattr(context.host, "hook", None), "skyrl_sim_call_finished", None)
    return hook is None or bool(hook.get_hookimpls())


def idle_delay(now: float, seconds: float, horizon: float) -> float:
    """How long an idle engine sleeps on the simulated clock: past every tick before ``horizon`` (the next event
    scheduled by anything else) at once, to the first tick at or after it.

    An idle tick before the horizon is a no-op: nothing else has run since the last one, so the engine finds nothing
    pending and sleeps again. Ticks are summed as the clock sums them (each is the previous one plus ``seconds``), and
    the one the engine wakes at gets the place among same-time events its one-by-one timeout would have had: it is
    scheduled after everything already queued, before anything scheduled later. When ``now`` plus the delay does not
    land exactly on that tick (float rounding), the engine takes one ordinary tick instead."""
    tick = now + seconds
    if tick >= horizon or horizon == float("inf"):
        return seconds
    while tick < horizon:
        tick = tick + seconds
    delay = tick - now
    return delay if now + delay == tick else seconds


class SimulatedTimeExceeded(Exception):
    """The engine was still running when simulated time reached the clock's cap."""


class SimpyClock:
    """Virtual time: every process is a simpy process; nothing waits for real. An ``Await`` gives up after the
    workload's result timeout of simulated time, and the run stops with ``SimulatedTimeExceeded`` at ``cap_s``.

    The reference for simulated time: the simulator runs on ``virtual_clock.VirtualClock``, which gives the same
    results at a fraction of the cost per event (tests/test_virtual_clock.py holds the two to the same bytes)."""

    def __init__(self, cap_s: float = float("inf")) -> None:
        self.env = simpy.Environment()
        self.cap_s = cap_s

    def now(self) -> float:
        return float(self.env.now)

    def call_at(self, at_s: float, action: Callable[[], None]) -> None:
        timer = self.env.timeout(max(0.0, at_s - float(self.env.now)))
        timer.callbacks.append(lambda _event: action())

    def run(self, table: FuturesTable, clients: list[Process], engine: Process, wait_limit_s: float) -> None:
        env = self.env
        done_events: dict[int, simpy.Event] = {}

        def done_event(request_id: int) -> simpy.Event:
            if request_id not in done_events:
                done_events[request_id] = env.event()
                if table.is_done(request_id):
                    done_events[request_id].succeed()
            return done_events[request_id]

        def on_done(request_id: int) -> None:
            event = done_event(request_id)
            if not event.triggered:
                event.succeed()

        table.on_done(on_done)

        submit = table.submit

        def simulated(process: Process) -> Generator[simpy.Event, Any, None]:
            reply: bool | int | None = None
            while (step := next_step(process, reply)) is not None:
                if isinstance(step, Submit):
                    reply = submit(step.planned).id  # in the table now; the client goes on at once
                    continue
                if isinstance(step, Idle):
                    yield env.timeout(idle_delay(env.now, step.seconds, env.peek()))
                    reply = None
                    continue
                if isinstance(step, Sleep):
                    yield env.timeout(step.seconds)
                    reply = None
                    continue
                event = done_event(step.request_id)
                if not event.triggered:
                    yield event | env.timeout(wait_limit_s)
                reply = event.triggered

        for process in clients:
            env.process(simulated(process))
        engine_run = env.process(simulated(engine))
        if self.cap_s == float("inf"):
            env.run()
            return
        env.run(until=simpy.AnyOf(env, [engine_run, env.timeout(self.cap_s)]))
        if engine_run.is_alive:
            raise SimulatedTimeExceeded(self.cap_s)


class WallClock:
    """Real time: each client is a thread, the engine runs in the calling thread; an ``Await`` gives up after the
    workload's result timeout, and a client thread still alive after ``join_s`` is left behind (daemon)."""

    def __init__(self, join_s: float = 30.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.t0 = time.monotonic()
        self.join_s = join_s
        self.sleep = sleep

    def now(self) -> float:
        return time.monotonic() - self.t0

    def call_at(self, at_s: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(max(0.0, at_s - self.now()), action)
        timer.daemon = True
        timer.start()

    def run(self, table: FuturesTable, clients: list[Process], engine: Process, wait_limit_s: float) -> None:
        events: dict[int, threading.Event] = {}
        lock = threading.Lock()

        def event(request_id: int) -> threading.Event:
            with lock:
                if request_id not in events:
                    events[request_id] = threading.Event()
                    if table.is_done(request_id):
                        events[request_id].set()
                return events[request_id]

        table.on_done(lambda request_id: event(request_id).set())

        def run(process: Process) -> None:
            reply: bool | int | None = None
            while (step := next_step(process, reply)) is not None:
                if isinstance(step, Submit):
                    reply = table.submit(step.planned).id
                elif isinstance(step, Sleep):
                    self.sleep(step.seconds)
                    reply = None
                else:
                    reply = event(step.request_id).wait(wait_limit_s)

        threads = [threading.Thread(target=run, args=(process,), daemon=True) for process in clients]
        for thread in threads:
            thread.start()
        run(engine)
        for thread in threads:
            thread.join(timeout=self.join_s)


class MeasuredTime:
    """A real executor's calls on simulated time: each call really runs, and its measured duration becomes the time
    the clock advances (``CallOutcome.wait_s``), so a ``VirtualClock`` orders client actions and engine iterations by
    when they are due, never by how fast the machine's threads get there. Which requests one call batches then cannot
    depend on the machine's speed or load (on the ``WallClock`` a slow client thread can straddle an engine snapshot);
    every call's duration, memory and failure are still measured. It offers no sampler: a real sampler's generations
    run concurrently on the wall clock, so a workload that samples runs on the ``WallClock``."""

    def __init__(self, executor: CallExecutor) -> None:
        self.executor = executor
        self.tenants: TenantStore | None = getattr(executor, "tenants", None)  # the executor's adapter store


    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        return self._advance(self.executor.batch(call, shape))

    def single(self, request: Request) -> CallOutcome:
        return self._advance(self.executor.single(request))

    @staticmethod
    def _advance(outcome: CallOutcome) -> CallOutcome:
        outcome.wait_s = max(outcome.wait_s, outcome.duration_s)
        return outcome

"""Simulated time on one heap of events: simpy's event order, without simpy's objects.

``SimpyClock`` (``driver``) runs every client and the engine as a simpy process; each step of a process makes simpy
``Event`` objects, a callback list, a ``Condition`` for an ``Await`` and a process resume, about 6 events per request.
``VirtualClock`` runs the same processes on a plain heap of tuples and gives every result bit for bit: its heap holds
the entries that resume a process, keyed as simpy keys its queue (time, then the order they were scheduled in; simpy's
one urgent priority, a process's start, needs no key: the starts are the first entries of all), and each is pushed at
the moment simpy would schedule the event it stands for. So same-time events run in simpy's order. What simpy
schedules that can never resume anything is left out (the done event of a request nobody waits for, a client
process's end): leaving out an entry keeps the order of the others, and an ``Idle`` engine, which reads the next
entry's time, may only pass more of its no-op ticks at once (``driver.idle_delay``). A wait's time-out stays after
its result came, as in simpy, and is dropped when its time comes. Every time-out is the same time after the moment
it is scheduled, so the time-outs come in the order they are scheduled: they wait in a queue of their own beside the
heap (the next event is the earlier of the two heads, by the same key), and the heap stays the size of what is
under way rather than of every wait of the last ``wait_limit_s``. tests/test_virtual_clock.py compares the two clocks
event by event and result by result.

simpy's hops, one heap entry each:

* a process starts with an event at time 0 (clients in order, then the engine);
* ``Submit`` is no hop: the request goes in the table and the process goes on at once (simpy's process does the same);
* ``Sleep(s)`` (and ``Idle``, by ``idle_delay``) is a time-out at now + s;
* ``Await`` on a result not yet written is a condition over the request's done event and a time-out of
  ``wait_limit_s``: the done event is scheduled when the result is written, and when it (or the time-out) is processed
  the condition is scheduled, and only when the condition is processed does the process resume (reply: whether the
  result is written by then). On a result already written the process goes on at once (reply True);
* with a cap on simulated time, the run ends when either the engine's end or the cap time-out is processed, one
  more hop later (the condition simpy's ``run(until=...)`` waits for).
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from heapq import heappop, heappush
from typing import Any

from skyrl_sim.engine.clients import Await, Idle, Sleep, Submit
from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.plugin_host.driver import Process, SimulatedTimeExceeded, idle_delay

RESUME = 0  # resume the process with no reply (its start, or a sleep's end)
WAKE = 1  # the condition of an Await was processed: resume the process with whether its result is written
DONE = 2  # a result waited for was written: the waiting conditions are scheduled
TIME_OUT = 3  # an Await's time-out: its condition is scheduled if nothing triggered it yet
ENDING = 4  # the engine's end or the cap's time-out: the stop condition is scheduled
STOP = 5  # the stop condition: the run ends
TIMER = 6  # a ``call_at`` action: called when its time comes (simpy: a time-out with a callback)


class Waiter:
    """One process on the clock, and the ``Await`` it is blocked in (``token`` tells a current wait from an old one)."""

    __slots__ = ("process", "token", "pending", "request_id", "finished")

    def __init__(self, process: Process) -> None:
        self.process = process
        self.token = 0
        self.pending = False
        self.request_id = 0
        self.finished = False


class VirtualClock:
    """Virtual time like ``SimpyClock``, about 5x cheaper per event: an ``Await`` gives up after the workload's result
    timeout of simulated time, and the run stops with ``SimulatedTimeExceeded`` at ``cap_s``."""

    def __init__(self, cap_s: float = float("inf")) -> None:
        self.cap_s = cap_s
        self._now = 0.0
        self._timer: Callable[[float, Callable[[], None]], None] | None = None

    def now(self) -> float:
        return self._now

    def call_at(self, at_s: float, action: Callable[[], None]) -> None:
        """``action()`` at ``at_s`` (at once, after what is already due now, if it has passed); only while running."""
        if self._timer is None:
            raise RuntimeError("VirtualClock.call_at is only available while the clock runs")
        self._timer(max(at_s, self._now), action)

    def run(self, table: FuturesTable, clients: list[Process], engine: Process, wait_limit_s: float) -> None:
        with cyclic_gc_paused():
            self._run(table, clients, engine, wait_limit_s)

    def _run(self, table: FuturesTable, clients: list[Process], engine: Process, wait_limit_s: float) -> None:
        queue: list[tuple[Any, ...]] = []
        timeouts: deque[tuple[Any, ...]] = deque()  # the Awaits' time-outs, in the order (and so the time) they fire
        order = 0  # simpy's event id: same-time entries of one priority run in the order they were scheduled
        waiting: dict[int, list[tuple[Waiter, int]]] = {}
        is_done = table.is_done
        submit = table.submit
        capped = self.cap_s != float("inf")
        engine_waiter = Waiter(engine)
        stopping = False

        def on_done(request_id: int) -> None:
            nonlocal order
            waiters = waiting.pop(request_id, None)
            if waiters is not None:
                heappush(queue, (self._now, order, DONE, waiters))
                order += 1

        table.on_done(on_done)

        def resume(waiter: Waiter, reply: bool | int | None) -> None:
            """Run the process to its next wait and schedule what that wait is."""
            nonlocal order
            process = waiter.process
            while True:
                try:
                    step = process.send(reply)
                except StopIteration:
                    waiter.finished = True
                    if capped and waiter is engine_waiter:
                        heappush(queue, (self._now, order, ENDING, None))
                        order += 1
                    return
                kind = type(step)
                if kind is Await:
                    request_id = step.request_id
                    if is_done(request_id):
                        reply = True
                        continue
                    waiter.token += 1
                    waiter.pending = True
                    waiter.request_id = request_id
                    waiting.setdefault(request_id, []).append((waiter, waiter.token))
                    timeouts.append((self._now + wait_limit_s, order, TIME_OUT, (waiter, waiter.token)))
                    order += 1
                    return
                if kind is Submit:
                    reply = submit(step.planned).id  # in the table now; the process goes on at once
                    continue
                seconds = step.seconds
                if kind is Idle:
                    following = min(queue[0][0] if queue else float("inf"), timeouts[0][0] if timeouts else float("inf"))
                    seconds = idle_delay(self._now, seconds, following)
                elif not isinstance(step, Sleep):
                    raise TypeError(f"a process yielded {step!r}, not a Sleep, a Submit or an Await")
                if seconds < 0:
                    raise ValueError(f"Negative delay {seconds}")
                heappush(queue, (self._now + seconds, order, RESUME, waiter))
                order += 1
                return

        def timer(at_s: float, action: Callable[[], None]) -> None:
            nonlocal order
            heappush(queue, (at_s, order, TIMER, action))
            order += 1

        self._timer = timer

        def wake(waiter: Waiter, token: int) -> None:
            """The wait's condition is triggered (first of its result and its time-out): schedule the resume."""
            nonlocal order
            if waiter.pending and waiter.token == token:
                waiter.pending = False
                heappush(queue, (self._now, order, WAKE, waiter))
                order += 1

        for process in [*clients, engine]:
            heappush(queue, (0.0, order, RESUME, engine_waiter if process is engine else Waiter(process)))
            order += 1
        if capped:
            heappush(queue, (self.cap_s, order, ENDING, None))
            order += 1
        while queue or timeouts:
            # the earlier of the heap's head and the next time-out (the same key: time, then order)
            if timeouts and (not queue or timeouts[0] < queue[0]):
                self._now, _, action, subject = timeouts.popleft()
            else:
                self._now, _, action, subject = heappop(queue)
            if action == RESUME:
                resume(subject, None)
            elif action == WAKE:
                resume(subject, is_done(subject.request_id))
            elif action == DONE:
                for waiter, token in subject:
                    wake(waiter, token)
            elif action == TIME_OUT:
                wake(*subject)
            elif action == TIMER:
                subject()
            elif action == ENDING:
                if not stopping:
                    stopping = True
                    heappush(queue, (self._now, order, STOP, None))
                    order += 1
            else:
                break
        self._timer = None
        if capped and not engine_waiter.finished:
            raise SimulatedTimeExceeded(self.cap_s)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a simulated run, and restored after it.

    A run allocates a few objects per event and keeps one record per call and per request; the collector's full passes
    rescan all of them, again and again as they pile up (a quarter of a 20,000-request run's time). The run makes
    almost no cycles (the time model's bounded caches, a few thousand objects whatever the size of the run), so nothing
    is lost: they are collected once the collector is back. Safe on a simulated clock, where the run is one thread.

    What the run made is handed to the oldest generation when the collector comes back (``gc.freeze`` then
    ``gc.unfreeze``, both constant-time), so the first young-generation pass after the run does not scan the whole run
    once more; the next full pass collects any cycle among them. Skipped when the process froze objects of its own."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()

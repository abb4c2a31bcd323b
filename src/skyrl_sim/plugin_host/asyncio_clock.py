"""Real time on an asyncio event loop, for a backend whose service runs its own engine (``--backend tinker``).

The driver's client processes (``driver.client_processes``) run here unchanged, so a live service sees the same client
behaviour the simulator models, from one interpreter of the client scripts. What differs is only how a step is
executed, and that is this clock's:

* ``Sleep``: ``asyncio.sleep``;
* ``Submit``: the backend's ``submit`` callback is awaited (an HTTP submission, held to the backend's own timeout; a
  failed submission fails that request and still answers its id), and the client goes on with the id it answers.
  Consecutive ``Submit``s of one client are made under one lock, the burst lock, taken at the first and let go at the
  client's next other step: a burst reaches the service together and in order, as the same-instant submissions of the
  simulator do, never interleaved with another client's burst;
* ``Await``: waits on the request's ``asyncio.Event`` (``done``, set by the backend when its result, or its failure,
  is known), at most ``wait_limit_s`` (then the client gives up on it: ``driver.client_process`` tells the table).

There is no engine process and no ``call_at``: the service runs its engine and its samplers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from skyrl_sim.engine.clients import Await, Sleep, Submit
from skyrl_sim.plugin_host.driver import Process, next_step
from skyrl_sim.schema.variant import PlannedRequest


class AsyncioClock:
    """Real time for client processes on the running event loop. ``submit(planned)`` hands one request to the service
    and answers the id the client knows it by (a failed submission too: its ``done`` is then already set);
    ``done(request_id)`` is the event set once that request's result or failure is known. ``t0``: the run's start
    (``time.monotonic()``), now by default."""

    def __init__(
        self,
        submit: Callable[[PlannedRequest], Awaitable[int]],
        done: Callable[[int], asyncio.Event],
        t0: float | None = None,
    ) -> None:
        self.t0 = time.monotonic() if t0 is None else t0
        self.submit = submit
        self.done = done
        self.burst = asyncio.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, clients: list[Process], wait_limit_s: float) -> None:
        """Run every client process to its end, concurrently."""
        await asyncio.gather(*(self.run_one(process, wait_limit_s) for process in clients))

    async def run_one(self, process: Process, wait_limit_s: float) -> None:
        """One process's steps, in order; the burst lock is let go however it ends."""
        reply: bool | int | None = None
        holding = False
        try:
            while (step := next_step(process, reply)) is not None:
                kind = type(step)
                if holding and kind is not Submit:
                    self.burst.release()
                    holding = False
                if kind is Submit:
                    if not holding:
                        await self.burst.acquire()
                        holding = True
                    reply = await self.submit(step.planned)  # type: ignore[union-attr]
                elif kind is Await:
                    try:
                        await asyncio.wait_for(self.done(step.request_id).wait(), wait_limit_s)  # type: ignore[union-attr]
                        reply = True
                    except TimeoutError:
                        reply = False
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    reply = None
                else:
                    raise TypeError(f"a process yielded {step!r}, not a Sleep, a Submit or an Await")
        finally:
            if holding:
                self.burst.release()
            process.close()

"""One interpreter of the client scripts: the driver's client processes (``driver.client_processes``) run on the
simulator's clocks and, on an ``AsyncioClock``, against a live service (``--backend tinker``), whose backend supplies
only what a step does there (its submit and collect callbacks). So a client action is written once, and the live
client keeps what a live service sees: a burst of one client goes out together and in order, a submission is awaited,
a wait has a limit and a client that gives up fails its request, and a held engine is released once every client
waits."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path
from typing import Any

import yaml

from project_paths import SCENARIOS
from skyrl_sim.engine.clients import Await, Sleep, Submit
from skyrl_sim.plugin_host.asyncio_clock import AsyncioClock
from skyrl_sim.plugin_host.driver import client_processes
from skyrl_sim.plugin_host.virtual_clock import VirtualClock
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.variant import PlannedRequest, ResolvedVariant
from test_virtual_clock import result_of, sim_executor

ROOT = Path(__file__).resolve().parents[1]
TINKER_BACKEND = ROOT / "src" / "skyrl_sim_plugins" / "tinker_client" / "backend.py"
SCRIPT_NAMES = {"client_script", "sdk_client_script", "Sleep", "SleepUntil", "Submit", "Await", "Idle", "opening"}


def test_the_tinker_backend_has_no_client_interpreter_of_its_own() -> None:
    """The backend neither imports nor names a client script or its actions: it runs the driver's client processes
    on an ``AsyncioClock``. A client action added to ``engine/clients.py`` and the driver is then honoured live too."""
    tree = ast.parse(TINKER_BACKEND.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not (imported | named) & SCRIPT_NAMES
    assert {"client_processes", "AsyncioClock"} <= imported


def bursts(tmp_path: Path) -> ResolvedVariant:
    """Three clients at t = 0, no time between submissions: two submit their whole list as one burst, one awaits
    each request before the next (its own bursts are one request long)."""
    body = {
        "name": "bursts",
        "endpoint": str(SCENARIOS / "endpoints" / "skyrl-jax-cpu.yaml"),
        "workload": {
            "clients": [
                {
                    "name": name,
                    "model_id": name,
                    "submit": {"mode": mode, "gap_s": 0},
                    "requests": [
                        {"type": "forward_backward", "lengths": [5 + i, 9]},
                        {"type": "forward", "lengths": [7]},
                        {"type": "optim_step"},
                        {"type": "forward_backward", "lengths": [14 + i]},
                    ],
                }
                for i, (name, mode) in enumerate([("a", "back_to_back"), ("b", "after_previous"), ("c", "back_to_back")])
            ]
        },
    }
    path = tmp_path / "bursts.yaml"
    path.write_text(yaml.safe_dump(body))
    return load_scenario(path).resolve("default")


class LiveTable:
    """What a live backend keeps for the client processes (as ``tinker_client.backend._Run`` does): its clock, the
    failures of requests given up on, and one ``asyncio.Event`` per request."""

    def __init__(self, variant: ResolvedVariant, result_after_s: float, fail: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.variant = variant
        self.t0 = time.monotonic()
        self.clock = lambda: time.monotonic() - self.t0
        self.result_after_s = result_after_s
        self.fail = fail
        self.sent: list[tuple[str, str, int]] = []
        self.done: dict[int, asyncio.Event] = {}
        self.given_up: dict[int, str] = {}
        self.first_awaits = 0

    async def submit(self, planned: PlannedRequest) -> int:
        key = len(self.done) + 1
        self.done[key] = asyncio.Event()
        await asyncio.sleep(0)  # an HTTP submission: other clients run meanwhile
        self.sent.append((self.variant.workload.clients[planned.client_index].name, planned.spec.type, sum(planned.datums)))
        if key in self.fail:
            self.done[key].set()  # a failed submission: the request's failure is known at once
        else:
            asyncio.get_running_loop().call_later(self.result_after_s, self.done[key].set)
        return key

    def give_up(self, request_id: int, error: str) -> None:
        self.given_up[request_id] = error
        self.done[request_id].set()  # the request has failed as its client sees it

    def retrieved(self, request_id: int, seen_s: float) -> None:
        raise AssertionError("a live client has no poller tick")

    def first_await(self) -> None:
        self.first_awaits += 1

    def run(self, wait_limit_s: float) -> None:
        async def main() -> None:
            clock = AsyncioClock(self.submit, self.done.__getitem__, self.t0)
            processes = client_processes(self.variant, self, wait_limit_s, None, on_first_await=self.first_await)
            await clock.run(processes, wait_limit_s)

        asyncio.run(main())


def test_live_clients_submit_in_the_simulators_order(tmp_path: Path) -> None:
    """Same-instant bursts reach a live service as the simulator's table numbers them: each client's burst together
    and in order, never interleaved with another's, although every submission lets the others run."""
    variant = bursts(tmp_path)
    simulated = result_of(variant, sim_executor(variant)(), VirtualClock())
    expected = [(r.client, r.type, r.tokens) for r in simulated.requests]
    live = LiveTable(variant, result_after_s=0.01)
    live.run(wait_limit_s=10.0)
    assert live.sent == expected
    assert [c for c, _, _ in expected[:4]] == ["a"] * 4  # the first burst is client a's whole list
    assert not live.given_up and live.first_awaits == 3


def test_a_wait_past_its_limit_gives_up_and_a_failed_submission_is_awaited_at_once(tmp_path: Path) -> None:
    variant = bursts(tmp_path)
    live = LiveTable(variant, result_after_s=30.0, fail={1, 2, 3, 4})  # client a's burst fails on submission
    start = time.monotonic()
    live.run(wait_limit_s=0.2)
    assert time.monotonic() - start < 10.0
    assert 1 not in live.given_up and 4 not in live.given_up  # their failure was known: nothing to give up on
    assert live.given_up and all(error == "timed out: no result within 0.2 s" for error in live.given_up.values())
    assert live.first_awaits == 3


def test_the_burst_lock_is_let_go_at_the_clients_next_other_step() -> None:
    """A process's consecutive Submits hold the lock; its Sleep lets another client's burst go first."""
    order: list[str] = []

    async def main() -> None:
        events: dict[int, asyncio.Event] = {}

        async def submit(planned: Any) -> int:
            await asyncio.sleep(0)
            order.append(planned)
            events[len(order)] = asyncio.Event()
            events[len(order)].set()
            return len(order)

        def process(name: str, pause: float) -> Any:
            for i in range(3):
                yield Submit(f"{name}{i}")  # type: ignore[arg-type]
            yield Sleep(pause)
            request_id = yield Submit(f"{name}3")  # type: ignore[arg-type]
            assert (yield Await(request_id)) is True

        clock = AsyncioClock(submit, events.__getitem__)
        await clock.run([process("x", 0.05), process("y", 0.0)], 1.0)
        assert not clock.burst.locked()

    asyncio.run(main())
    assert order == ["x0", "x1", "x2", "y0", "y1", "y2", "y3", "x3"]

"""Continuous sampling against SkyRL 0.4.0's own engine code: admission and drain, in order and in time.

SkyRL's side is its real ``TinkerEngine.process_pending_requests_once`` and ``_ContinuousSampler`` over a SQLite
futures table, in the SkyRL service venv (``skyrl_engine_harness.py``: a stand-in backend, a virtual clock). This
side is ``skyrl_sim.engine.loop.EngineLoop`` (with ``rules.plan_iteration``) over a ``FuturesTable``, with a stand-in
sampler and executor on the same virtual clock: an iteration takes one unit, a sample ends ``duration`` units after
its admission, passes and singles take none, requests arrive at their times in id order.

Every admission (which samples, when), drain (which in-flight samples, before what, when), backend call, single
phase and completion must be the same, event for event, on random mixes of two models' passes, optim steps, sampler
saves and samples (two checkpoints per model, so the one-checkpoint-per-model rule is exercised while others are in
flight).
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from skyrl_service import install_service_venv

from skyrl_sim.engine.clients import Sleep
from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.engine.loop import CallOutcome, EngineLoop
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import BatchCall
from skyrl_sim.engine.shapes import MEGATRON, CallShape
from skyrl_sim.schema.requests import RequestSpec
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.variant import PlannedRequest

pytestmark = pytest.mark.service

HARNESS = Path(__file__).resolve().parent / "skyrl_engine_harness.py"
ROOT = Path(__file__).resolve().parents[2]
MIXES = 25


def random_workload(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(rng.randint(6, 22)):
        t += rng.choice([0.0, 0.0, 0.5, 1.0, 2.5])
        kind = rng.choice(["forward_backward", "forward_backward", "forward", "optim_step", "sample", "sample", "sample"])
        if kind == "optim_step" and rng.random() < 0.3:
            kind = "save_weights_for_sampler"
        out.append(
            {
                "type": kind,
                "model_id": rng.choice(["a", "b"]),
                "arrive": round(t, 3),
                "duration": round(rng.uniform(0.3, 6.0), 3),
                "checkpoint": rng.choice(["c1", "c1", "c2"]) if kind == "sample" else "",
            }
        )
    return out


def skyrl_events(python: Path, workload: list[dict[str, Any]], folder: Path) -> list[list[Any]]:
    events = folder / "skyrl-events.json"
    out = subprocess.run(
        [str(python), str(HARNESS), str(events)],
        input=json.dumps({"requests": workload}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(events.read_text())


class StandInSampler:
    """A sampler whose samples end ``duration`` after their admission; the driver writes them when they are due."""

    def __init__(self, table: FuturesTable, clock: list[float], durations: dict[int, float], events: list[list[Any]]):
        self.table = table
        self.clock = clock
        self.durations = durations
        self.events = events
        self.due: dict[int, float] = {}
        self.reasons: list[str] = []
        self.drains = 0

    def submit(self, requests: Sequence[Request]) -> None:
        self.events.append(["admit", self.clock[0], sorted(r.id for r in requests), ""])
        for r in requests:
            self.due[r.id] = self.clock[0] + self.durations[r.id]

    def in_flight(self) -> int:
        return len(self.due)

    def drain(self) -> Generator[Sleep, None, None]:
        if len(self.reasons) > self.drains:  # announced: a drain before blocking work (not the run's end)
            self.drains = len(self.reasons)
            self.events.append(["drain", self.clock[0], sorted(self.due), self.reasons[-1]])
        while self.due:
            yield Sleep(max(self.due.values()) - self.clock[0])

    def complete_until(self, until: float) -> None:
        for request_id in sorted((i for i, t in self.due.items() if t <= until), key=lambda i: (self.due[i], i)):
            self.clock[0] = max(self.clock[0], self.due.pop(request_id))
            self.table.finish([request_id])
            self.events.append(["done", self.clock[0], [request_id], ""])

    def wave(self, requests: Sequence[Request]) -> Generator[Sleep, None, CallOutcome]:
        raise AssertionError("continuous mode runs no sample wave")
        yield Sleep(0.0)

    def report(self) -> dict[str, Any]:
        return {}


class DrainReasons(list[str]):
    """The engine loop's log, keeping the reason of each drain it announces (SkyRL's ``drain(reason)``)."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__()
        self.reasons = reasons

    def append(self, line: str) -> None:
        if line.startswith("Draining "):
            self.reasons.append(line.split(" before ", 1)[1].removesuffix(" ..."))
        super().append(line)


class StandInExecutor:
    def __init__(self, clock: list[float], events: list[list[Any]]) -> None:
        self.clock = clock
        self.events = events

    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        self.events.append([call.kind, self.clock[0], sorted(call.request_ids), ""])
        return CallOutcome(duration_s=0.0)

    def single(self, request: Request) -> CallOutcome:
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "singles" and last[1] == self.clock[0] and last[3] == "open":
            last[2].append(request.id)
        else:
            self.events.append(["singles", self.clock[0], [request.id], "open"])
        return CallOutcome(duration_s=0.0)


def our_events(tmp_path: Path, workload: list[dict[str, Any]]) -> list[list[Any]]:
    clients = [
        {"name": name, "model_id": name, "requests": [{"type": "optim_step"}]} for name in ("a", "b")
    ]  # the clients only name the models: requests are inserted below, at their arrival times
    body = {
        "name": "continuous",
        "endpoint": {
            "name": "continuous",
            "model": "tiny-dense",
            "hardware": {"profile": "cpu", "devices": 1},
            "trainer": {"strategy": "megatron"},
            "engine": {"sampling": "continuous", "iteration_sleep_s": 1.0},
        },
        "workload": {"clients": clients},
    }
    path = tmp_path / "continuous.yaml"
    path.write_text(yaml.safe_dump(body))
    variant = load_scenario(path).resolve("default")
    clock = [0.0]
    events: list[list[Any]] = []
    table = FuturesTable(variant, clock=lambda: clock[0])
    durations = {i + 1: float(r["duration"]) for i, r in enumerate(workload)}
    sampler = StandInSampler(table, clock, durations, events)
    inserted = [0]

    def insert(until: float) -> None:
        while inserted[0] < len(workload) and workload[inserted[0]]["arrive"] <= until:
            r = workload[inserted[0]]
            spec = RequestSpec(
                type=r["type"],
                datums=[3] if r["type"] in ("forward_backward", "forward") else None,
                checkpoint=r["checkpoint"],
                prompt_tokens=3,
                max_tokens=4,
            )
            table.submit(PlannedRequest(0 if r["model_id"] == "a" else 1, inserted[0], spec, (3,) if spec.datums else ()))
            inserted[0] += 1

    loop = EngineLoop(
        variant, table, StandInExecutor(clock, events), MEGATRON, lambda: inserted[0] == len(workload), sampler=sampler
    )
    loop.log = DrainReasons(sampler.reasons)
    insert(0.0)
    run = loop.run()
    try:
        step = next(run)
        for _ in range(100_000):
            target = clock[0] + step.seconds
            sampler.complete_until(target)
            clock[0] = target
            insert(clock[0])
            step = run.send(None)
    except StopIteration:
        pass
    for event in events:
        if event[0] == "singles":
            event[3] = ""
        event[1] = round(event[1], 9)
    return events


@pytest.fixture(scope="module")
def python() -> Path:
    return install_service_venv()


@pytest.mark.parametrize("seed", range(MIXES))
def test_continuous_admission_and_drain_match_skyrl(seed: int, tmp_path: Path, python: Path) -> None:
    workload = random_workload(seed)
    theirs = skyrl_events(python, workload, tmp_path)
    ours = our_events(tmp_path, workload)
    assert ours == theirs, "\n".join(f"{a}  |  {b}" for a, b in zip(theirs, ours, strict=False))


def test_the_mixes_exercise_drains_and_deferred_samples(tmp_path: Path) -> None:
    """Most mixes drain in-flight samples before blocking work, and some defer samples newer than it."""
    drains = deferred = 0
    for seed in range(MIXES):
        events = our_events(tmp_path, random_workload(seed))
        drains += any(e[0] == "drain" for e in events)
        admits = [e for e in events if e[0] == "admit"]
        deferred += len(admits) > 1
    assert drains >= MIXES // 2
    assert deferred >= MIXES // 2

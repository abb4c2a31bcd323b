"""SkyRL 0.4.0's own engine, continuous sampling on, driven iteration by iteration on a virtual clock.

Run inside the SkyRL service venv (``.venv-skyrl-service``), never imported by the test process::

    python skyrl_engine_harness.py EVENTS.json < workload.json

The engine is SkyRL's ``TinkerEngine`` with its real ``process_pending_requests_once``, ``_admit_samples_continuous``,
``find_*`` queries and ``_ContinuousSampler`` (its background asyncio thread and DB writer), over a real SQLite
futures table. Only the backend is a stand-in (``StandInBackend``): every model is loaded, passes and singles finish
at once, and ``sample_batch_async`` waits until the harness releases that sample.

Time is virtual: an iteration takes one unit (the engine's poll sleep); a sample admitted at time ``t`` ends at
``t + duration``. After each iteration the clock moves one unit, the samples due by then are released (in the order
of their ends, then ids, each written before the next is released), and the requests arriving by then are inserted
(in id order). A drain (``_ContinuousSampler.drain``) moves the clock to the last in-flight sample's end, releasing
them in order. Passes and singles take no time.

The workload (stdin JSON): ``{"requests": [{"type", "model_id", "arrive", "duration", "checkpoint"}...]}`` in id order
(ids 1, 2, ... are the autoincrement keys the inserts get). The events (JSON, to the file named by the first argument;
SkyRL logs to stdout): ``[kind, time, ids, detail]``
for every admission, drain, backend call, single phase and completion, in the order they happen.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import typing
from pathlib import Path
from typing import Any

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]  # skyrl's pydantic types need it on 3.11

from skyrl.tinker import engine as skyrl_engine  # noqa: E402
from skyrl.tinker import types  # noqa: E402
from skyrl.tinker.db_models import FutureDB, RequestStatus  # noqa: E402
from sqlmodel import Session, SQLModel, create_engine, select  # noqa: E402

EVENTS: list[list[Any]] = []
CLOCK = [0.0]
LOCK = threading.Lock()


def log(kind: str, ids: list[int], detail: str = "") -> None:
    with LOCK:
        EVENTS.append([kind, round(CLOCK[0], 9), sorted(ids), detail])


class StandInBackend:
    """Every model loaded; SkyRL-Train's awaitable sample path, each sample ending when the harness says."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.registered = threading.Condition()

    def has_model(self, model_id: str) -> bool:
        return True

    def prepare_for_sampling(self) -> None:
        return None

    async def sample_batch_async(self, prepared: types.PreparedSampleBatch) -> dict[str, Any]:
        (request_id, *_rest) = prepared.request_batch_slices[0]
        event = asyncio.Event()
        with self.registered:
            self.loop = asyncio.get_running_loop()
            self.gates[request_id] = event
            self.registered.notify_all()
        await event.wait()
        return {request_id: types.OptimStepOutput()}

    def release(self, request_id: str) -> None:
        with self.registered:
            self.registered.wait_for(lambda: request_id in self.gates, timeout=30)
            event = self.gates.pop(request_id)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(event.set)


REQUEST_DATA = {
    "forward_backward": lambda r: {
        "data": [
            {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": [2, 3, 4]},
                    "weights": {"data": [1.0, 1.0, 1.0]},
                    "advantages": {"data": []},
                    "logprobs": {"data": []},
                },
            }
        ],
        "loss_fn": "cross_entropy",
    },
    "optim_step": lambda r: {
        "adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}
    },
    "save_weights_for_sampler": lambda r: {"path": r.get("checkpoint") or "ck"},
    "sample": lambda r: {
        "base_model": None,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"temperature": 1.0, "max_tokens": 4, "seed": 0},
        "num_samples": 1,
        "checkpoint_id": r.get("checkpoint") or "",
        "prompt_logprobs": False,
    },
}
REQUEST_DATA["forward"] = REQUEST_DATA["forward_backward"]


def main() -> None:
    workload = json.load(sys.stdin)
    requests = workload["requests"]
    folder = Path(tempfile.mkdtemp(prefix="skyrl-harness-"))
    db = create_engine(f"sqlite:///{folder / 'tinker.db'}")
    SQLModel.metadata.create_all(db)
    backend = StandInBackend()

    engine = skyrl_engine.TinkerEngine.__new__(skyrl_engine.TinkerEngine)
    engine.config = type(
        "Config",
        (),
        {"session_cleanup_interval_sec": -1, "session_timeout_sec": -1, "backend": "megatron", "checkpoints_base": folder},
    )()
    engine.db_engine = db
    engine.backend = backend
    engine._sampler = None
    engine._continuous_sampling = True
    engine._last_cleanup_time = 0.0
    engine._profiling_model_id = None
    engine._profiler_cfg = None

    def pass_call(kind: str) -> Any:
        def run(group: dict[str, Any]) -> dict[str, Any]:
            log(kind, [int(i) for i in group])
            return {rid: types.OptimStepOutput() for rid in group}

        return run

    engine.process_forward_backward = pass_call("forward_backward")  # type: ignore[method-assign]
    engine.process_forward = pass_call("forward")  # type: ignore[method-assign]
    engine.process_single_request = lambda request_type, model_id, data: types.OptimStepOutput()  # type: ignore[method-assign]
    singles = engine.process_single_requests

    def logged_singles(group: dict[str, Any]) -> None:
        if group:
            log("singles", [int(i) for i in group])
        singles(group)

    engine.process_single_requests = logged_singles  # type: ignore[method-assign]
    admit = engine._admit_samples_continuous

    due: dict[int, float] = {}

    def logged_admit(sample_requests: dict[str, Any]) -> None:
        ids = [int(i) for i in sample_requests]
        log("admit", ids)
        for i in ids:
            due[i] = CLOCK[0] + float(requests[i - 1]["duration"])
        admit(sample_requests)

    engine._admit_samples_continuous = logged_admit  # type: ignore[method-assign]

    def release_due(until: float) -> None:
        """Move the clock to ``until``, releasing the samples due by then at their own ends, in order."""
        for i in sorted((i for i, t in due.items() if t <= until), key=lambda i: (due[i], i)):
            CLOCK[0] = max(CLOCK[0], due[i])
            del due[i]
            backend.release(str(i))
            wait_written(i)
            log("done", [i])
        CLOCK[0] = max(CLOCK[0], until)

    original_drain = skyrl_engine._ContinuousSampler.drain

    def logged_drain(self: Any, reason: str) -> None:
        inflight = [int(i) for i in self.inflight_ids]
        if inflight:
            log("drain", inflight, reason)
            release_due(max(due[i] for i in inflight))
        original_drain(self, reason)

    skyrl_engine._ContinuousSampler.drain = logged_drain  # type: ignore[method-assign]

    def wait_written(request_id: int) -> None:
        for _ in range(3000):
            with Session(db) as session:
                row = session.get(FutureDB, request_id)
                if row is not None and row.status != RequestStatus.PENDING:
                    break
            threading.Event().wait(0.01)
        sampler = engine._sampler
        for _ in range(3000):
            if sampler is None or str(request_id) not in sampler.inflight_ids:
                return
            threading.Event().wait(0.01)
        raise RuntimeError(f"sample {request_id} was not written")

    inserted = 0

    def insert_arrivals(until: float) -> None:
        nonlocal inserted
        with Session(db) as session:
            while inserted < len(requests) and requests[inserted]["arrive"] <= until:
                r = requests[inserted]
                kind = r["type"]
                session.add(
                    FutureDB(
                        request_id=inserted + 1,
                        request_type=types.RequestType(kind),
                        model_id=r["model_id"] if kind != "sample" or r.get("checkpoint") else "",
                        request_data=REQUEST_DATA[kind](r),
                    )
                )
                inserted += 1
            session.commit()

    insert_arrivals(0.0)
    for _ in range(10_000):
        engine.process_pending_requests_once()
        release_due(CLOCK[0] + 1.0)  # the engine's poll sleep
        insert_arrivals(CLOCK[0])
        with Session(db) as session:
            pending = session.exec(select(FutureDB).where(FutureDB.status == RequestStatus.PENDING)).first()
        if inserted == len(requests) and pending is None and not due:
            break
    Path(sys.argv[1]).write_text(json.dumps(EVENTS))


if __name__ == "__main__":
    main()

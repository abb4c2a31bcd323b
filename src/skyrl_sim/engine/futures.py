"""SkyRL's futures table: the queue *is* this table.

Every submitted request becomes a pending row whose id is the arrival order; the engine reads the pending rows and
writes each request's result. One table serves both the simulated clock and the real one, so it takes the clock
as a function and is safe to use from several threads.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from skyrl_sim.results.result import RequestRecord
from skyrl_sim.schema.scenario import PlannedRequest, Request, ResolvedVariant

Listener = Callable[[int], None]


def poll_tick(now: float, interval: float) -> float:
    """When a client sees a result written at ``now``: the result poller's next tick (it checks every ``interval``)."""
    return math.ceil(now / interval - 1e-9) * interval


class FuturesTable:
    def __init__(self, variant: ResolvedVariant, clock: Callable[[], float]) -> None:
        self.variant = variant
        self.clock = clock
        self.records: dict[int, RequestRecord] = {}
        self.requests: dict[int, Request] = {}
        self._pending: dict[int, Request] = {}
        self._next_id = 1
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []
        self.closed: str | None = None

    def close(self, reason: str) -> None:
        """The engine has stopped: fail what is pending, and every later submission at once."""
        self.closed = reason
        ids = [r.id for r in self.pending()]
        if ids:
            self.finish(ids, error=f"not run: backend stopped ({reason})")

    def on_done(self, listener: Listener) -> None:
        """Call ``listener(request_id)`` whenever a request's result is written."""
        self._listeners.append(listener)

    def submit(self, planned: PlannedRequest) -> Request:
        """Insert a pending row; its id is the next in arrival order."""
        client = self.variant.workload.clients[planned.client_index]
        spec = planned.spec
        kind = spec.type
        datums = planned.datums
        sample = kind == "sample"
        with self._lock:
            request_id = self._next_id
            self._next_id = request_id + 1
            request = Request(
                request_id,
                kind,
                client.model_id,
                datums,
                spec.learning_rate,
                spec.prompt_tokens if sample else 0,
                spec.max_tokens if sample else 0,
                spec.num_samples,
                spec.checkpoint,
                client.name,
            )
            self.requests[request_id] = request
            self._pending[request_id] = request
            self.records[request_id] = RequestRecord(
                request_id, kind, client.model_id, sum(datums), self.clock(), client=client.name, datums=list(datums)
            )
        if self.closed is not None:
            self.finish([request_id], error=f"not run: backend stopped ({self.closed})")
        return request

    def pending(self) -> list[Request]:
        """A snapshot of the pending rows in id order (rows are inserted in id order, and a dict keeps that order)."""
        with self._lock:
            return list(self._pending.values())

    def start(self, ids: list[int]) -> None:
        now = self.clock()
        with self._lock:
            for i in ids:
                if self.records[i].started_s is None:
                    self.records[i].started_s = now

    def finish(
        self,
        ids: list[int],
        error: str | None = None,
        metrics: dict[str, float] | None = None,
        outputs: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        """Write results: completed (with metrics and per-request outputs) or failed with an error text."""
        now = self.clock()
        status = "failed" if error else "completed"
        outputs = outputs or {}
        with self._lock:
            for i in ids:
                if i not in self._pending:
                    continue
                record = self.records[i]
                record.completed_s = now
                record.status = status
                record.error = error
                record.metrics = dict(metrics) if metrics else {}
                output = outputs.get(i)
                record.outputs = dict(output) if output else {}
                del self._pending[i]
                self.requests.pop(i, None)  # a finished request is only its record now (a long run holds no others)
        for i in ids:
            for listener in self._listeners:
                listener(i)

    def is_done(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self.records and request_id not in self._pending

    def ordered_records(self) -> list[RequestRecord]:
        with self._lock:
            return [self.records[i] for i in sorted(self.records)]

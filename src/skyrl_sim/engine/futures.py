"""SkyRL's futures table: the queue *is* this table.

Every submitted request becomes a pending row whose id is the arrival order; the engine reads the pending rows and
writes each request's result. One table serves both the simulated clock and the real one, so it takes the clock
as a function and is safe to use from several threads.

A client that stops waiting for a result (``give_up``) fails its request as the client sees it, but the row stays
pending: the service does not know the client left, so its engine still runs the request, and that work still costs
the engine its time. The record keeps what the client saw; the engine's later start is kept as ``started_s``.

With a ``RecordSpool`` (a long simulated run) a finished request's record goes to the spool at once and leaves the
table, so the table holds only the requests in flight; the spool keeps what can still reach a finished request (a late
start, the time its client saw the result).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from skyrl_sim.engine.admission import admission_error
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import actionable
from skyrl_sim.results.record_spool import RecordSpool
from skyrl_sim.results.result import RequestRecord
from skyrl_sim.schema.variant import PlannedRequest, ResolvedVariant

Listener = Callable[[int], None]


def poll_tick(now: float, interval: float) -> float:
    """When a client sees a result written at ``now``: the result poller's next tick (it checks every ``interval``)."""
    return math.ceil(now / interval - 1e-9) * interval


class FuturesTable:
    def __init__(
        self, variant: ResolvedVariant, clock: Callable[[], float], spool: RecordSpool | None = None
    ) -> None:
        self.variant = variant
        self._clients = variant.workload.clients  # read on every submission
        self.clock = clock
        self.spool = spool
        self.records: dict[int, RequestRecord] = {}  # with a spool: only the unfinished ones
        self._pending: dict[int, Request] = {}  # the pending rows (a finished request is only its record)
        self._queues: dict[str, deque[Request]] = {}  # per model, its pending requests but samples, in id order
        self._samples: dict[int, Request] = {}  # the pending samples the engine has not admitted to its sampler
        self._samples_removed = 0  # samples taken out of ``_samples`` since it was last rebuilt (``_unqueue_sample``)
        self._in_flight: dict[int, Request] = {}  # pending samples admitted to the sampler (or forwarded around it)
        self.forward: Callable[[Request], None] | None = None  # forwarded sampling: where a sample goes on submission
        self._given_up: set[int] = set()  # pending rows whose client stopped waiting: their records are final
        self._next_id = 1
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []
        self.closed: str | None = None

    @property
    def requests(self) -> dict[int, Request]:
        """The pending requests by id (a finished one is only its record: a long run holds no others)."""
        return self._pending

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
        """Insert a pending row; its id is the next in arrival order. A request the API refuses
        (``admission.admission_error``) gets no row: its record fails at once with the API's answer."""
        client = self._clients[planned.client_index]
        spec = planned.spec
        kind = spec.type
        datums = planned.datums
        sample = kind == "sample"
        refused = admission_error(spec, datums, self.variant.endpoint)
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
                spec.loss_fn,
                tuple(sorted(spec.loss_fn_config.items())) if spec.loss_fn_config else (),
                spec.loss_fn_inputs,
                spec.prompt_logprobs,
                (spec.lora_config.rank, spec.lora_config.alpha) if spec.lora_config is not None else None,  # lora
                spec.routed_experts,
            )
            now = self.clock()
            forward = self.forward if sample and refused is None else None
            self.records[request_id] = RequestRecord(
                request_id, kind, client.model_id, sum(datums), now, client=client.name, datums=list(datums)
            )
            if refused is None:
                self._pending[request_id] = request
                if forward is not None:
                    self._in_flight[request_id] = request
                elif sample:
                    self._samples[request_id] = request
                else:
                    queue = self._queues.get(request.model_id)
                    if queue is None:
                        queue = self._queues[request.model_id] = deque()
                    queue.append(request)
            else:
                self._write(request_id, now, "failed", refused, None, None)
        if refused is not None:
            for listener in self._listeners:
                listener(request_id)
        elif self.closed is not None:
            self.finish([request_id], error=f"not run: backend stopped ({self.closed})")
        elif forward is not None:
            self.start([request_id])
            forward(request)
        return request

    def admit(self, requests: Sequence[Request]) -> None:
        """Pending samples handed to the sampler: they stay pending (their results are not written yet) but the
        engine no longer sees them (SkyRL's ``find_batchable_sample`` skips the sampler's ``inflight_ids``)."""
        with self._lock:
            for request in requests:
                if self._unqueue_sample(request.id):
                    self._in_flight[request.id] = request

    def in_flight(self) -> list[Request]:
        """The samples admitted to the sampler (or forwarded) whose results are not written yet, in id order."""
        with self._lock:
            return sorted(self._in_flight.values(), key=lambda r: r.id)

    def pending(self) -> list[Request]:
        """A snapshot of the pending rows in id order (rows are inserted in id order, and a dict keeps that order)."""
        with self._lock:
            return list(self._pending.values())

    def actionable(self, continuous: bool = False) -> list[Request]:
        """The pending requests the engine's next iteration can act on (``rules.actionable``; ``continuous``: the
        iteration samples in continuous mode): what ``plan_iteration`` needs of the queue, without walking a backlog
        that waits behind a model's barrier, or samples that wait behind blocking work. ``_samples`` is in id order:
        ids are given in arrival order and a dict keeps it."""
        with self._lock:
            if not self._queues and not self._samples:  # nothing waits: the engine's idle iterations ask this
                return []
            return actionable(self._queues.values(), self._samples.values(), continuous)

    def _unqueue_sample(self, request_id: int) -> bool:
        """Take a sample out of ``_samples``; whether it was there. Called under the lock.

        A dict never shrinks when entries leave it, and walking it visits every slot it ever filled: once a backlog of
        samples is admitted, each later ``actionable`` would walk the whole backlog's empty slots again (a cost that
        grows with the backlog, on every engine iteration). So the dict is rebuilt, holding only what is left, once
        more entries have left it than it holds: a copy of ``n`` entries every ``n`` removals at least."""
        if self._samples.pop(request_id, None) is None:
            return False
        self._samples_removed += 1
        if self._samples_removed > 32 and self._samples_removed > len(self._samples):
            self._samples = dict(self._samples)  # in id order still: a dict keeps its insertion order
            self._samples_removed = 0
        return True

    def _dequeue(self, request: Request) -> None:
        """``request`` leaves its model's queue (or the samples); the engine finishes a model's requests in id order,
        so it is almost always the first. Called under the lock."""
        if request.type == "sample":
            if not self._unqueue_sample(request.id):
                del self._in_flight[request.id]
            return
        queue = self._queues[request.model_id]
        if queue[0] is request:
            queue.popleft()
        else:
            queue.remove(request)
        if not queue:
            del self._queues[request.model_id]

    def start(self, ids: list[int]) -> None:
        now = self.clock()
        with self._lock:
            for i in ids:
                record = self.records.get(i)
                if record is None:  # spooled: a client already failed it (result time-out) before its call started
                    self.spool.started(i, now)  # type: ignore[union-attr]
                elif record.started_s is None:
                    record.started_s = now

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
                self._dequeue(self._pending.pop(i))  # a finished request is only its record now
                if i in self._given_up:  # run after its client left: the record stays what the client saw
                    self._given_up.discard(i)
                    continue
                self._write(i, now, status, error, metrics, outputs.get(i))
        for i in ids:
            for listener in self._listeners:
                listener(i)

    def give_up(self, request_id: int, error: str) -> None:
        """The client of ``request_id`` stopped waiting for its result: the request fails with ``error`` as the
        client sees it, now, and stays pending for the engine (see the module doc). Nothing if already finished."""
        now = self.clock()
        with self._lock:
            if request_id not in self._pending or request_id in self._given_up:
                return
            self._given_up.add(request_id)
            self._write(request_id, now, "failed", error, None, None)
        for listener in self._listeners:
            listener(request_id)

    def _write(
        self,
        request_id: int,
        now: float,
        status: str,
        error: str | None,
        metrics: dict[str, float] | None,
        output: dict[str, Any] | None,
    ) -> None:
        """A request's result in its record, which is then final (with a spool it leaves the table for the spool).
        Called under the lock."""
        record = self.records[request_id]
        record.completed_s = now
        record.status = status
        record.error = error
        if self.spool is not None:  # written at once and dropped: the call's dicts are read, not kept
            record.metrics = metrics or {}
            record.outputs = output or {}
            self.spool.add(self.records.pop(request_id))
            return
        record.metrics = dict(metrics) if metrics else {}
        record.outputs = dict(output) if output else {}

    def retrieved(self, request_id: int, seen_s: float) -> None:
        """A client saw the result of ``request_id`` at ``seen_s`` (its poller's tick): ``outputs["retrieved_s"]``,
        the first time only."""
        with self._lock:
            record = self.records.get(request_id)
            if record is None and self.spool is not None:
                self.spool.retrieved(request_id, round(seen_s, 9))
            else:
                self.records[request_id].outputs.setdefault("retrieved_s", round(seen_s, 9))

    def is_done(self, request_id: int) -> bool:
        """Whether ``request_id`` was submitted and its result written, or its client gave up on it (ids run from 1 in
        arrival order)."""
        with self._lock:
            return 0 < request_id < self._next_id and (request_id not in self._pending or request_id in self._given_up)

    def ordered_records(self) -> Sequence[RequestRecord]:
        """Every request's record in id order. With a spool, the spool itself: what is still unfinished (a run that
        ended with requests in flight) is written to it as it stands, and the spool is final."""
        with self._lock:
            if self.spool is None:
                return [self.records[i] for i in sorted(self.records)]
            for i in sorted(self.records):
                self.spool.add(self.records.pop(i))
            return self.spool

"""SkyRL's single-threaded engine loop, clock-agnostic: snapshot, phases, results, sleep.

The loop is a generator of the clock's steps (``Sleep``, or ``Idle`` when nothing is pending). The simulator turns each
into an event on its virtual clock; the real backend sleeps the idle time and its executor has already spent the
call's time (it returns ``wait_s = 0``). What each call costs comes from a ``CallExecutor``: modelled in the
simulator, measured on real workers.

Samples run on the backend's ``Sampler`` (``engine.sampler``) in the iteration's sampling mode
(``rules.sampling_mode``): continuous, the plan's ``admitted`` samples are handed to it and the loop goes on, and
when the plan names blocking work the loop waits for every sample in flight first (a ``drain`` record, SkyRL's
``Draining N in-flight sample request(s) before ...`` line); serial, the plan's sample batch is one wave; forwarded,
the futures table hands samples to the sampler as they are submitted. A backend without a sampler runs each admitted
sample as one blocking call of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Protocol

from skyrl_sim.engine.clients import Idle, Sleep
from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.engine.outcome import CallOutcome
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import BatchCall, apply_single, not_loaded_error, plan_iteration, sampling_mode
from skyrl_sim.engine.sampler import Sampler
from skyrl_sim.engine.shapes import CallShape, PaddingRule, shape_call
from skyrl_sim.results.result import CallRecord
from skyrl_sim.schema.requests import PASSES
from skyrl_sim.schema.variant import ResolvedVariant


class CallExecutor(Protocol):
    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        """Run one batch call (forward_backward / forward with its shape, or sample with ``shape=None``)."""
        ...

    def single(self, request: Request) -> CallOutcome:
        """Run one single request."""
        ...


def pass_metrics(requests: tuple[Request, ...]) -> dict[str, float]:
    """The metrics SkyRL computes per call that the simulator can know: loss-weighted tokens (every target weighs 1)."""
    return {"num_tokens:sum": float(sum([sum(r.datums) for r in requests]))}  # each request's ``tokens``


def copy_shape_fields(record: CallRecord, shape: CallShape) -> None:
    """The shape fields of a call's record, set here once, so two backends can only disagree about what they measured,
    never about what a field means."""
    record.rows = shape.rows
    record.padded_rows = shape.padded_rows
    record.width = shape.width
    record.microbatches = len([mb for mb in shape.microbatches if mb.dp_rank == 0])  # rank 0's
    record.real_tokens = shape.real_tokens
    record.slots = shape.slots


class EngineLoop:
    """One engine over one futures table. ``run`` yields seconds to advance until clients are done and the queue is empty."""

    def __init__(
        self,
        variant: ResolvedVariant,
        table: FuturesTable,
        executor: CallExecutor,
        rule: PaddingRule,
        clients_done: Callable[[], bool],
        on_call: Callable[[CallRecord], None] | None = None,
        sampler: Sampler | None = None,
    ) -> None:
        self.variant = variant
        self.table = table
        self.executor = executor
        self.rule = rule
        self.clients_done = clients_done
        self.on_call = on_call
        self.sampler = sampler
        self.mode = sampling_mode(variant.endpoint)
        self.calls: list[CallRecord] = []
        self.log: list[str] = []
        self.stopped: str | None = None
        self.loaded: frozenset[str] | None = variant.workload.initial_loaded()
        self._batch_lines: dict[tuple[str, int], str] = {}  # the log line of a call's kind and size

    def shape(self, call: BatchCall) -> CallShape | None:
        if call.kind not in PASSES:
            return None
        lengths = [length for request in call.requests for length in request.datums]
        # SkyRL runs the whole call with its first request's loss (``_forward_backward_single_model_batch``)
        return shape_call(call.kind, lengths, self.variant.endpoint, self.rule, call.requests[0].loss_fn)

    def run(self) -> Generator[Sleep, None, None]:
        """The clock's steps until clients are done and the queue is empty: a call's time (``Sleep``), the iteration's
        sleep, or ``Idle`` when nothing is pending (the same sleep; nothing changes until another process acts)."""
        engine = self.variant.endpoint.engine
        sleep, idle = Sleep(engine.iteration_sleep_s), Idle(engine.iteration_sleep_s)  # immutable: shared by iterations
        table = self.table
        while self.stopped is None:
            pending = table.actionable(continuous=self.mode == "continuous")
            if not pending:
                if self.clients_done():
                    yield from self._drain(("the end of the run",), log=False)
                    return
                yield idle
                continue
            plan = plan_iteration(pending, engine, self.loaded, self.mode)
            self.log.extend(plan.log)
            # SkyRL fails a sample of an unloaded model when it admits samples, a pass when its phase begins (after
            # the drain); without a drain the two are the same moment
            for request in plan.rejected:
                if request.type == "sample" or not plan.drain:
                    table.finish([request.id], error=not_loaded_error(request.model_id))
            if plan.admitted:
                yield from self._admit(list(plan.admitted))
                if self.stopped:
                    return
            if plan.drain:
                yield from self._drain(plan.drain)
                for request in plan.rejected:
                    if request.type != "sample":
                        table.finish([request.id], error=not_loaded_error(request.model_id))
            for call in plan.batch_calls():
                yield from self._batch(call)
                if self.stopped:
                    return
            if plan.singles:
                yield from self._singles(list(plan.singles))
            yield sleep

    def _record(self, kind: str, model_id: str | None, ids: list[int]) -> CallRecord:
        now = self.table.clock()
        record = CallRecord(index=len(self.calls), kind=kind, model_id=model_id, request_ids=ids, start_s=now)
        self.calls.append(record)
        return record

    def _admit(self, requests: list[Request]) -> Generator[Sleep, None, None]:
        """Continuous sampling: the samples go to the sampler and run concurrently; their results are written as
        their generations end. Without a sampler, each runs as a blocking call of its own."""
        if self.sampler is None:
            for request in requests:
                yield from self._batch(BatchCall("sample", request.model_id, (request,)))
                if self.stopped:
                    return
            return
        self.table.admit(requests)
        self.table.start([r.id for r in requests])
        switch = self._prepare_sampling(requests)
        if switch is not None:
            # SkyRL's engine calls ``backend.prepare_for_sampling()`` before it admits samples, and fails them with
            # its exception (``engine.py``: ``_admit_samples_continuous``)
            record = self._record("prepare_for_sampling", requests[0].model_id, [r.id for r in requests])
            if switch.wait_s > 0:
                yield Sleep(switch.wait_s)
            self._close(record, switch)
            if record.error:
                refused = switch.error is not None
                error = f"Waking up inference engines failed: {record.error}" if refused else record.error
                self.log.append(f"prepare_for_sampling failed; failing {len(requests)} sample request(s): {error}")
                self.table.finish([r.id for r in requests], error=error)
                return
        self.sampler.submit(requests)

    def _prepare_sampling(self, requests: list[Request] | tuple[Request, ...]) -> CallOutcome | None:
        """The executor's switches before samples run (a colocated device handed from the trainer to vLLM), or None
        when it has none to make."""
        prepare = getattr(self.executor, "prepare_sampling", None)
        return prepare(list(requests)) if callable(prepare) else None

    def _drain(self, reasons: tuple[str, ...], log: bool = True) -> Generator[Sleep, None, None]:
        """Wait for every sample in flight (SkyRL's ``_ContinuousSampler.drain``): a ``drain`` record from the
        moment the engine blocks until the last result is written, and SkyRL's two log lines."""
        sampler = self.sampler
        count = sampler.in_flight() if sampler is not None else 0
        if sampler is None or not count:
            return
        if not log:  # the run's end: what is in flight still finishes, but SkyRL's engine is not waiting for it
            yield from sampler.drain()
            return
        ids = [r.id for r in self.table.in_flight()]
        record = self._record("drain", None, ids)
        self.log.append(f"Draining {count} in-flight sample request(s) before {', '.join(reasons)} ...")
        yield from sampler.drain()
        self._close(record, CallOutcome(duration_s=self.table.clock() - record.start_s))
        self.log.append(f"Drained in-flight samples in {record.duration_s:.1f}s (was {count})")

    def _batch(self, call: BatchCall) -> Generator[Sleep, None, None]:
        ids = call.request_ids
        record = self._record(call.kind, call.model_id, ids)
        line = self._batch_lines.get((call.kind, len(ids)))
        if line is None:  # one string per kind and size: a long run logs a million calls, of a few dozen kinds
            line = self._batch_lines[(call.kind, len(ids))] = f"process_batch_requests({call.kind}, n={len(ids)})"
        self.log.append(line)
        shape = self.shape(call)
        if shape is not None:
            copy_shape_fields(record, shape)
            self.log.extend(shape.log)
        self.table.start(ids)
        if call.kind == "sample" and self.sampler is not None:
            switch = self._prepare_sampling(call.requests)
            if switch is not None and switch.wait_s > 0:
                yield Sleep(switch.wait_s)
            if switch is not None and (switch.error or switch.oom):
                outcome = switch
            else:
                outcome = yield from self.sampler.wave(call.requests)
                if switch is not None:
                    outcome.extra.update(switch.extra)
        else:
            outcome = self.executor.batch(call, shape)
            if outcome.wait_s > 0:
                yield Sleep(outcome.wait_s)
        self._close(record, outcome)
        error = outcome.error or (outcome.oom.message if outcome.oom else None)
        if error:
            self.log.append(f"Error in {call.kind} batch (requests {ids[0]}..{ids[-1]}): {error}")
        for request_id, failure in outcome.failed.items():
            self.table.finish([request_id], error=failure)
        done = [i for i in ids if i not in outcome.failed] if outcome.failed else ids
        self.table.finish(done, error=error, metrics=outcome.metrics, outputs=outcome.outputs)
        if outcome.fatal:
            self.stopped = error or "backend failed"
            self._fail_rest(self.stopped)

    def _singles(self, singles: list[Request]) -> Generator[Sleep, None, None]:
        """Singles run one at a time; all their results are written together at the end of the phase."""
        results: list[tuple[int, CallOutcome]] = []
        for request in singles:
            record = self._record(request.type, request.model_id, [request.id])
            self.table.start([request.id])
            before = self.loaded
            self.loaded, refused = apply_single(request, self.loaded)
            outcome = CallOutcome(duration_s=0.0, error=refused) if refused else self.executor.single(request)
            if request.type == "create_model" and outcome.error:
                self.loaded = before  # the backend refused it (SkyRL raises before the model exists): not loaded
            if outcome.wait_s > 0:
                yield Sleep(outcome.wait_s)
            self._close(record, outcome)
            results.append((request.id, outcome))
            if outcome.fatal:
                break
        for request_id, outcome in results:
            error = outcome.error or (outcome.oom.message if outcome.oom else None)  # a switch that ran out of memory
            self.table.finish([request_id], error=error, metrics=outcome.metrics, outputs=outcome.outputs)
            if outcome.fatal:
                self.stopped = outcome.error or "backend failed"
                self._fail_rest(self.stopped)

    def _close(self, record: CallRecord, outcome: CallOutcome) -> None:
        record.end_s = record.start_s + outcome.duration_s if outcome.wait_s else self.table.clock()
        record.peak_bytes = outcome.peak_bytes
        record.oom = outcome.oom
        record.error = outcome.error or (outcome.oom.message if outcome.oom else None)
        record.memory = outcome.memory
        record.extra.update(outcome.extra)
        if self.on_call is not None:
            self.on_call(record)

    def _fail_rest(self, reason: str) -> None:
        """After a fatal backend failure nothing more can run: pending and later requests fail with the reason."""
        self.table.close(reason)

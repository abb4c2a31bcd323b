"""The simulator backend: the scenario's clients and SkyRL's engine on a simpy clock.

Clients submit by their pattern (each submission costs ``gap_s``), the engine loop snapshots the futures table,
runs the phases the engine rules choose, and sleeps; a client sees a result at the next tick of the result poller
(every ``poll_interval_s``). Each call's memory comes from the memory model and its duration from the time model;
a call whose memory walk runs out of capacity fails its requests with PyTorch's OOM message and the engine goes on.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy
from skyrl_sim_plugins.sim.memory import default_memory_model
from skyrl_sim_plugins.sim.moe_routes import moe_call_extra, moe_sample_extra
from skyrl_sim_plugins.sim.timing import default_time_model

from skyrl_sim.architecture import ModelArch
from skyrl_sim.clients import Await, Sleep, SleepUntil, Submit, client_script
from skyrl_sim.costs import CarriedMemory, MemoryModel, TimeModel
from skyrl_sim.endpoint import Endpoint
from skyrl_sim.engine_loop import CallOutcome, EngineLoop, pass_metrics
from skyrl_sim.engine_rules import BatchCall
from skyrl_sim.errors import UserError
from skyrl_sim.futures import FuturesTable, poll_tick
from skyrl_sim.hookspecs import RunContext
from skyrl_sim.limits import MAX_SIM_TIME_S
from skyrl_sim.result import RunResult
from skyrl_sim.scenario import Request, ResolvedVariant
from skyrl_sim.shapes import CallShape

TIMELINE_CALLS = 1000


class SimExecutor:
    """Costs each call with the memory and time models; never touches a device.

    Every call keeps its allocation timeline (for plots, traces and ``--explain``) up to ``TIMELINE_CALLS`` calls; past
    that only the calls that run out of memory or set a new peak keep theirs, so a 20,000-request run stays small.
    """

    def __init__(self, endpoint: Endpoint, model: ModelArch, memory: MemoryModel, time: TimeModel) -> None:
        self.endpoint = endpoint
        self.model = model
        self.memory = memory
        self.time = time
        self.saved_checkpoints: set[tuple[str, str]] = set()
        self.timelines_kept = 0
        self.highest_peak = -1
        self.carried = CarriedMemory()  # what earlier calls left on the workers, in call order

    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        if shape is None:
            return self._sample(call)
        report = self.memory.evaluate(shape, self.endpoint, self.model, self.carried)
        if report.oom is not None and self.carried.buffers:
            alone = self.memory.evaluate(shape, self.endpoint, self.model)
            report.oom.where["carried_bytes"] = max(self.carried.total(r) for r in range(self.endpoint.parallelism.dp))
            report.oom.where["fails_only_after_earlier_calls"] = alone.oom is None
        self.carried = report.carried
        seconds = self.time.call_seconds(shape, self.endpoint, self.model) * report.progress
        memory: dict[str, Any] = {"breakdown": report.breakdown}
        if report.timeline and self._keep_timeline(report.peak_bytes, report.oom is not None):
            memory["timeline"] = report.timeline
        moe = moe_call_extra(shape, self.endpoint, self.model)
        return CallOutcome(
            duration_s=seconds,
            wait_s=seconds,
            peak_bytes=report.peak_bytes,
            oom=report.oom,
            metrics={} if report.oom else pass_metrics(call.requests),
            outputs={r.id: {"datum_lengths": list(r.datums)} for r in call.requests} if not report.oom else {},
            memory=memory,
            extra={"moe": moe} if moe else {},
        )

    def _keep_timeline(self, peak: int, failed: bool) -> bool:
        record = peak > self.highest_peak
        self.highest_peak = max(self.highest_peak, peak)
        keep = failed or record or self.timelines_kept < TIMELINE_CALLS
        self.timelines_kept += keep
        return keep

    def _sample(self, call: BatchCall) -> CallOutcome:
        requests = list(call.requests)
        missing = [r for r in requests if r.checkpoint and (r.model_id, r.checkpoint) not in self.saved_checkpoints]
        seconds = self.time.sample_seconds(requests, self.endpoint, self.model)
        if missing:
            names = ", ".join(sorted({r.checkpoint for r in missing}))
            return CallOutcome(duration_s=0.0, wait_s=0.0, error=f"sampler checkpoint not found: {names}")
        outputs = {r.id: {"generated_tokens": r.max_tokens * r.num_samples} for r in requests}
        moe = moe_sample_extra(requests, self.endpoint, self.model)
        return CallOutcome(duration_s=seconds, wait_s=seconds, outputs=outputs, extra={"moe": moe} if moe else {})

    def single(self, request: Request) -> CallOutcome:
        seconds = self.time.single_seconds(request, self.endpoint, self.model)
        if request.type == "save_weights_for_sampler":
            self.saved_checkpoints.add((request.model_id, request.checkpoint))
        return CallOutcome(duration_s=seconds, wait_s=seconds)


class SimBackend:
    """``--backend sim``: SkyRL's queue, scheduling, padding, memory and time, simulated."""

    name = "sim"

    def __init__(self, memory: MemoryModel | None = None, time: TimeModel | None = None) -> None:
        self.memory = memory or default_memory_model()
        self.time = time or default_time_model()

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        env = simpy.Environment()
        table = FuturesTable(variant, clock=lambda: float(env.now))
        poll = variant.endpoint.engine.poll_interval_s
        timeout_s = variant.workload.result_timeout_s
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
        finished_clients = [0]
        result = RunResult(
            scenario=variant.scenario.name,
            variant=variant.variant_name,
            backend=self.name,
            endpoint=variant.endpoint.name,
            capacity_bytes=variant.endpoint.capacity_bytes,
        )

        def client(index: int) -> Generator[simpy.Event, Any, None]:
            script = client_script(variant, index)
            reply: int | None = None
            while True:
                try:
                    action = script.send(reply)
                except StopIteration:
                    break
                reply = None
                if isinstance(action, Sleep):
                    yield env.timeout(action.seconds)
                elif isinstance(action, SleepUntil):
                    yield env.timeout(max(0.0, action.at_s - env.now))
                elif isinstance(action, Submit):
                    reply = table.submit(action.planned).id
                elif isinstance(action, Await):
                    event = done_event(action.request_id)
                    if not event.triggered:
                        yield event | env.timeout(timeout_s)
                    if not event.triggered:  # the client gives up (workload.result_timeout_s)
                        table.finish([action.request_id], error=f"timed out: no result within {timeout_s:g} s")
                        continue
                    seen = poll_tick(env.now, poll)
                    record = table.records[action.request_id]
                    record.outputs.setdefault("retrieved_s", round(seen, 9))
                    yield env.timeout(max(0.0, seen - env.now))
            finished_clients[0] += 1

        executor = SimExecutor(variant.endpoint, variant.model, self.memory, self.time)
        loop = EngineLoop.for_run(
            variant,
            table,
            executor,
            context,
            result,
            clients_done=lambda: finished_clients[0] == len(variant.workload.clients),
        )

        def engine() -> Generator[simpy.Event, Any, None]:
            for seconds in loop.run():
                yield env.timeout(seconds)

        for index in range(len(variant.workload.clients)):
            env.process(client(index))
        engine_process = env.process(engine())
        env.run(until=simpy.AnyOf(env, [engine_process, env.timeout(MAX_SIM_TIME_S)]))
        if engine_process.is_alive:
            raise UserError(
                f"{variant.source} (variant {variant.variant_name}): the run passed the simulated-time cap of "
                f"{MAX_SIM_TIME_S:,.0f} s without finishing its workload"
            )
        result.calls = loop.calls
        result.requests = table.ordered_records()
        result.log = loop.log
        result.totals = variant.workload_totals()
        return result

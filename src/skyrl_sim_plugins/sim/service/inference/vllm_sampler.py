"""The simulator's sampler: SkyRL's generation client in front of ``num_engines`` modelled vLLM engines.

What happens to one ``sample`` request, as SkyRL 0.4.0 does it (``skyrl_train_backend.py``:
``_sample_with_remote_client_async``; ``inference_servers/remote_inference_client.py``: ``sample``):

- it becomes ``num_samples`` generate requests (``n = 1`` each, the same prompt), all sent to the engine its
  routing key picks (vllm-router's ``consistent_hash`` on ``X-Session-ID``, the SDK's session and sequence id:
  here a stable hash of the client name and the request id), so its samples share the prompt's KV blocks;
- at most ``generate_concurrency_per_engine x num_engines`` generate requests are in flight in the whole client
  (``SKYRL_GENERATE_CONCURRENCY_PER_ENGINE``, an asyncio semaphore); the rest wait in order and go as slots free;
- the request's result is written when its last sample ends, plus the client's round trip
  (``overheads.sample_call_s``).

It refuses what vLLM or SkyRL refuses, with their words: a checkpoint never saved for sampling; with
``inference.enable_lora``, an adapter vLLM does not have registered (never saved, or dropped by ``unload_model``:
vLLM's 404 ``The model `X` does not exist.``); a sequence longer than ``max_model_len`` or than the whole KV cache.

Time: the engines (``fast.vllm_cohorts.CohortEngine``, the rule of ``reference.vllm_scheduler``) run on the run's
clock through ``Clock.call_at``: one timer at the next time any engine acts, re-armed whenever that changes (a token
tells a stale timer from the current one), so each result is written at the moment its generation ends whatever the
engine loop and the clients are doing then.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from skyrl_sim.api import CallOutcome, Endpoint, FuturesTable, ModelArch, Request, Sleep, WaveResults, load_profile
from skyrl_sim_plugins.sim.description.layer_ops import lora_parameter_count
from skyrl_sim_plugins.sim.description.moe_routes import moe_sample_extra
from skyrl_sim_plugins.sim.description.prompt_logprobs import prompt_logprobs_bytes
from skyrl_sim_plugins.sim.fast.vllm_cohorts import CohortEngine
from skyrl_sim_plugins.sim.fast.vllm_step_program import DecodeRun, StepPrices, StepProgram
from skyrl_sim_plugins.sim.reference.vllm_scheduler import EngineSettings, PromptGroup, Seq
from skyrl_sim_plugins.sim.reference.vllm_step_cost import step_weights
from skyrl_sim_plugins.sim.service.inference.kv_cache import KvCacheRefused, KvCacheSize, max_model_len
from skyrl_sim_plugins.sim.service.inference.vllm_startup import VllmStart, vllm_start

TIMELINE_POINTS = 4096
"""Points kept per engine timeline; past that every other point is dropped and the spacing doubles."""
LORA_EXPORT_BYTES = 4
"""Bytes per adapter parameter vLLM loads: SkyRL's LoRA sync exports fp32 (``model_dtype`` note in its config)."""


class Clock(Protocol):
    def now(self) -> float: ...

    def call_at(self, at_s: float, action: Callable[[], None]) -> None: ...


def route(client: str, request_id: int, engines: int) -> int:
    """The engine a request's samples go to: a stable hash of its routing key (consistent hashing spreads keys
    evenly; which engine a given key lands on is the router's, not modelled)."""
    if engines == 1:
        return 0
    return zlib.crc32(f"{client}:{request_id}".encode()) % engines


def not_registered_error(model_id: str) -> str:
    """vLLM's 404 for a model name it does not serve (SkyRL's ``vllm_server_actor.py`` raises it for adapters)."""
    return f"The model `{model_id}` does not exist."


def too_long_error(tokens: int, limit: int) -> str:
    """vLLM's refusal of a request longer than the engine admits (``max_model_len``, or the whole KV cache)."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested {tokens} tokens "
        "(prompt plus max_tokens)."
    )


class EnginePrices:
    """An engine's ``StepPrice``: the endpoint's step prices and the sampler's adapter loading."""

    def __init__(self, prices: StepPrices, lora_seconds: Callable[[int, set[str]], float]) -> None:
        self.prices = prices
        self.lora_seconds = lora_seconds
        # the endpoint's own pricing, bound once (a step is priced on every scheduler event)
        self.seconds: Callable[[float, float, float, float, float, float], float] = prices.seconds
        self.decode: Callable[[int, float], DecodeRun] = prices.decode


class Timeline:
    """One engine's counters over time, at most ``TIMELINE_POINTS`` points (thinned evenly as it grows)."""

    def __init__(self) -> None:
        self.columns: dict[str, list[float]] = {
            "t": [],
            "running": [],
            "waiting": [],
            "kv_blocks": [],
            "kv_usage": [],
            "preemptions": [],
        }
        self.spacing = 0.0
        self.last = -math.inf

    def add(self, t: float, running: int, waiting: int, blocks: int, usage: float, preemptions: int) -> None:
        if t - self.last < self.spacing:
            return
        self.last = t
        columns = self.columns
        columns["t"].append(t)
        columns["running"].append(running)
        columns["waiting"].append(waiting)
        columns["kv_blocks"].append(blocks)
        columns["kv_usage"].append(usage)
        columns["preemptions"].append(preemptions)
        if len(columns["t"]) >= TIMELINE_POINTS:
            for name in self.columns:
                self.columns[name] = self.columns[name][::2]
            times = self.columns["t"]
            self.spacing = 2 * (times[-1] - times[0]) / max(1, len(times))


    def rounded(self) -> dict[str, list[float]]:
        """The columns with times and fractions rounded to 9 digits (what the run's JSON keeps)."""
        return {
            name: [round(v, 9) for v in values] if name in ("t", "kv_usage") else values
            for name, values in self.columns.items()
        }


@dataclass(slots=True)
class RequestState:
    """A request's samples in flight and what becomes its result."""

    request: Request
    seqs: list[Seq]
    engine: int
    hold: bool  # a serial wave: the engine loop writes the result
    sent_s: float | None = None
    done: int = 0
    error: str | None = None
    written: bool = False


class SimSampler:
    """``Sampler`` for the simulator (see the module doc). ``saved`` and ``registered`` are the executor's sets of
    saved sampler checkpoints ``(model_id, name)`` and of models whose adapter vLLM serves."""

    def __init__(
        self,
        endpoint: Endpoint,
        model: ModelArch,
        table: FuturesTable,
        clock: Clock,
        saved: set[tuple[str, str]],
        registered: set[str],
        own_devices: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.model = model
        self.table = table
        self.clock = clock
        self.saved = saved
        self.registered = registered
        self.own_devices = own_devices  # engines on devices of their own: their start is checked here
        self.start: VllmStart | None = None
        self.states: dict[int, RequestState] = {}
        self.used = False
        self.start_refusal: KvCacheRefused | None = None  # why vLLM could not start (``_ensure``)
        self.routed_experts = False  # a sample's output carries routed-expert bytes (MoE with replay on)

    def _ensure(self) -> bool:
        """Build the engines on first use: a run without samples never sizes a KV cache or prices a step. False when
        vLLM refuses to start with the endpoint's settings (``start_refusal``): every sample then fails with it."""
        if self.used:
            return self.start_refusal is None
        self.used = True
        endpoint, model = self.endpoint, self.model
        inference = endpoint.inference
        self.start = start = vllm_start(endpoint, model)  # the one definition of vLLM's budget and KV cache
        failure = start.first_failure(start.total - start.context) if self.own_devices else None
        if failure is not None:  # the start runs out on a device of its own: the engine never comes up
            self.start_refusal = KvCacheRefused(failure.message, failure.attempted, failure.free)
            return False
        if start.refusal is not None or start.kv is None:  # vLLM's own start-up checks of its KV cache
            self.start_refusal = start.refusal
            return False
        self.kv: KvCacheSize = start.kv
        profile = load_profile(endpoint.hardware.profile)
        self.call_s = profile.overheads.sample_call_s
        program = StepProgram.build(endpoint, model)
        weights = step_weights(endpoint)
        adapter_bytes = lora_parameter_count(model, endpoint) * LORA_EXPORT_BYTES / inference.tensor_parallel_size
        self._adapter_copy_s = adapter_bytes / (profile.bytes_memory * profile.share(inference.num_engines))
        self._adapter_load_s = adapter_bytes / profile.storage_bandwidth
        self._gpu_loras: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(inference.num_engines)]
        self._cpu_loras: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(inference.num_engines)]
        settings = EngineSettings(
            max_num_seqs=inference.max_num_seqs,
            max_num_batched_tokens=inference.max_num_batched_tokens,
            block_size=self.kv.block_size,
            usable_blocks=self.kv.sequence_blocks,
            enable_prefix_caching=inference.enable_prefix_caching,
            enable_chunked_prefill=inference.enable_chunked_prefill,
            max_loras=inference.max_loras if inference.enable_lora else None,
            state_blocks=self.kv.state_blocks_per_sequence,
        )
        price = EnginePrices(program.bind(weights), self._lora_seconds)
        self.engines = [CohortEngine(i, settings, price) for i in range(inference.num_engines)]
        self.timelines = [Timeline() for _ in self.engines]
        for engine in self.engines:
            engine.on_step = self._record
        self.limit = min(max_model_len(endpoint, model) or math.inf, self.kv.tokens)
        self.cap = inference.concurrency_cap
        self.gate: deque[Seq] = deque()
        self.sent = 0  # generate requests in the engines
        self.wave_result: WaveResults | None = None
        self._seqs = 0
        self._token = 0
        self._armed: float | None = None
        self._engines_at: float | None = None  # when the next engine acts; None: to be asked (an engine changed)
        # sequences whose generation ends at a time to come, as the engines hand them over: (the earliest end, the
        # smallest index, the sequences); taken in (end, index) order, one sequence at a time
        self._finishes: list[tuple[float, int, list[Seq]]] = []
        self._writes: list[tuple[float, int]] = []  # request results due after the client's round trip
        self._moe = model.moe is not None and endpoint.trainer.routed_expert_replay != "off"
        return True

    # ------------------------------------------------------------------ Sampler

    def submit(self, requests: Sequence[Request]) -> None:
        self._submit(requests, hold=False)

    def in_flight(self) -> int:
        return len(self.states)  # a request leaves ``states`` when its result is written

    def drain(self) -> Generator[Sleep, None, None]:
        while self.in_flight():
            at = self._next_time()
            if at is None:  # nothing left to act: cannot happen while requests are in flight
                raise RuntimeError("the sampler has requests in flight and nothing scheduled")
            yield Sleep(max(0.0, at - self.clock.now()))

    def wave(self, requests: Sequence[Request]) -> Generator[Sleep, None, CallOutcome]:
        self._ensure()
        start = self.clock.now()
        self.wave_result = WaveResults()
        self._submit(requests, hold=True)
        yield from self.drain()
        result, self.wave_result = self.wave_result, None
        moe = moe_sample_extra(list(requests), self.endpoint, self.model)
        extra: dict[str, Any] = {"moe": moe} if moe else {}
        scored = prompt_logprobs_bytes(requests, self.endpoint, self.model)
        if scored:  # the wave's largest prompt log-probs transient, as a serial sample call reports it
            extra["prompt_logprobs_bytes"] = scored
        return CallOutcome(
            duration_s=self.clock.now() - start, outputs=result.outputs, failed=result.failed, extra=extra
        )

    # ------------------------------------------------------------------ submission

    def _submit(self, requests: Sequence[Request], hold: bool) -> None:
        if not self._ensure():
            self._refuse(requests, hold)
            return
        now = self.clock.now()
        self._advance(now, decide=False)  # the new generate requests join a step that starts now
        engines = len(self.engines)
        block_size = self.kv.block_size
        lora_served = self.endpoint.inference.enable_lora
        states = self.states
        gate = self.gate
        for request in requests:
            error = self._refusal(request)
            engine = route(request.client, request.id, engines)
            seqs: list[Seq] = []
            state = RequestState(request, seqs, engine, hold)
            states[request.id] = state
            if error is not None:
                state.error = error
                self._write(state, now)
                continue
            group = PromptGroup(request.prompt_tokens, block_size)
            lora = request.model_id if request.checkpoint and lora_served else None
            index = self._seqs
            for _ in range(request.num_samples):
                seq = Seq(
                    index,
                    request.id,
                    group,
                    request.prompt_tokens,
                    request.max_tokens,
                    lora,
                    now,
                    scores_prompt=request.prompt_logprobs,
                )
                index += 1
                seqs.append(seq)
            self._seqs = index
            gate.extend(seqs)
        self._advance(now)
        self._arm()

    def _refuse(self, requests: Sequence[Request], hold: bool) -> None:
        """Every request fails at once with vLLM's start-up refusal (``start_refusal``)."""
        now = self.clock.now()
        for request in requests:
            state = RequestState(request, [], 0, hold)
            state.error = f"vLLM could not start: {self.start_refusal}"
            self.states[request.id] = state
            self._write(state, now)

    def _refusal(self, request: Request) -> str | None:
        if request.checkpoint and (request.model_id, request.checkpoint) not in self.saved:
            return f"sampler checkpoint not found: {request.checkpoint}"
        if request.checkpoint and self.endpoint.inference.enable_lora and request.model_id not in self.registered:
            return not_registered_error(request.model_id)
        tokens = request.prompt_tokens + request.max_tokens
        if tokens > self.limit:
            return too_long_error(tokens, int(self.limit))
        return None

    def _release_gate(self, now: float) -> bool:
        """Generate requests leave the client's queue while it has slots; each reaches its engine now. Whether any
        did."""
        gate = self.gate
        if not gate:
            return False
        cap = self.cap
        free = len(gate) if cap is None else cap - self.sent
        if free <= 0:
            return False
        states = self.states
        arriving: dict[int, list[Seq]] = {}
        sent = 0
        while gate and sent < free:
            seq = gate.popleft()
            state = states[seq.request]
            if state.error is not None:
                continue
            seq.arrival_s = now
            if state.sent_s is None:
                state.sent_s = now
            sent += 1
            seqs = arriving.get(state.engine)
            if seqs is None:
                arriving[state.engine] = [seq]
            else:
                seqs.append(seq)
        self.sent += sent
        for engine, seqs in arriving.items():
            self.engines[engine].arrive(seqs, now)
        return bool(arriving)

    # ------------------------------------------------------------------ time

    def _next_time(self) -> float | None:
        at = self._engines_at
        if at is None:
            at = math.inf
            for engine in self.engines:
                t = engine.next_event_s()
                if t is not None and t < at:
                    at = t
            self._engines_at = at
        if self._finishes and self._finishes[0][0] < at:
            at = self._finishes[0][0]
        if self._writes and self._writes[0][0] < at:
            at = self._writes[0][0]
        return None if at == math.inf else at

    def _arm(self) -> None:
        """One timer at the next time anything acts (a stale one finds its token changed and does nothing)."""
        at = self._next_time()
        if at is None or at == self._armed:
            return
        self._token += 1
        token = self._token
        self._armed = at
        self.clock.call_at(at, lambda: self._fire(token))

    def _fire(self, token: int) -> None:
        if token != self._token:
            return
        self._armed = None
        now = self.clock.now()
        engines_at = self._engines_at
        finishes = self._finishes
        if engines_at is not None and now < engines_at and not (finishes and finishes[0][0] <= now):
            # no engine acts and no generation ends by now (and the client's queue took every free slot when the
            # last one ended): only results are due, and ``_advance`` would do nothing else
            self._write_due(now)
        else:
            self._advance(now)
        self._arm()

    def _advance(self, now: float, decide: bool = True) -> None:
        """Every engine up to ``now``; sequences whose generation ended by ``now`` leave (freeing client slots, which
        the next queued generate requests take at once), and results due by ``now`` are written. A detailed step is
        decided at its start, so what finishes in it is kept until the clock reaches its end.

        The steps that start at ``now`` are decided last, once every generate request that reaches an engine at
        ``now`` is there (an arrival at the very moment a step starts joins it, whether that step is a detailed one
        or the first of a decode segment): first the engines commit what ended by ``now`` and the freed slots are
        taken, round the engines until nothing arrives; then the steps starting at ``now`` are decided, and if that
        frees slots (a request no cache can hold leaves), once more. Without ``decide`` they are left undecided (the
        caller has more arrivals at ``now`` to hand over first)."""
        self._engines_at = None
        finishes = self._finishes
        gate = self.gate
        cap = self.cap
        joining = True
        while True:
            for engine in self.engines:
                # ``engine.due(now)``, written out (this runs for every engine on every event)
                if engine.decoding or engine.prefilling or engine.waiting:
                    planned = engine.planned
                    if planned is None or planned.end_s <= now:
                        engine.advance(now, joining=joining)
                done = engine.finished
                if done:
                    # one heap entry for what the engine handed over, at its earliest end (a sequence refused with
                    # no output ends when it is handed over)
                    now_s = engine.now_s
                    ends = [
                        (seq.finished_s if seq.finished_s is not None else now_s, seq.index, seq) for seq in done
                    ]
                    heapq.heappush(finishes, (min(ends)[0], done[0].index, ends))
                    done.clear()
            if finishes and finishes[0][0] <= now:
                self._finished_by(now)
            if gate and (cap is None or self.sent < cap) and self._release_gate(now):
                joining = True
                continue
            if not joining or not decide:
                break
            joining = False
        self._write_due(now)

    def _finished_by(self, now: float) -> None:
        """The sequences whose generation ended by ``now`` leave, in the order of their end and then their index
        (as a heap of single sequences would give them)."""
        finishes = self._finishes
        ended: list[tuple[float, int, Seq]] = []
        later: list[tuple[float, int, Seq]] = []
        while finishes and finishes[0][0] <= now:
            for entry in heapq.heappop(finishes)[2]:
                (ended if entry[0] <= now else later).append(entry)
        if later:  # what the engine handed over ends at several step ends: the later ones wait for theirs
            heapq.heappush(finishes, (min(later)[0], later[0][1], later))
        ended.sort()
        finished = self._finished
        for _, _, seq in ended:
            finished(seq, now)

    def _write_due(self, now: float) -> None:
        """The results due by ``now`` (the client's round trip after the request's last sample ended)."""
        writes = self._writes
        while writes and writes[0][0] <= now:
            _, request_id = heapq.heappop(writes)
            state = self.states.get(request_id)
            if state is not None:
                self._write(state, now)

    def _finished(self, seq: Seq, now: float) -> None:
        self.sent -= 1
        state = self.states.get(seq.request)
        if state is None:
            return
        if seq.finished_s is None:
            state.error = too_long_error(seq.prompt + seq.max_tokens, self.kv.tokens)
        done = state.done = state.done + 1
        if done == len(state.seqs):
            if self.call_s > 0:
                heapq.heappush(self._writes, (now + self.call_s, state.request.id))
            else:
                self._write(state, now)

    def _write(self, state: RequestState, now: float) -> None:
        """The request's result: failed with its error, or completed with its samples' times."""
        if state.written:
            return
        state.written = True
        request = state.request
        del self.states[request.id]
        output: dict[str, Any] = {}
        if state.error is None:
            seqs = state.seqs  # every one ran: a request with an error has no output
            output["generated_tokens"] = request.max_tokens * request.num_samples
            if self._moe:
                output.update(self._moe_output(request))
            if request.prompt_logprobs:
                output.update(self._prompt_logprobs_output(request))
            scheduled = first = math.inf
            end = -math.inf
            preemptions = 0
            for seq in seqs:  # the earliest schedule and first token, the last end (the first of equals kept)
                if seq.scheduled_s < scheduled:  # type: ignore[operator]
                    scheduled = seq.scheduled_s  # type: ignore[assignment]
                if seq.first_token_s < first:  # type: ignore[operator]
                    first = seq.first_token_s  # type: ignore[assignment]
                if seq.finished_s > end:  # type: ignore[operator]
                    end = seq.finished_s  # type: ignore[assignment]
                preemptions += seq.preemptions
            output["vllm"] = {
                "engine": state.engine,
                "sent_s": state.sent_s,
                "scheduled_s": scheduled,
                "first_token_s": first,
                "finished_s": end,
                "preemptions": preemptions,
            }
        if state.hold:
            assert self.wave_result is not None
            if state.error is not None:
                self.wave_result.failed[request.id] = state.error
            else:
                self.wave_result.outputs[request.id] = output
            return
        self.table.finish([request.id], error=state.error, outputs={request.id: output} if output else None)

    def _prompt_logprobs_output(self, request: Request) -> dict[str, Any]:
        """A ``compute_logprobs`` sample's transient logits memory (``prompt_logprobs.prompt_logprobs_bytes``)."""
        scored = prompt_logprobs_bytes([request], self.endpoint, self.model)
        return {"prompt_logprobs_bytes": scored} if scored else {}

    def _moe_output(self, request: Request) -> dict[str, Any]:
        """The routed-expert bytes vLLM returns with a MoE sample (``moe_routes.moe_sample_extra``), when it does."""
        moe = moe_sample_extra([request], self.endpoint, self.model)
        if moe is None:
            return {}
        self.routed_experts = True
        return {"moe": {key: value for key, value in moe.items() if key != "per_request"}}

    # ------------------------------------------------------------------ adapters and records

    def _lora_seconds(self, engine: int, loras: set[str]) -> float:
        """Loading the step's adapters: into one of the ``max_loras`` GPU slots (a copy in device memory) unless
        there, and from storage into the ``max_cpu_loras`` cache unless there (both least recently used first)."""
        seconds = 0.0
        slots, cache = self._gpu_loras[engine], self._cpu_loras[engine]
        inference = self.endpoint.inference
        for name in sorted(loras):
            if name not in cache:
                seconds += self._adapter_load_s
                cache[name] = None
                if len(cache) > inference.cpu_loras:
                    cache.popitem(last=False)
            cache.move_to_end(name)
            if name not in slots:
                seconds += self._adapter_copy_s
                slots[name] = None
                if len(slots) > inference.max_loras:
                    slots.popitem(last=False)
            slots.move_to_end(name)
        return seconds

    def _record(self, engine: CohortEngine, at: float) -> None:
        timeline = self.timelines[engine.index]
        if at - timeline.last < timeline.spacing:  # ``Timeline.add`` would keep nothing
            return
        pool = engine.pool
        timeline.add(at, engine.running_count(), len(engine.waiting), pool.used, pool.usage(), engine.stats.preemptions)

    def report(self) -> dict[str, Any]:
        """What the run's ``inference`` section holds: the KV cache and, per engine, its counters and timeline
        (nothing when no sample ran)."""
        if not self.used:
            return {}
        if self.start_refusal is not None:
            return {"start_refused": str(self.start_refusal)}
        engines = []
        for engine, timeline in zip(self.engines, self.timelines, strict=True):
            stats = engine.stats
            engines.append(
                {
                    "index": engine.index,
                    "num_gpu_blocks": self.kv.num_blocks,
                    "preemptions": stats.preemptions,
                    "steps": stats.steps,
                    "prompt_tokens": stats.prompt_tokens,
                    "generation_tokens": stats.generation_tokens,
                    "prefix_cache_hit_tokens": stats.prefix_hit_tokens,
                    "busy_s": round(stats.busy_s, 9),
                    "timeline": timeline.rounded(),
                }
            )
        report: dict[str, Any] = {"kv_cache": self.kv.as_dict(), "engines": engines}
        if self.start is not None and self.own_devices:
            report["start"] = self.start.as_dict()
        if self.routed_experts:
            report["routed_experts"] = True
        return report


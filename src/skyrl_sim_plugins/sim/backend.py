"""The simulator backend: the scenario's clients and SkyRL's engine in simulated time (``VirtualClock``).

Clients submit by their pattern (each submission costs ``gap_s``), the engine loop snapshots the futures table,
runs the phases the engine rules choose, and sleeps; a client sees a result at the next tick of the result poller
(every ``poll_interval_s``). Each call's memory comes from the memory model and its duration from the time model;
a call whose memory walk runs out of capacity fails its requests with PyTorch's OOM message and the engine goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skyrl_sim.api import (
    ALLOCATOR_NOTE,
    MAX_SIM_TIME_S,
    SKYRL_TRAIN_STRATEGIES,
    AdapterRegistry,
    BatchCall,
    BoundMemoryModel,
    CallOutcome,
    CallShape,
    CarriedMemory,
    DeviceMemory,
    Endpoint,
    FuturesTable,
    MemoryModel,
    MemoryReport,
    ModelArch,
    MoeRouting,
    OomRecord,
    Request,
    ResolvedVariant,
    RunContext,
    RunResult,
    SimulatedTimeExceeded,
    TenancyError,
    TimeModel,
    UserError,
    VirtualClock,
    busiest_shares,
    drive,
    expert_pairs,
    format_size,
    load_profile,
    lora_signature,
    pass_metrics,
    profile_device,
)
from skyrl_sim_plugins.sim.bound.cache import BoundedCache
from skyrl_sim_plugins.sim.bound.classic_allocator import ClassicAllocators, classic_allocator
from skyrl_sim_plugins.sim.bound.memory import BoundWalk, default_memory_model
from skyrl_sim_plugins.sim.bound.timing import BoundRoofline, default_time_model
from skyrl_sim_plugins.sim.description.moe_routes import moe_call_extra, moe_sample_extra
from skyrl_sim_plugins.sim.description.prompt_logprobs import prompt_logprobs_bytes
from skyrl_sim_plugins.sim.description.trainers import after_optim_step, fsdp_supported, lazy_state, trainer_of
from skyrl_sim_plugins.sim.options import SimOptions
from skyrl_sim_plugins.sim.reference.memory_ops import reads_row_tokens
from skyrl_sim_plugins.sim.reference.segments import short_rows
from skyrl_sim_plugins.sim.service.colocation import ColocatedDevice, Switch, colocated, nccl_sync_seconds
from skyrl_sim_plugins.sim.service.inference.vllm_sampler import SimSampler
from skyrl_sim_plugins.sim.service.inference.vllm_startup import vllm_start
from skyrl_sim_plugins.sim.service.tenancy import SimAdapterStore
from skyrl_sim_plugins.sim.service.weight_sync import SeparateSync, separate_sync

TIMELINE_CALLS = 1000
WALK_CACHE_SIZE = 65536
"""Memory reports a run keeps by walk key, per carried state and device memory (``SimExecutor.memory_report``)."""
WALK_STATES = 64
"""Carried states and device memories whose walks a run keeps (megatron's buffers grow a few times a run)."""
ROUTED_MODELS = 16
"""Memory models a run keeps bound to a call's recorded routing spread (``SimExecutor.routed_memory``)."""


def walk_key(shape: CallShape) -> tuple[Any, ...]:
    """Everything of a call's shape that the memory walk reads: per micro-batch its DP rank, rows (one for a packed
    micro-batch: its sequences run as one row), width, packing and token slots (the routed-expert replay is sized by
    slots), and the logits width (the re-expansion to the global width). The row lengths inside a micro-batch do not
    change its tensors, so calls that differ only there (or, packed, only in how many sequences they pack) share one
    walk (except where the walk reads them: ``SimExecutor.memory_report`` adds the Hugging Face model's mask and the
    re-expanded head's rows, ``segments.short_rows``). The kind is kept so a forward and a forward_backward never
    share a result by accident, and whether the call takes SkyRL's RL path (its head computes an entropy).

    One flat tuple, five items per micro-batch: it is hashed and compared on every call, and a lookup in a table of
    tens of thousands of keys costs a memory fetch per object the stored key is made of."""
    key: list[Any] = [shape.kind, shape.rl_path, shape.logits_width]
    for mb in shape.microbatches:
        key += (mb.dp_rank, 1 if mb.packed else mb.rows, mb.width, mb.packed, mb.slots)
    return tuple(key)


def priced_beyond_walk(shape: CallShape) -> tuple[Any, ...]:
    """What the time model's call cost reads of a shape that ``walk_key`` leaves out (``timing.call_key``): the call's
    own rows (its row overhead) and each packed micro-batch's row lengths (its attention pairs are per row; their
    count is its rows). A walk key plus these determine the call key (``tests/test_walk_memo.py``)."""
    return (shape.rows, *[mb.all_row_tokens for mb in shape.microbatches if mb.packed])


@dataclass(frozen=True, slots=True)
class CallCosts:
    """A training call's memory and duration as ``SimExecutor.batch`` reads them: the walk's report and call record,
    the time model's seconds (``call_seconds``) and the seconds the call ran (times the report's ``progress``), and the
    report's fields every call reads, held here so that a call answered from the cache reads one object."""

    report: MemoryReport
    record: dict[str, Any]
    call_seconds: float
    seconds: float
    carried: CarriedMemory
    peak_bytes: int
    oom: OomRecord | None
    has_timeline: bool

    @classmethod
    def of(cls, report: MemoryReport, record: dict[str, Any], call_seconds: float) -> CallCosts:
        return cls(
            report,
            record,
            call_seconds,
            call_seconds * report.progress,
            report.carried,
            report.peak_bytes,
            report.oom,
            report.has_timeline,
        )


def memory_record(report: MemoryReport) -> dict[str, Any]:
    """A call's ``CallRecord.memory`` without its timeline: its breakdown (and each stage's peak). One per memoised
    report, shared by the calls answered with it (a record is read, never changed; a long run makes a million calls
    and a few thousand reports)."""
    memory: dict[str, Any] = {"breakdown": report.breakdown}
    if report.stage_peaks is not None:
        memory["stage_peaks"] = report.stage_peaks
    return memory


def without_timeline(report: MemoryReport) -> MemoryReport:
    """A copy of the report without its timeline, made or deferred (what the walk cache keeps once calls stop
    keeping theirs). A field-by-field copy: ``dataclasses.replace`` costs three times as much, on most calls."""
    copy = object.__new__(MemoryReport)
    copy.__dict__.update(report.__dict__)
    copy.timeline = []
    copy.deferred_timeline = None
    return copy


def allocator_note(endpoint: Endpoint, result: RunResult) -> str | None:
    """A run's note on its training workers' allocator, when the endpoint chose it (``trainer.use_expandable_segments``
    given) or runs the classic one: what it does to reserved memory, and with the classic allocator what was reserved
    but unallocated after the calls."""
    if classic_allocator(endpoint):
        views = [(c.index, c.memory["allocator"]) for c in result.calls if c.memory and "allocator" in c.memory]
        text = (
            f"{ALLOCATOR_NOTE} PyTorch's classic caching allocator (trainer.use_expandable_segments false): every call "
            "replayed through fixed segments kept from call to call, which a freed block can only rejoin in its own "
            "segment"
        )
        if views:
            at_peak = max(views, key=lambda item: item[1]["unallocated_at_peak_bytes"])
            after = max(views, key=lambda item: item[1]["unallocated_after_bytes"])
            text += (
                f"; reserved but unallocated at a call's peak up to {format_size(at_peak[1]['unallocated_at_peak_bytes'])} "
                f"(call #{at_peak[0]}), after a call "
                f"{format_size(views[0][1]['unallocated_after_bytes'])} (call #{views[0][0]}) to at most "
                f"{format_size(after[1]['unallocated_after_bytes'])} (call #{after[0]})"
            )
        return text
    if endpoint.trainer.use_expandable_segments and profile_device(endpoint.hardware.profile) == "cuda":
        return (
            f"{ALLOCATOR_NOTE} expandable segments (trainer.use_expandable_segments true): reserved memory grows and "
            "shrinks in 2 MiB pages, so memory a call frees is reused whatever the size of the next request; the "
            "fragmentation of the classic allocator (false) cannot happen"
        )
    return None


class SimExecutor:
    """Costs each call with the memory and time models; never touches a device.

    Every call keeps its allocation timeline (for plots, traces and ``--explain``) up to ``TIMELINE_CALLS`` calls; past
    that only the calls that run out of memory or set a new peak keep theirs, so a 20,000-request run stays small.
    """

    def __init__(self, endpoint: Endpoint, model: ModelArch, memory: MemoryModel, time: TimeModel) -> None:
        self.endpoint = endpoint
        self.model = model
        self.memory_model = memory
        self.moe = model.moe is not None  # a dense model's calls have no routes to price or report
        self.memory = memory.bind(endpoint, model)  # the run's models, bound once: every call asks them
        # bound to the endpoint with a call's recorded routing spread (``routed_memory``), per routing
        self.routed_models: BoundedCache[str, BoundMemoryModel] = BoundedCache(ROUTED_MODELS)
        self.time = time.bind(endpoint, model)
        self.saved_checkpoints: set[tuple[str, str]] = set()
        self.timelines_kept = 0
        self.highest_peak = -1
        self.carried = CarriedMemory()  # what earlier calls left on the workers, in call order
        # memoised walks: per carried state and device memory, per walk key the report and its call record, and per
        # walk key and what the time model reads beyond it (``priced_beyond_walk``) the call's ``CallCosts``
        self.walks: BoundedCache[tuple[CarriedMemory, DeviceMemory], tuple[BoundedCache[Any, Any], ...]] = BoundedCache(
            WALK_STATES
        )
        self._walks_state: tuple[Any, Any, Any] = (None, None, None)  # the last (carried, device, tables) asked
        # the run's bound roofline prices a call by ``timing.call_key`` alone, so its seconds are kept with the walk's
        # answer (one lookup a call); another time model is asked on every call
        self.costs_by_key = isinstance(self.time, BoundRoofline)
        self.tenants = SimAdapterStore(endpoint, model)  # host slots and swaps (tenancy.py)
        self.registered: set[str] = set()  # models whose LoRA adapter vLLM serves (enable_lora)
        self.vllm: SimSampler | None = None
        # the device the trainer shares with vLLM (colocation.py); None when they do not share one
        self.device = ColocatedDevice(endpoint, model) if colocated(endpoint) else None
        self.own_memory = DeviceMemory.of(endpoint)  # the device memory a training call may use, alone on it
        self.shared_memory = self.device.training_memory() if self.device is not None else None
        self.padded_rows_matter = trainer_of(endpoint).model_code == "hf"  # the walk reads row lengths (a mask)
        self.row_tokens_matter = reads_row_tokens(endpoint)  # the LM head's re-expansion reads each row's tokens
        self.lazy_state = lazy_state(model, endpoint)  # what the trainer makes on the way (none for Megatron LoRA)
        self.classic = self._classic_allocators()  # the classic allocator's ranks, or None
        self.separate_sync: SeparateSync | None = None  # a merged sync to engines on their own GPUs (weight_sync.py)

    def _classic_allocators(self) -> ClassicAllocators | None:
        """The run's classic caching allocators when the endpoint runs it (the allocator its bound memory model chose
        ``replays``): they replay the walk's steps, so the bound memory model must be the walk."""
        if not classic_allocator(self.endpoint):
            return None
        if not isinstance(self.memory, BoundWalk):
            raise UserError(
                "trainer.use_expandable_segments false: the classic allocator replays the allocation walk's steps, "
                f"and this run's memory model is {type(self.memory).__name__}"
            )
        return ClassicAllocators(self.memory)

    def sampler(self, table: FuturesTable, clock: Any) -> SimSampler | None:
        """The run's vLLM engines (``vllm_sampler.SimSampler``, built when a sample first needs them) for the
        SkyRL-Train strategies, which sample on vLLM; None for any other (the JAX backend samples in its own
        process: its serial sample batches are costed per call, ``BoundTimeModel.sample_seconds``)."""
        if self.endpoint.trainer.strategy not in SKYRL_TRAIN_STRATEGIES:
            return None
        own = self.device is None and profile_device(self.endpoint.hardware.profile) == "cuda"
        self.vllm = SimSampler(
            self.endpoint, self.model, table, clock, self.saved_checkpoints, self.registered, own_devices=own
        )
        return self.vllm

    def training_memory(self) -> DeviceMemory:
        """The device memory a training call's walk may use: once vLLM has started on a shared device, the device
        less what vLLM keeps there asleep (``ColocatedDevice.training_memory``); else the endpoint's own."""
        if self.device is not None and self.device.started and self.shared_memory is not None:
            return self.shared_memory
        return self.own_memory

    def prepare_sampling(self, requests: list[Request]) -> CallOutcome | None:
        """The device handed to vLLM before samples run (``prepare_for_sampling``): its lazy start, the trainer's
        offload, the wake. None when nothing switched (no shared device, or vLLM already awake)."""
        if self.device is None:
            return None
        switch = self.device_switch("sample")
        return switch_outcome(switch) if switch.transitions or switch.failed else None

    def device_switch(self, kind: str, named_save: bool = False) -> Switch:
        """The shared device's switches before a request (``ColocatedDevice.before``), and under the classic
        allocator what they do to the trainer's cached segments: its offload empties them, its reload needs one
        contiguous block per part (``ClassicAllocators.switched``, on the memory the trainer has once they are
        made), which fails the switch when none fits."""
        assert self.device is not None
        switch = self.device.before(kind, named_save=named_save)
        if self.classic is not None and switch.transitions and not switch.failed:
            oom = self.classic.switched([t.step for t in switch.transitions], self.training_memory())
            if oom is not None:
                switch.oom = oom
        return switch

    def colocation_report(self) -> dict[str, Any] | None:
        """The run's switching (``ColocatedDevice.report``), or None when the trainer and vLLM do not share devices
        or vLLM never started."""
        if self.device is None or not self.device.counts:
            return None
        return self.device.report()

    def finish_result(self, result: RunResult) -> None:
        """What the shared device says about the whole run, once it is over: once vLLM shared the devices the
        trainer's calls had its sleeping memory less, so headroom is judged against that capacity; and an engine
        count that does not cover the trainer's devices, which SkyRL refuses (``train/utils/utils.py``:
        ``validate_cfg``), is warned about (the model follows the busiest device only). The allocator the run
        modelled says why its reserved memory is what it is (``allocator_note``)."""
        note = allocator_note(self.endpoint, result)
        if note is not None:
            result.notes.append(note)
        if self.device is None or not self.device.started or self.shared_memory is None:
            return
        result.capacity_bytes = self.shared_memory.capacity_bytes
        inference, devices = self.endpoint.inference, self.endpoint.hardware.devices
        engines = inference.num_engines * inference.tensor_parallel_size
        if engines != devices:
            result.log.append(
                f"warning: colocated vLLM on {engines} device(s) beside the trainer's {devices}: SkyRL 0.4.0 refuses "
                "this (num_policy_gpus must equal num_engines x tensor_parallel_size); the simulator models the "
                "busiest device only"
            )

    def memory_report(self, shape: CallShape, routed: Endpoint | None = None) -> tuple[MemoryReport, dict[str, Any]]:
        """The memory walk of one call and its ``CallRecord.memory`` without a timeline, memoised per run: the
        endpoint and model are fixed for the executor, so the key is what the walk reads of the shape (and the call's
        routing when its recorded routes set it: ``routed``, from ``routed_endpoint``), under the carried state and
        the device memory of the moment (``walks_now``). Reports and records are shared between
        calls, never changed after they are cached. A call that fails with memory carried from earlier calls is
        walked alone too, to say whether it fails only because of them."""
        key, memory = self.walk_key_of(shape, routed)
        return self._walked(shape, key, memory)[0]

    def walk_key_of(self, shape: CallShape, routed: Endpoint | None = None) -> tuple[tuple[Any, ...], Any]:
        """The walk cache's key of a call (``walk_key`` and what this endpoint's walk reads beyond it) and the bound
        memory model that walks it (the run's, or the one bound to the call's routing)."""
        memory = self.memory
        key = walk_key(shape)
        if self.padded_rows_matter:  # the Hugging Face model masks a micro-batch with a left-padded row
            key += (tuple(any(t < mb.width for t in mb.all_row_tokens) for mb in shape.microbatches),)
        if self.row_tokens_matter:  # each row's gradient clone in the head's backward is the row's size
            key += (tuple([short_rows(mb, self.endpoint) for mb in shape.microbatches]),)
        if routed is not None:
            routing, memory = self.routed_memory(routed)
            key = (key, routing)
        return key, memory

    def _walked(
        self, shape: CallShape, key: tuple[Any, ...], memory: Any
    ) -> tuple[tuple[MemoryReport, dict[str, Any]], tuple[MemoryReport, dict[str, Any]]]:
        """The call's walk (report and record) by ``key`` from the walk cache, walked and stored there when it is not,
        and the cache's entry (the same, or, for a report kept without its timeline, the copy the cache holds)."""
        walks = self.walks_now()
        found = walks.get(key)
        if found is not None:
            return found, found
        device = self.training_memory()
        report = memory.evaluate(shape, self.carried, device)
        if report.oom is not None and self.carried.buffers:
            alone = memory.evaluate(shape, None, device)
            dp = self.endpoint.parallelism.dp
            report.oom.where["carried_bytes"] = max(self.carried.total(r) for r in range(dp))
            report.oom.where["fails_only_after_earlier_calls"] = alone.oom is None
        # A later call with this key needs the timeline only while calls still keep theirs, or when it fails: a
        # repeated peak is never a new record. Otherwise the cache holds the report without its timeline.
        needed = report.oom is not None or self.timelines_kept < TIMELINE_CALLS
        record = memory_record(report)
        stored = walks.put(key, (report if needed else without_timeline(report), record))
        return (report, record), stored

    def call_costs(self, shape: CallShape, routed: Endpoint | None = None) -> CallCosts:
        """A training call's memory walk (``memory_report``) and duration (the time model's ``call_seconds``), kept
        together under the carried state and device memory of the moment by the walk's key and what the time model
        reads beyond it (``priced_beyond_walk``): a call answered from the cache is one lookup. A call priced with its
        recorded routing, or by a time model that does not price by ``timing.call_key``, is asked of both."""
        if routed is not None or not self.costs_by_key:
            report, record = self.memory_report(shape, routed)
            return CallCosts.of(report, record, self.time.call_seconds(shape))
        costs = self._tables_now()[1]
        key, memory = self.walk_key_of(shape)
        full = key + priced_beyond_walk(shape)
        found = costs.get(full)
        if found is not None:
            return found
        (report, record), stored = self._walked(shape, key, memory)
        seconds = self.time.call_seconds(shape)
        answer = CallCosts.of(report, record, seconds)
        costs.put(full, answer if stored[0] is report else CallCosts.of(*stored, seconds))
        return answer

    def routed_endpoint(self, call: BatchCall, shape: CallShape) -> Endpoint | None:
        """The endpoint with the spread of the routes ``call`` replays when its routing spread is ``recorded`` and the
        routes were recorded skewed (``RecordedRoutes.expert_weights``): the busiest rank's share and busiest expert's
        load of the call's rows as the real backend lays them out (``recorded_routes.expert_pairs``: captured routes,
        the padding route on the rest of each row, pad rows copying the first), priced as a skew. None when the call
        is priced with the endpoint's own spread (uniform routes, the default draws, are priced even)."""
        if self.model.moe is None or self.endpoint.trainer.routing_spread != "recorded":
            return None
        rows = [(r.routed_experts, n) for r in call.requests if r.routed_experts is not None for n in r.datums]
        if not any(routes.expert_weights for routes, _ in rows):
            return None
        width = max(mb.width for mb in shape.microbatches)
        counts = expert_pairs(rows, width, shape.padded_rows - shape.rows, self.model)
        share, load = busiest_shares(counts, self.endpoint.parallelism.ep)
        routing = MoeRouting(spread="skew", busiest_rank_share=share, busiest_expert_load=load)
        trainer = self.endpoint.trainer.model_copy(update={"moe_routing": routing})
        return self.endpoint.model_copy(update={"trainer": trainer})

    def routed_memory(self, routed: Endpoint) -> tuple[str, BoundMemoryModel]:
        """The memory model bound to a routed endpoint (``routed_endpoint``), kept per routing, and the routing as
        the walk cache's key: the run's own bound model answers every call priced with the endpoint's spread."""
        routing = routed.trainer.moe_routing.model_dump_json()
        bound = self.routed_models.get_or_make(routing, lambda: self.memory_model.bind(routed, self.model))
        return routing, bound

    def walks_now(self) -> BoundedCache[tuple[Any, ...], tuple[MemoryReport, dict[str, Any]]]:
        """The memoised walks under the carried state and device memory of the moment (they change a few times a
        run: the state and device of the call before are recognised by identity, any other looked up)."""
        return self._tables_now()[0]

    def _tables_now(self) -> tuple[BoundedCache[Any, Any], ...]:
        """The walk cache and the call-cost cache (``call_costs``) of the carried state and device memory of the
        moment, recognised by identity when they are the call before's."""
        carried, device = self.carried, self.training_memory()
        if carried is self._walks_state[0] and device is self._walks_state[1]:
            return self._walks_state[2]
        tables = self.walks.get((carried, device))
        if tables is None:
            # the costs go when the walks they were read from go: a call whose walk must be made again is answered as
            # any call walked anew (its report with its timeline)
            costs: BoundedCache[Any, CallCosts] = BoundedCache(WALK_CACHE_SIZE)
            tables = self.walks.put((carried, device), (BoundedCache(WALK_CACHE_SIZE, on_clear=costs.clear), costs))
        self._walks_state = (carried, device, tables)
        return tables

    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        if shape is None:
            return self._sample(call)
        device = self.device
        switch = moved(self.device_switch(call.kind)) if device is not None and not device.settled(call.kind) else None
        if switch is not None and switch.failed:
            return switch_outcome(switch)  # the backload ran out of memory: the call never starts
        swap = self.tenants.swap(call.kind, call.model_id)  # before the call, as ensure_active_adapter
        routed = self.routed_endpoint(call, shape) if self.moe else None
        before = self.carried
        costs = self.call_costs(shape, routed)
        if self.classic is not None:  # the allocator's state is the run's own: replayed on every call, never cached
            replayed = self.classic.replay(shape, before, costs.report, self.training_memory())
            costs = CallCosts.of(replayed, {**costs.record, "allocator": replayed.allocator}, costs.call_seconds)
        self.carried = costs.carried
        if self.device is not None:
            self.device.after_call(costs.carried)
        seconds = costs.seconds
        if swap is not None:
            seconds += swap["seconds"]
        if switch is not None:
            seconds += switch.seconds
        oom = costs.oom
        if costs.has_timeline and self._keep_timeline(costs.peak_bytes, oom is not None):
            memory = {**costs.record, "timeline": costs.report.resolve_timeline()}
        else:
            memory = costs.record
        moe = moe_call_extra(shape, routed or self.endpoint, self.model) if self.moe else None
        extra: dict[str, Any] = {"moe": moe} if moe else {}
        if swap is not None:
            extra["swap"] = swap
        if switch is not None:
            extra.update(switch.extra())
        return CallOutcome(
            duration_s=seconds,
            wait_s=seconds,
            peak_bytes=costs.peak_bytes,
            oom=oom,
            metrics={} if oom else pass_metrics(call.requests),
            outputs={r.id: {"datum_lengths": list(r.datums)} for r in call.requests} if not oom else {},
            memory=memory,
            extra=extra,
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
        seconds = self.time.sample_seconds(requests)
        if missing:
            names = ", ".join(sorted({r.checkpoint for r in missing}))
            return CallOutcome(duration_s=0.0, wait_s=0.0, error=f"sampler checkpoint not found: {names}")
        outputs = {r.id: {"generated_tokens": r.max_tokens * r.num_samples} for r in requests}
        moe = moe_sample_extra(requests, self.endpoint, self.model)
        extra: dict[str, Any] = {"moe": moe} if moe else {}
        scored = prompt_logprobs_bytes(requests, self.endpoint, self.model)
        if scored:
            extra["prompt_logprobs_bytes"] = scored
        return CallOutcome(duration_s=seconds, wait_s=seconds, outputs=outputs, extra=extra)

    def single(self, request: Request) -> CallOutcome:
        registry = self.tenants.registry
        if registry is not None and request.type in ("create_model", "unload_model"):
            return self._lifecycle(request, registry)
        switch = self._switch_single(request)
        if switch is not None and switch.failed:
            return switch_outcome(switch)
        if request.type == "optim_step" and self.lazy_state:  # moments made, gradients freed (FSDP)
            self.carried = carried_after_optim_step(self.carried, self.endpoint, self.model, self.lazy_state)
        swap = self.tenants.swap(request.type, request.model_id)
        seconds = self.time.single_seconds(request)
        extra = switch.extra() if switch is not None else {}
        if switch is not None:
            seconds += switch.seconds
        separate = not self.endpoint.placement.colocate_all and self.vllm is not None  # vLLM on devices of its own
        if request.type == "save_weights_for_sampler" and separate:
            seconds += nccl_sync_seconds(self.endpoint, self.model, load_profile(self.endpoint.hardware.profile))
            sync = self._separate_sync()
            if sync is not None:
                extra["weight_sync"] = sync.as_dict()
                oom = sync.oom(self.endpoint)
                if oom is not None:  # the broadcast ran out on one side: the engines keep their old weights
                    return CallOutcome(duration_s=seconds, wait_s=seconds, oom=oom, extra=extra)
        if request.type == "save_weights_for_sampler":
            self.saved_checkpoints.add((request.model_id, request.checkpoint))
            self.registered.add(request.model_id)  # SkyRL's save_sampler_checkpoint loads the adapter into vLLM
        elif request.type == "unload_model":
            self.registered.discard(request.model_id)  # delete_model unloads its adapter from vLLM
        if swap is not None:
            seconds += swap["seconds"]
            extra["swap"] = swap
        return CallOutcome(duration_s=seconds, wait_s=seconds, extra=extra)

    def _separate_sync(self) -> SeparateSync | None:
        """A merged sync's memory on both ends when the engines have CUDA devices of their own
        (``weight_sync.separate_sync``); None for an adapter sync or a CPU profile."""
        if self.endpoint.lora_weight_sync and not self.endpoint.trainer.train_base_weights:
            return None
        if profile_device(self.endpoint.hardware.profile) != "cuda":
            return None
        if self.separate_sync is None:
            self.separate_sync = separate_sync(self.endpoint, self.model, vllm_start(self.endpoint, self.model))
        return self.separate_sync

    def _switch_single(self, request: Request) -> Switch | None:
        """The switches before a single request on a shared device: optim_step backloads the trainer,
        save_weights_for_sampler starts vLLM if need be and syncs its weights (a named save also exports them),
        save_weights and load_weights backload the trainer (SkyRL 0.4.0 sleeps the engines first)."""
        if self.device is None or request.type not in SWITCHED_SINGLES or self.device.settled(request.type):
            return None
        return moved(self.device_switch(request.type, named_save=bool(request.checkpoint)))

    def _lifecycle(self, request: Request, registry: AdapterRegistry) -> CallOutcome:
        """``create_model``: the runtime's build (the time model's create_model) or an adapter's registration, or
        SkyRL's refusal; ``unload_model``: the slot freed (the last one may tear the runtime down)."""
        if request.type == "unload_model":
            self.registered.discard(request.model_id)  # delete_model unloads its adapter from vLLM
            kind = registry.unload(request.model_id)
            seconds = self.time.single_seconds(request)
            extra: dict[str, Any] = {"host_bytes": registry.host_bytes, "tenancy": kind}
            return CallOutcome(duration_s=seconds, wait_s=seconds, extra=extra)
        lora = request.lora or (self.endpoint.lora.rank, self.endpoint.lora.alpha)
        try:
            kind = registry.create(request.model_id, lora_signature(*lora))
        except TenancyError as exc:
            return CallOutcome(duration_s=0.0, error=str(exc), extra={"host_bytes": registry.host_bytes})
        seconds = self.time.single_seconds(request) if kind == "runtime" else self.tenants.register_seconds()
        return CallOutcome(duration_s=seconds, wait_s=seconds, extra={"host_bytes": registry.host_bytes, "tenancy": kind})


SWITCHED_SINGLES = ("optim_step", "save_weights_for_sampler", "save_weights", "load_weights")
"""The single requests that switch a shared device before they run (``ColocatedDevice.before``)."""


def moved(switch: Switch) -> Switch | None:
    """The switch, or None when nothing moved and nothing failed (most calls on a shared device find it as the
    call before left it: nothing to add to their time or their record)."""
    return switch if switch.transitions or switch.failed else None


def switch_outcome(switch: Switch) -> CallOutcome:
    """A switch as a call's outcome: its time, its failure (an out-of-memory record with the phase, or SkyRL's
    refusal) and its steps."""
    seconds = switch.seconds
    return CallOutcome(duration_s=seconds, wait_s=seconds, oom=switch.oom, error=switch.error, extra=switch.extra())


class SimBackend:
    """``--backend sim``: SkyRL's queue, scheduling, padding, memory and time, simulated."""

    name = "sim"

    def __init__(self, memory: MemoryModel | None = None, time: TimeModel | None = None) -> None:
        self.memory = memory or default_memory_model()
        self.time = time or default_time_model()

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        """The variant's clients and SkyRL's engine in simulated time (the host's run driver on a ``VirtualClock``),
        each call costed by the memory and time models. A long run spools its request records (``SimOptions``)."""
        if variant.endpoint.trainer.strategy == "fsdp":
            reason = fsdp_supported(variant.model)
            if reason is not None:
                raise UserError(
                    f"{variant.endpoint_source or variant.source}, key 'trainer.strategy': fsdp is priced on the "
                    f"Hugging Face model SkyRL's FSDP trainer runs, and model '{variant.model.name}' has {reason}"
                )
        spool = context.typed_options(SimOptions, self.name).spools(variant.request_count())
        result = context.new_result(variant, self.name)
        executor = SimExecutor(variant.endpoint, variant.model, self.memory, self.time)
        try:
            return drive(variant, context, result, executor, VirtualClock(cap_s=MAX_SIM_TIME_S), spool=spool)
        except TenancyError as exc:
            raise UserError(f"{variant.source}: the models loaded at the start do not fit: {exc}") from None
        except SimulatedTimeExceeded:
            raise UserError(
                f"{variant.source} (variant {variant.variant_name}): the run passed the simulated-time cap of "
                f"{MAX_SIM_TIME_S:,.0f} s without finishing its workload"
            ) from None


def carried_after_optim_step(
    carried: CarriedMemory, endpoint: Endpoint, model: ModelArch, lazy: dict[str, int]
) -> CarriedMemory:
    """Every data-parallel rank's carried state after an optim_step (``trainers.after_optim_step``; ``lazy``: the
    endpoint's ``trainers.lazy_state``)."""
    after = carried
    for rank in range(endpoint.parallelism.dp):
        held = carried.held(rank)
        new = after_optim_step(held, model, endpoint, lazy)
        if new != held:
            after = after.with_rank(rank, new)
    return after

"""The trainer and vLLM on the same devices: one GPU's memory as a sequence of states, switched by the requests.

SkyRL 0.4.0 (``trainer.placement.colocate_all: true``, its default) puts a trainer rank and a vLLM worker on every
device and moves the device between them. This module follows the order its code makes the switches in:

- **create_model** builds the trainer and offloads it (``skyrl_train_backend.py``: ``_build_policy``,
  ``offload_to_cpu``). The simulator charges that offload and the first backload only once vLLM exists (below), so a
  run that never samples costs what the trainer alone costs.
- **vLLM starts lazily** at the first ``sample`` or ``save_weights_for_sampler`` (``_ensure_inference_engines``): the
  trainer is offloaded first (``offload_for_sampling``), then vLLM's worker checks that the device's free memory
  (taken once its own CUDA context and NCCL are up, ``gpu_worker.py``: ``init_device``) covers
  ``gpu_memory_utilization x total memory`` (``vllm/v1/worker/utils.py``: ``request_memory``; what the offloaded
  trainer still holds is not subtracted from that budget, it only makes the device short of it), loads its
  weights, profiles a forward and gives the KV cache the rest of the budget (``gpu_worker.py``:
  ``determine_available_memory``; ``kv_cache.kv_cache_size``), refusing to start when nothing is left
  (``kv_cache_utils.py``: ``_check_enough_kv_cache_memory``), captures CUDA graphs unless ``enforce_eager``, and
  warms up its sampler. Then it sleeps at once (``_create_new_inference_client``): level 2 unless the trainer syncs
  LoRA adapters (the client clamps to 1, ``RemoteInferenceClient.sleep``); adapter-only sync (Megatron,
  ``merge_lora: false``) keeps it awake.
- **Before a forward or forward_backward** vLLM sleeps (``_sleep_inference_engines``: level 1 with LoRA, else 2) and
  the dispatch backloads the trainer's model (and, for forward_backward and optim_step, its optimizer;
  ``worker_dispatch.py``: ``_ensure_on_gpu``). optim_step backloads without sleeping vLLM.
- **Before a sample** the trainer is offloaded and vLLM wakes (``_wake_inference_engines_for_sampling``). SkyRL
  refuses to wake engines slept at level 2 (their weights are gone): such a sample fails with SkyRL's message until a
  weight sync.
- **save_weights_for_sampler** (``worker_dispatch.py``: ``save_weights_for_sampler``, ``_prepare_for_weight_sync``):
  merged weights (``merge_lora: true``): vLLM sleeps (level 2 unless clamped), the trainer's model is backloaded (its
  optimizer stays on the host: ``offload_after_step``), vLLM's weights wake (``wake_up(tags=["weights"])``), the
  weights stream through one bounded bucket (``weight_senders.py``: ``_packed_buffer_size_bytes``) while both copies
  are on the device, the trainer is offloaded and the KV cache wakes. A named save also writes a Hugging Face export
  (``save_sampler_checkpoint``: the engines sleep, the trainer's model is backloaded for ``save_hf_model``).
  Adapter-only sync offloads the trainer, wakes vLLM and loads only the adapter (its time is the time model's).

What vLLM keeps while asleep comes from its sleep backend (``vllm/device_allocator/sleep_mode_backend.py``:
``CuMemBackend.suspend``): its ``weights`` (level 1), ``runtime`` and ``cudagraph`` pools are copied to the host,
everything else in its pool (the KV cache; the weights at level 2) is discarded, and what lives outside the pool
(CUDA context, NCCL buffers) stays: ``hardware.reserve_gib``, the same memory outside PyTorch that the trainer's
process keeps. The trainer's offload (``megatron_strategy.py``: ``offload_to_cpu``) moves its weights, gradients and
optimizer state and empties the cache; with LoRA the adapters' parameters stay resident (``megatron_utils.py``:
``offload_megatron_model_to_cpu``), and so do megatron's persistent buffers.

Every copy is priced at its bytes over the hardware profile's bandwidth: host-device copies (offload, backload, a
level-1 sleep and wake, graph pools) over ``bytes_host``, the merged sync's device-local copy over ``bytes_memory``,
the trainer's tensor-parallel gather over ``bytes_interconnect``, exports over ``storage_bandwidth``. The only fixed
times are vLLM's start-up work that has no byte count (``VLLM_INIT_S``, ``CUDA_GRAPH_CAPTURE_S``): estimates, not
measurements (CUDA sleep mode cannot run on the CPU machines, and the GPU machine has no vLLM).

CPU profiles are not modelled here: vLLM's CPU platform has no sleep mode (``vllm/config/model.py`` refuses
``enable_sleep_mode``), so the devices are treated as separate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from skyrl_sim.api import (
    DTYPE_BYTES,
    GIB,
    MODEL_DTYPE_BYTES,
    SKYRL_TRAIN_STRATEGIES,
    CarriedMemory,
    DeviceMemory,
    Endpoint,
    HardwareProfile,
    ModelArch,
    OomRecord,
    load_profile,
    profile_device,
    sampling_mode,
    stage_layers,
)
from skyrl_sim_plugins.sim.description.trainers import lora_params_per_rank, static_bytes, trainer_of
from skyrl_sim_plugins.sim.reference.device_memory import endpoint_allocator, oom_message
from skyrl_sim_plugins.sim.service.inference.fp8_weights import sync_tensors
from skyrl_sim_plugins.sim.service.inference.kv_cache import NO_KV_MEMORY, KvCacheRefused
from skyrl_sim_plugins.sim.service.inference.vllm_budget import (
    cuda_graph_bytes,
    profiled_budget,
    requested_memory,
    weights_bytes,
)
from skyrl_sim_plugins.sim.service.inference.vllm_startup import VllmStart, request_memory_text, vllm_start
from skyrl_sim_plugins.sim.service.trainer_backload import ShortPiece, backload_pieces, first_short
from skyrl_sim_plugins.sim.service.weight_sync import packed_target_bytes

Phase = Literal["vllm_start", "wake", "weight_sync", "backload"]
VllmState = Literal["absent", "awake", "asleep1", "asleep2"]

VLLM_INIT_S = 10.0
"""Estimate (not measured): vLLM's engine-core start without a byte count to price (process spawn, tokenizer,
``torch.compile`` from its cache, the profile run). Its weight load is priced from storage separately."""
CUDA_GRAPH_CAPTURE_S = 20.0
"""Estimate (not measured): capturing vLLM's default CUDA-graph sizes (``CompilationConfig.cudagraph_capture_sizes``)
and warming up the sampler, skipped with ``enforce_eager``."""
NO_SYNCED_WEIGHTS = (
    "inference engines have no synced weights (slept at level 2, which discards them); "
    "call save_weights_for_sampler before sampling"
)
"""SkyRL's refusal to wake engines slept at level 2 (``_wake_inference_engines_for_sampling``)."""


def colocated(endpoint: Endpoint) -> bool:
    """Whether the trainer and vLLM share devices as SkyRL colocates them: ``placement.colocate_all`` on a SkyRL-Train
    strategy whose samples go through the engine (not forwarded), on a CUDA profile (vLLM's sleep mode)."""
    return (
        endpoint.placement.colocate_all
        and endpoint.trainer.strategy in SKYRL_TRAIN_STRATEGIES
        and sampling_mode(endpoint) != "forwarded"
        and profile_device(endpoint.hardware.profile) == "cuda"
    )


def uses_lora(endpoint: Endpoint) -> bool:
    """The trainer trains LoRA adapters (SkyRL: ``lora.rank > 0``); full fine-tuning trains the base weights."""
    return not endpoint.full_fine_tune


def offloads_optimizer_for_sampling(endpoint: Endpoint) -> bool:
    """Whether ``offload_for_sampling`` moves the optimizer off the device: Megatron's ``offload_to_cpu`` always
    does; FSDP's only with ``offload_after_step`` (``fsdp_strategy.py``: ``manual_offload_optimizer =
    offload_after_step and manual_offload``)."""
    return endpoint.trainer.strategy != "fsdp" or endpoint.trainer.offload_after_step


def adapter_only_sync(endpoint: Endpoint) -> bool:
    """SkyRL's ``_adapter_only_sync``: Megatron with LoRA and ``merge_lora: false`` ships only the adapter."""
    return endpoint.trainer.strategy == "megatron" and uses_lora(endpoint) and endpoint.lora_weight_sync


def sleep_level(endpoint: Endpoint, moment: Literal["start", "training", "sync"]) -> int:
    """The level SkyRL sleeps colocated engines at (``inference.sleep_level`` overrides every sleep):

    - ``start`` (``_create_new_inference_client``) and ``sync`` (``_prepare_for_weight_sync``) call ``sleep()`` with
      its default level 2;
    - ``training`` (``_sleep_inference_engines``) asks for 1 with LoRA, else 2;
    - the client forces level 1 when the trainer syncs LoRA adapters (``uses_lora_weight_sync``), since level 2
      would discard the base model it keeps serving."""
    if endpoint.inference.sleep_level is not None:
        return endpoint.inference.sleep_level
    lora_sync = uses_lora(endpoint) and endpoint.lora_weight_sync
    if lora_sync:
        return 1
    return 1 if moment == "training" and uses_lora(endpoint) else 2


@dataclass(frozen=True)
class DeviceSizes:
    """What each party can hold on the busiest device (trainer rank 0 beside engine 0's first worker), bytes."""

    total: int  # what the device reports as its total memory (vLLM's MemorySnapshot.total_memory)
    process_overhead: int  # one process's memory outside PyTorch: CUDA context, NCCL (hardware.reserve_gib)
    trainer_model: int  # the trainer's weights on the rank, as reserved pages
    trainer_optimizer: int  # gradients, fp32 main copy and Adam moments of what it trains, as pages
    trainer_kept: int  # what stays when offloaded: LoRA parameters (the fused DDP buffers), as pages
    vllm_weights: int
    vllm_activations: int  # the profiled forward's peak, which serving reuses
    vllm_graphs: int  # CUDA-graph pools (0 with enforce_eager)
    vllm_kv: int  # the KV blocks allocated
    requested: int  # gpu_memory_utilization x total
    kv_budget: int  # what profiling leaves for KV (<= 0: vLLM refuses to start)
    sync_bucket: int  # the packed weight-sync buffer
    kv_refusal: KvCacheRefused | None = None  # kv_cache_size's refusal of these settings (too few blocks for one sequence)
    start: VllmStart | None = None  # vLLM's start, step by step (vllm_startup)

    @property
    def vllm_awake(self) -> int:
        return self.process_overhead + self.vllm_weights + self.vllm_activations + self.vllm_graphs + self.vllm_kv

    def as_dict(self) -> dict[str, int]:
        sizes = {key: getattr(self, key) for key in self.__dataclass_fields__ if key not in ("kv_refusal", "start")}
        return sizes | {"vllm_awake": self.vllm_awake}


def device_sizes(endpoint: Endpoint, model: ModelArch) -> DeviceSizes:
    """The byte counts of one device, from the model's architecture and the endpoint (see the module doc); vLLM's
    from its start on this device (``vllm_startup.vllm_start``, the one definition of its budget and KV cache)."""
    inference = endpoint.inference
    rule = endpoint_allocator(endpoint)
    total = int(endpoint.hardware.device_memory_gib * GIB)
    model_bytes, optimizer_bytes, kept = trainer_parts(endpoint, model, rule.reserved)
    start = vllm_start(endpoint, model, total)
    profiled = profiled_budget(endpoint, model, total)
    dtype = MODEL_DTYPE_BYTES[inference.model_dtype]
    bucket = packed_target_bytes(endpoint, sync_tensors(endpoint, model, dtype))  # weight_senders: _packed_buffer_size_bytes
    return DeviceSizes(
        total=total,
        process_overhead=start.context,
        trainer_model=model_bytes,
        trainer_optimizer=optimizer_bytes,
        trainer_kept=kept,
        vllm_weights=start.weights,
        vllm_activations=start.activations,
        vllm_graphs=start.graphs,
        vllm_kv=start.kv_bytes,
        requested=start.requested,
        kv_budget=profiled.kv_bytes if inference.kv_cache_memory_bytes is None else inference.kv_cache_memory_bytes,
        sync_bucket=bucket,
        kv_refusal=start.refusal,
        start=start,
    )


def trainer_parts(endpoint: Endpoint, model: ModelArch, reserved: Any) -> tuple[int, int, int]:
    """The trainer rank's state as an offload moves it, each part as reserved pages (``reserved``): what
    ``offload_to_cpu(offload_model=True)`` moves, what ``offload_optimizer`` moves, and what stays on the device.

    - Megatron (``megatron_strategy.py``: ``offload_megatron_model_to_cpu``; ``offload_megatron_grads_to_cpu`` and
      ``offload_megatron_optimizer`` with the optimizer): the weights; the gradient buffer with the optimizer; with
      LoRA the adapters' parameters stay resident (the fused DDP buffers), their gradients and Adam state move.
    - FSDP (``fsdp_utils.py``: ``offload_fsdp2_model_to_cpu``, a ``model.to("cpu")`` that takes the gradients along;
      ``offload_fsdp_optimizer``): the sharded parameters and gradients (LoRA included); the AdamW moments; nothing
      stays. With ``fsdp.cpu_offload`` SkyRL moves nothing: FSDP2 keeps all of it on the host
      (``description.trainers.fsdp_terms`` counts none of it on the device)."""
    terms = trainer_of(endpoint).state_terms(model, endpoint)
    by = {category: sum(t.nbytes for t in terms if t.category == category) for category in {t.category for t in terms}}
    if endpoint.trainer.strategy == "fsdp":
        moved = by.get("weights", 0) + by.get("adapters", 0) + by.get("gradients", 0)
        return reserved(moved), reserved(by.get("optimizer_state", 0)), 0
    if endpoint.full_fine_tune:
        optimizer = by.get("gradients", 0) + by.get("master_weights", 0) + by.get("optimizer_state", 0)
        return reserved(by["weights"]), reserved(optimizer), 0
    pdtype = DTYPE_BYTES[endpoint.lora.dtype or endpoint.trainer.params_dtype]
    lora_params = lora_params_per_rank(model, endpoint, stage_layers(model, endpoint)) * pdtype
    static = static_bytes(model, endpoint)
    return reserved(static["weights"]), max(0, reserved(static["adapters"]) - reserved(lora_params)), reserved(lora_params)


def request_memory_error(endpoint: Endpoint, free: int, total: int) -> str:
    """vLLM's start-up refusal when the device cannot supply the utilization budget (``request_memory``)."""
    util = endpoint.inference.gpu_memory_utilization
    return request_memory_text(requested_memory(endpoint, total), total, free, util)


@dataclass(frozen=True)
class Transition:
    """One step of a switch: what moved, how long it took, and the device after it."""

    step: str  # trainer_offload, trainer_backload, vllm_start, vllm_sleep, vllm_wake, weight_sync, hf_export
    seconds: float
    bytes_moved: int
    device_bytes: int  # what the device holds after the step (at its peak for a sync)
    trainer: str
    vllm: str
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seconds": self.seconds,
            "bytes_moved": self.bytes_moved,
            "device_bytes": self.device_bytes,
            "trainer": self.trainer,
            "vllm": self.vllm,
            **({"detail": self.detail} if self.detail else {}),
        }


@dataclass
class Switch:
    """The transitions one request triggers before it runs, and how they failed, if they did: ``oom`` when the device
    ran out (a phase, what was on it, the size tried), ``error`` when SkyRL refuses (a level-2 wake)."""

    transitions: list[Transition] = field(default_factory=list)
    oom: OomRecord | None = None
    error: str | None = None

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.transitions)

    @property
    def failed(self) -> bool:
        return self.oom is not None or self.error is not None

    @property
    def message(self) -> str | None:
        return self.oom.message if self.oom is not None else self.error

    def extra(self) -> dict[str, Any]:
        return {"switches": [t.as_dict() for t in self.transitions]} if self.transitions else {}


class ColocatedDevice:
    """One colocated device's state between requests: whether the trainer's model and optimizer are on it, and
    vLLM's state (absent until its lazy start, awake, asleep at level 1 or 2). ``before(kind)`` makes the switches a
    request of ``kind`` triggers, in SkyRL's order, and checks each against the device's total memory."""

    def __init__(self, endpoint: Endpoint, model: ModelArch, profile: HardwareProfile | None = None) -> None:
        self.endpoint = endpoint
        self.model = model
        self.profile = profile or load_profile(endpoint.hardware.profile)
        self.sizes = device_sizes(endpoint, model)
        self.parameters = model.parameter_count()  # the text model's, once (a weight sync and an export read it)
        self.model_on_gpu = True  # the trainer as the trainer-only model sees it, until vLLM exists
        self.optimizer_on_gpu = True
        self.vllm: VllmState = "absent"
        self.trainer_buffers = 0  # megatron's persistent buffers the last call left (reserved pages)
        self._carried: CarriedMemory | None = None  # the carried state ``trainer_buffers`` was read from
        self.switch_s = 0.0
        self.counts: dict[str, int] = {}

    # ------------------------------------------------------------------ what is on the device

    @property
    def started(self) -> bool:
        return self.vllm != "absent"

    def trainer_bytes(self) -> int:
        s = self.sizes
        held = s.process_overhead + s.trainer_kept + self.trainer_buffers
        held += s.trainer_model if self.model_on_gpu else 0
        held += s.trainer_optimizer if self.optimizer_on_gpu else 0
        return held

    def vllm_bytes(self, state: VllmState | None = None) -> int:
        state = state or self.vllm
        if state == "absent":
            return 0
        if state == "awake":
            return self.sizes.vllm_awake
        return self.sizes.process_overhead  # asleep: only what lives outside its pool

    def on_device(self) -> dict[str, Any]:
        return {
            "trainer": self.trainer_state(),
            "trainer_bytes": self.trainer_bytes(),
            "vllm": self.vllm,
            "vllm_bytes": self.vllm_bytes(),
            "total_bytes": self.sizes.total,
            "while_vllm_sleeps": self.while_vllm_sleeps(),
        }

    def while_vllm_sleeps(self) -> dict[str, int]:
        """What stays on the device while vLLM sleeps and the trainer is offloaded, term by term: the floor neither
        party gives back. vLLM keeps what lives outside its sleep pools (``CuMemBackend.suspend`` frees or copies
        out the ``weights``, ``kv_cache``, ``runtime`` and ``cudagraph`` pools): its CUDA context and NCCL; no
        tensor of its own is modelled outside those pools. The offloaded trainer keeps its context and NCCL, its
        LoRA parameters (``offload_megatron_model_to_cpu`` keeps the fused DDP buffers), megatron's persistent
        buffers, and its optimizer state where it is left on the GPU (``trainer.optimizer_offload: false`` keeps it
        only while training; SkyRL's offload moves it)."""
        s = self.sizes
        terms = {
            "vllm_context_bytes": s.process_overhead,
            "vllm_outside_pools_bytes": 0,
            "trainer_context_bytes": s.process_overhead,
            "trainer_adapters_bytes": s.trainer_kept,
            "trainer_buffers_bytes": self.trainer_buffers,
            "trainer_optimizer_bytes": s.trainer_optimizer if self.optimizer_on_gpu and self.started else 0,
        }
        return terms | {"total_bytes": sum(terms.values())}

    def trainer_state(self) -> str:
        if self.model_on_gpu and self.optimizer_on_gpu:
            return "resident"
        if self.model_on_gpu:
            return "model resident, optimizer offloaded"
        if self.optimizer_on_gpu and self.sizes.trainer_optimizer:
            return "model offloaded, optimizer resident"
        return "offloaded"

    def training_memory(self) -> DeviceMemory:
        """The device memory a trainer call may use once vLLM exists: the device less what vLLM keeps there asleep
        (its memory outside PyTorch; the trainer's own is the endpoint's ``reserve_gib`` as always), and no more than
        the endpoint's own (``memory_limit_gib``)."""
        return DeviceMemory.of(self.endpoint).at_most(self.sizes.total - self.vllm_bytes("asleep1"))

    def after_call(self, carried: CarriedMemory) -> None:
        """What a training call left (its report's ``carried``): megatron's persistent buffers stay through an offload
        (the same carried state as the call before's leaves the same buffers: most calls grow none)."""
        if carried is self._carried:
            return
        self._carried = carried
        rule = endpoint_allocator(self.endpoint)
        held = [carried.held(rank) for rank in range(self.endpoint.parallelism.dp)]
        self.trainer_buffers = max((rule.reserved(sum(b.values())) if b else 0) for b in held)

    # ------------------------------------------------------------------ switches

    def settled(self, kind: str) -> bool:
        """Whether a request of ``kind`` finds the device as it needs it, so ``before`` switches nothing: a training
        call with vLLM not awake and the trainer resident (the state most training calls find), an optim_step with
        the trainer's model and optimizer on the device (nothing to backload)."""
        if kind == "forward_backward" or kind == "forward":
            return self.vllm != "awake" and self.model_on_gpu and (self.optimizer_on_gpu or kind == "forward")
        return kind == "optim_step" and self.model_on_gpu and self.optimizer_on_gpu

    def before(self, kind: str, named_save: bool = False) -> Switch:
        """The switches before a request of ``kind`` (sample, forward, forward_backward, optim_step,
        save_weights_for_sampler, save_weights, load_weights), applied to the state; a failed switch leaves the state
        where it failed."""
        switch = Switch()
        if self.settled(kind):
            return switch
        if kind == "sample":
            self._ensure_engines(switch) and self._wake_for_sampling(switch)
        elif kind in ("forward", "forward_backward"):
            self._sleep(switch, "training")
            self._backload(switch, model=True, optimizer=kind == "forward_backward")
        elif kind == "optim_step":
            self._backload(switch, model=True, optimizer=True)
        elif kind == "save_weights_for_sampler":
            self._ensure_engines(switch) and self._weight_sync(switch) and named_save and self._hf_export(switch)
        elif kind in ("save_weights", "load_weights"):
            self._checkpoint(switch)
        for t in switch.transitions:
            self.counts[t.step] = self.counts.get(t.step, 0) + 1
        self.switch_s += switch.seconds
        return switch

    def _add(self, switch: Switch, step: str, seconds: float, moved: int, peak: int | None = None, detail: str = "") -> None:
        held = peak if peak is not None else self.trainer_bytes() + self.vllm_bytes()
        switch.transitions.append(Transition(step, seconds, moved, held, self.trainer_state(), self.vllm, detail))

    def _fail(
        self, switch: Switch, phase: Phase, attempted: int, message: str, free: int | None = None, **where: Any
    ) -> bool:
        if free is None:
            free = self.sizes.total - self.trainer_bytes() - self.vllm_bytes()
        step = where.get("start_step") or where.get("step") or where.get("check")
        switch.oom = OomRecord(
            attempted_bytes=attempted,
            where={"phase": phase, "op": f"{phase}: {step}", "on_device": self.on_device(), "free_bytes": free, **where},
            message=message,
            capacity_bytes=self.sizes.total,
        )
        return False

    def _fits(self, switch: Switch, phase: Phase, adding: int, message: str | None = None, **where: Any) -> bool:
        """Whether ``adding`` bytes fit beside what the device holds; a failure in the words of the allocator that
        makes it (PyTorch's for the trainer, vLLM's CUDA allocator for its pools)."""
        held = self.trainer_bytes() + self.vllm_bytes()
        if held + adding <= self.sizes.total:
            return True
        if message is None:  # the trainer's allocation: its process's memory, and vLLM's process beside it
            tensors = max(self.trainer_bytes() - self.sizes.process_overhead, 0)
            device = DeviceMemory.of(self.endpoint)
            message = oom_message(adding, tensors, tensors, self.endpoint, device, self.vllm_bytes())
        return self._fail(switch, phase, adding, message, **where)

    def _offload_trainer(self, switch: Switch, optimizer: bool | None = None) -> None:
        """``offload_for_sampling``: the trainer to the host (Megatron's LoRA parameters stay); its optimizer too
        unless ``optimizer`` says otherwise (``_finish_weight_sync``: ``offload_after_step``) or the strategy keeps it
        (``offloads_optimizer_for_sampling``)."""
        s = self.sizes
        if optimizer is None:
            optimizer = offloads_optimizer_for_sampling(self.endpoint)
        take_optimizer = optimizer and self.optimizer_on_gpu
        moved = (s.trainer_model if self.model_on_gpu else 0) + (s.trainer_optimizer if take_optimizer else 0)
        if not moved:
            return
        self.model_on_gpu = False
        self.optimizer_on_gpu = self.optimizer_on_gpu and not take_optimizer
        self._add(switch, "trainer_offload", moved / self.profile.bytes_host, moved)

    def _backload(self, switch: Switch, model: bool, optimizer: bool) -> bool:
        """``_ensure_on_gpu``: the missing parts back on the device, beside whatever vLLM holds now."""
        s = self.sizes
        need_model = model and not self.model_on_gpu
        need_optimizer = optimizer and not self.optimizer_on_gpu
        moved = (s.trainer_model if need_model else 0) + (s.trainer_optimizer if need_optimizer else 0)
        if not moved:
            return True
        if self.trainer_bytes() + self.vllm_bytes() + moved > s.total:
            return self._backload_oom(switch, need_model, need_optimizer)
        self.model_on_gpu = self.model_on_gpu or need_model
        self.optimizer_on_gpu = self.optimizer_on_gpu or need_optimizer
        self._add(switch, "trainer_backload", moved / self.profile.bytes_host, moved)
        return True

    def _backload_oom(self, switch: Switch, need_model: bool, need_optimizer: bool) -> bool:
        """A backload that does not fit runs out at its first allocation that crosses the free memory, in SkyRL's
        order (``trainer_backload.backload_pieces``: the model, the gradients, the optimizer state, piece by
        piece); PyTorch's message names that piece, the free memory then, and what the trainer had allocated by
        then. The pieces add up to the state's bytes before the allocator's page rounding: where only that rounding
        crosses, the last piece is the one named."""
        s = self.sizes
        room = s.total - self.trainer_bytes() - self.vllm_bytes()
        pieces = backload_pieces(self.model, self.endpoint, need_model, need_optimizer)
        short = first_short(pieces, room)
        if short is None:
            last = pieces[-1]
            short = ShortPiece(last.what, last.nbytes, max(0, room - last.nbytes + 1))
        tensors = max(self.trainer_bytes() - s.process_overhead, 0) + short.placed
        device = DeviceMemory.of(self.endpoint)
        message = oom_message(short.attempted, tensors, tensors, self.endpoint, device, self.vllm_bytes())
        return self._fail(
            switch, "backload", short.attempted, message, free=room - short.placed, step="trainer_backload",
            piece=short.what, placed_bytes=short.placed,
        )

    def _ensure_engines(self, switch: Switch) -> bool:
        """``_ensure_inference_engines``: vLLM's lazy start, step by step as its version runs it
        (``vllm_startup``), beside what the offloaded trainer keeps; then its first sleep."""
        if self.started:
            return True
        s = self.sizes
        start = s.start
        assert start is not None
        self._offload_trainer(switch)
        # the worker takes its snapshot after its own CUDA context and NCCL are up (gpu_worker.py: init_device)
        free = s.total - self.trainer_bytes() - s.process_overhead
        failure = start.first_failure(free)
        if failure is not None:
            check = "kv_cache_memory" if failure.message == NO_KV_MEMORY else failure.check
            return self._fail(
                switch, "vllm_start", failure.attempted, failure.message, free=failure.free, check=check,
                start_step=failure.step, start_live_bytes=failure.live, start=start.as_dict(),
            )
        self.vllm = "awake"
        graphs = CUDA_GRAPH_CAPTURE_S if s.vllm_graphs else 0.0
        load = weights_bytes(self.endpoint, self.model) / self.profile.storage_bandwidth  # the checkpoint, not buffers
        detail = (
            f"KV cache {s.vllm_kv / GIB:.2f} GiB of a {s.requested / GIB:.2f} GiB budget; peak "
            f"{start.peak() / GIB:.2f} GiB, {start.peak_beyond_budget / GIB:.2f} GiB beyond context + budget"
        )
        self._add(switch, "vllm_start", VLLM_INIT_S + graphs + load, s.vllm_weights, detail=detail)
        if not adapter_only_sync(self.endpoint):
            self._sleep(switch, "start")
        return True

    def _sleep(self, switch: Switch, moment: Literal["start", "training", "sync"]) -> None:
        """vLLM's sleep: the weights (level 1) and graph pools to the host, the KV cache (and level-2 weights) gone."""
        if self.vllm != "awake":
            return
        level = sleep_level(self.endpoint, moment)
        moved = (self.sizes.vllm_weights if level == 1 else 0) + self.sizes.vllm_graphs
        self.vllm = "asleep1" if level == 1 else "asleep2"
        self._add(switch, "vllm_sleep", moved / self.profile.bytes_host, moved, detail=f"level {level}")

    def _wake_for_sampling(self, switch: Switch) -> bool:
        """``_wake_inference_engines_for_sampling``: refused after a level-2 sleep; else the trainer offloads and
        every pool wakes (the level-1 weights and graph pools copied back, the KV cache mapped again)."""
        if self.vllm == "awake":
            return True
        if self.vllm == "asleep2":
            switch.error = NO_SYNCED_WEIGHTS
            return False
        self._offload_trainer(switch)
        s = self.sizes
        if not self._fits(switch, "wake", s.vllm_awake - s.process_overhead, vllm_message(), step="vllm_wake"):
            return False
        moved = s.vllm_weights + s.vllm_graphs
        self.vllm = "awake"
        self._add(switch, "vllm_wake", moved / self.profile.bytes_host, moved)
        return True

    def _weight_sync(self, switch: Switch) -> bool:
        """``save_weights_for_sampler`` on colocated engines (see the module doc)."""
        s, profile = self.sizes, self.profile
        if adapter_only_sync(self.endpoint):
            self._offload_trainer(switch)
            if self.vllm != "awake":
                if not self._fits(switch, "wake", s.vllm_awake - s.process_overhead, vllm_message(), step="vllm_wake"):
                    return False
                moved = (s.vllm_weights if self.vllm == "asleep1" else 0) + s.vllm_graphs
                self.vllm = "awake"
                self._add(switch, "vllm_wake", moved / profile.bytes_host, moved)
            return True  # the adapter's export and load are the time model's
        self._sleep(switch, "sync")
        if not self._backload(switch, model=True, optimizer=False):
            return False
        if self.optimizer_on_gpu and self.endpoint.trainer.offload_after_step:  # SkyRL's default true
            self.optimizer_on_gpu = False
            self._add(switch, "trainer_offload", s.trainer_optimizer / profile.bytes_host, s.trainer_optimizer)
        weights_wake = s.vllm_weights + s.vllm_graphs
        restored = s.vllm_graphs + (s.vllm_weights if self.vllm == "asleep1" else 0)  # a level-1 wake copies back
        if not self._fits(switch, "weight_sync", weights_wake + s.sync_bucket, vllm_message(), step="wake weights"):
            return False
        peak = self.trainer_bytes() + s.process_overhead + weights_wake + s.sync_bucket
        tp = self.endpoint.parallelism.tp
        dtype = MODEL_DTYPE_BYTES[self.endpoint.inference.model_dtype]
        gather = self.parameters * dtype * (tp - 1) / tp / profile.bytes_interconnect if tp > 1 else 0.0
        copy = 2 * s.vllm_weights / profile.bytes_memory  # read and write on the device (CUDA IPC, same GPU)
        self.vllm = "asleep2"  # weights woken, KV cache still asleep
        self._add(
            switch,
            "weight_sync",
            restored / profile.bytes_host + gather + copy,
            s.vllm_weights,
            peak=peak,
            detail=f"merged weights through a {s.sync_bucket / GIB:.2f} GiB bucket",
        )
        self._offload_trainer(switch, optimizer=self.endpoint.trainer.offload_after_step)  # _finish_weight_sync
        if not self._fits(switch, "wake", s.vllm_kv + s.vllm_activations, vllm_message(), step="wake kv_cache"):
            return False
        self.vllm = "awake"
        self._add(switch, "vllm_wake", 0.0, 0, detail="kv_cache")
        return True

    def _checkpoint(self, switch: Switch) -> bool:
        """``save_checkpoint`` / ``load_checkpoint`` (the Tinker API's ``save_weights`` and ``load_weights``): the
        dispatch backloads the trainer's model and optimizer (``worker_dispatch.py``: ``_ensure_on_gpu(
        need_optimizer=True, need_model=True)``; ``load_weights`` takes SkyRL's default ``load_optimizer: true``).
        SkyRL 0.4.0 sleeps colocated engines first (PR #2065), at the training level: level 2 for full fine-tuning
        discards the synced weights, so the next sample needs a weight sync. Before that PR the backload ran beside
        awake engines."""
        if self.endpoint.rules.checkpoint_sleeps_engines:
            self._sleep(switch, "training")
        return self._backload(switch, model=True, optimizer=True)

    def _hf_export(self, switch: Switch) -> bool:
        """A named save's Hugging Face export: the engines sleep, the trainer's model is backloaded and written."""
        self._sleep(switch, "training")
        if not self._backload(switch, model=True, optimizer=False):
            return False
        dtype = MODEL_DTYPE_BYTES[self.endpoint.inference.model_dtype]
        written = self.parameters * dtype
        self._add(switch, "hf_export", written / self.profile.storage_bandwidth, written)
        return True

    def report(self) -> dict[str, Any]:
        """The run's switching: counts per step, their total time, the device's sizes, vLLM's start step by step,
        and what stays on the device while vLLM sleeps."""
        report: dict[str, Any] = {"switch_s": self.switch_s, "steps": dict(self.counts), "device": self.sizes.as_dict()}
        if self.sizes.start is not None:
            report["start"] = self.sizes.start.as_dict()
        report["while_vllm_sleeps"] = self.while_vllm_sleeps()
        return report


def vllm_message() -> str:
    """What vLLM's CUDA allocator raises when a pool cannot be mapped again at a wake (``csrc/cumem_allocator.cpp``
    reports the driver's error)."""
    return "CUDA Error: out of memory at csrc/cumem_allocator.cpp (cuMemCreate): vLLM could not wake its memory pool"


def nccl_sync_seconds(endpoint: Endpoint, model: ModelArch, profile: HardwareProfile) -> float:
    """A merged weight sync to engines on their own devices (``colocate_all: false``): the full weights broadcast
    over NCCL (``interconnect``), and with ``offload_kv_for_weight_sync`` the graph pools' round trip to the host of
    the sleep and wake around it. Adapter syncs are the time model's (an export and a load)."""
    if endpoint.lora_weight_sync and uses_lora(endpoint):
        return 0.0
    dtype = MODEL_DTYPE_BYTES[endpoint.inference.model_dtype]
    seconds = sum(sync_tensors(endpoint, model, dtype)) / profile.bytes_interconnect  # the FP8 wire to an FP8 vLLM
    if endpoint.inference.offload_kv_for_weight_sync:
        seconds += 2 * cuda_graph_bytes(endpoint, model) / profile.bytes_host
    return seconds


def switch_share(switch_s: float, engine_busy_s: float) -> float | None:
    """The share of the engine's busy time spent switching the device."""
    return switch_s / engine_busy_s if engine_busy_s > 0 else None

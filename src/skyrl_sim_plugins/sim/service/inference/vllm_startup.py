"""vLLM's start on one engine worker, in the order the endpoint's vLLM version runs it, checked step by step.

``vllm_start(endpoint, model, total)`` is the one place a run learns what vLLM's start puts on a device: the KV cache
(``kv_cache.kv_cache_size`` on ``vllm_budget.profiled_budget``) and every step's bytes. The colocated device
(``colocation.ColocatedDevice``) and engines on devices of their own (``vllm_sampler.SimSampler``) both read it.

The steps (``gpu_worker.py``: ``init_device``, ``load_model``, ``determine_available_memory``,
``initialize_from_config``, ``compile_or_warm_up_model``):

1. ``init``: the worker's CUDA context and NCCL come up, then ``MemorySnapshot``; ``request_memory`` refuses to start
   when the free memory is below ``gpu_memory_utilization x total``. The context (``hardware.reserve_gib``, one
   process's memory outside PyTorch) is outside the budget.
2. ``load_weights``: the weights and, on the V2 runner, the sampler's persistent state (in the budget).
   ``lora_slots``: where vLLM serves LoRA, the adapter slots ``load_model`` makes after the weights
   (``lora_slots``: ``max_loras`` A and B buffers at ``max_lora_rank`` per wrapped module; in the budget, and in
   the ``weights`` pool a sleep offloads).
3. ``profile_run``: a forward over ``max_num_batched_tokens`` tokens and a dummy sampler step; freed at its end, its
   peak kept out of the KV budget (in the budget).
4. ``kv_cache``: the KV cache, allocated per layer (in the budget); vLLM refuses to start when it cannot hold a
   block, or one request of ``max_model_len``.
5. ``cuda_graphs`` (none with ``enforce_eager``): the graphs' pool; in the budget where the version estimates it,
   on top of it where not (the V2 runner before 0.30).
6. ``sampler_warmup``: a sampling step over the warm-up's requests; what it allocates beyond the profile run's
   peak is on top of the budget. The V2 runner of 0.30 and later runs it before the capture, older ones after.

Then SkyRL sleeps colocated engines at once (``colocation``); separate engines stay awake.

A step fails when its live tensors and its largest allocation do not fit in what the device has free beside what
the earlier steps hold; where its allocations are known in order (the weights, the warm-up's ``[rows, vocab]``
tensors), the failure is the first of them that does not fit. It names the step, the size it tried and the free
memory, in the words of what raises it (vLLM's ``request_memory``, PyTorch's caching allocator, vLLM's V1 sampler
warm-up wrapper, pydantic's check of vLLM's engine config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyrl_sim.api import GIB, Endpoint, ModelArch, format_size, lora_rank_refusal, profile_device
from skyrl_sim_plugins.sim.reference.allocator import round_reserved
from skyrl_sim_plugins.sim.service.inference import vllm_budget as budget
from skyrl_sim_plugins.sim.service.inference.fp8_weights import vllm_load_tensors
from skyrl_sim_plugins.sim.service.inference.kv_cache import (
    KvCacheRefused,
    KvCacheSize,
    block_size,
    kv_cache_size,
    layout,
)
from skyrl_sim_plugins.sim.service.inference.lora_slots import lora_slot_tensors, lora_slots, lora_vocab_refusal
from skyrl_sim_plugins.sim.service.inference.vision_weights import tower_built, vision_tensors
from skyrl_sim_plugins.sim.service.inference.weight_tensors import model_tensors


@dataclass(frozen=True)
class StartStep:
    """One step of vLLM's start: what it leaves on the device, what it holds on top while it runs, its largest
    allocation, whether vLLM counts it in its budget, and the code it follows."""

    name: str
    held: int  # bytes the step leaves allocated
    live: int  # bytes of the step's own tensors already allocated when it makes its largest allocation
    attempt: int  # its largest single allocation: what runs out first
    in_budget: bool
    source: str
    detail: str = ""
    allocations: tuple[int, ...] = ()
    """The step's own allocations in the order it makes them, where they are known (the weights tensor by tensor,
    the warm-up's ``[rows, vocab]`` tensors): the first that does not fit is the one that runs out, with what is
    free then. Empty: only ``live`` then ``attempt``."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.name,
            "held_bytes": self.held,
            "live_bytes": self.live,
            "attempt_bytes": self.attempt,
            "in_budget": self.in_budget,
            "source": self.source,
            **({"detail": self.detail} if self.detail else {}),
        }


@dataclass(frozen=True)
class StartFailure:
    """The step where the start ran out: the size it tried, the memory free then, and the message."""

    step: str
    attempted: int
    free: int  # the device's free memory then; a KV cache refusal: what the budget leaves the KV cache
    message: str
    check: str
    live: int = 0  # bytes of the step's own tensors allocated before the one that ran out


@dataclass(frozen=True)
class VllmStart:
    """vLLM's start on one worker of a device with ``total`` bytes (see the module doc)."""

    version: str
    runner: str
    total: int
    context: int  # the worker's memory outside PyTorch, up before its snapshot (outside the budget)
    requested: int
    utilization: float
    steps: tuple[StartStep, ...]
    kv: KvCacheSize | None
    refusal: KvCacheRefused | None
    warmup_rows: int
    capture_sizes: tuple[int, ...] = field(default=())
    max_num_seqs: int = 0
    mamba_layers: bool = False
    config_refusal: str = ""  # vLLM refuses its engine config before any worker starts (a LoRA rank it does not take)
    lora_refusal: str = ""  # vLLM's LM-head LoRA layer refuses the vocabulary while loading (lora_slots)

    @property
    def mamba_blocks_short(self) -> bool:
        """vLLM's check before it captures FULL decode graphs of a model with Mamba-type (gated-DeltaNet) layers:
        each decode sequence needs a cache block, so ``max_num_seqs`` may not exceed the blocks
        (``config/compilation.py``: ``CompilationConfig`` resolving the cudagraph mode, every version read). FULL
        graphs are captured by default (``FULL_AND_PIECEWISE``) unless ``enforce_eager``. The block count is the KV
        cache model's."""
        return bool(self.capture_sizes) and self.mamba_layers and self.kv is not None and (
            self.max_num_seqs > self.kv.num_blocks
        )

    def step(self, name: str) -> StartStep | None:
        return next((s for s in self.steps if s.name == name), None)

    def held(self, name: str) -> int:
        step = self.step(name)
        return step.held if step is not None else 0

    @property
    def weights(self) -> int:
        """The weights pool (``tags=["weights"]``): the weights, the LoRA slots and what the runner made while
        loading (``gpu_worker.py``: ``load_model`` under the pool's context)."""
        return self.held("load_weights") + self.lora_slots

    @property
    def lora_slots(self) -> int:
        """The LoRA adapter slots (``lora_slots``); 0 where vLLM serves no LoRA."""
        return self.held("lora_slots")

    @property
    def activations(self) -> int:
        """The profile run's peak: freed after the start, taken again by the forward of a full step while serving."""
        step = self.step("profile_run")
        return step.live + step.attempt if step is not None else 0

    @property
    def graphs(self) -> int:
        return self.held("cuda_graphs")

    @property
    def kv_bytes(self) -> int:
        return self.held("kv_cache")

    @property
    def awake(self) -> int:
        """What an awake engine worker holds while serving: its context, weights pool, KV cache, graphs and the
        activations of a full step."""
        return self.context + self.weights + self.kv_bytes + self.graphs + self.activations

    @property
    def peak_beyond_budget(self) -> int:
        """How far the start's peak goes past ``context + budget``: what vLLM allocates on top of its budget."""
        return max(0, self.peak() - self.context - self.requested)

    def peak(self) -> int:
        """The start's highest footprint (context included), over its steps."""
        held, top = self.context, self.context
        for s in self.steps:
            top = max(top, held + s.live + s.attempt)
            held += s.held
        return max(top, held)

    def first_failure(self, free_before: int) -> StartFailure | None:
        """The first step that does not fit when ``free_before`` bytes are free once the worker's context is up
        (what its ``MemorySnapshot`` sees); None when the start completes. The KV checks vLLM makes itself come
        at the ``kv_cache`` step."""
        if self.config_refusal:  # EngineArgs.create_engine_config, in the API server: nothing is allocated
            return StartFailure("config", 0, free_before, self.config_refusal, "vllm_config")
        if free_before < self.requested:
            return StartFailure(
                "init", self.requested, free_before, request_memory_message(self, free_before), "request_memory"
            )
        used = 0
        for s in self.steps:
            if s.name == "kv_cache" and self.refusal is not None:
                refusal = self.refusal
                return StartFailure(s.name, refusal.needed_bytes, refusal.available_bytes, str(refusal), "kv_cache_size")
            if s.name == "lora_slots" and self.lora_refusal:  # raised in load_model, after the weights
                return StartFailure(s.name, 0, free_before - used, self.lora_refusal, "lora_vocab")
            if s.name == "cuda_graphs" and self.mamba_blocks_short:
                blocks = self.kv.num_blocks if self.kv is not None else 0
                return StartFailure(s.name, 0, free_before - used, mamba_blocks_message(self.max_num_seqs, blocks),
                                    "mamba_cache_blocks")
            live, attempt = s.live, s.attempt
            if s.live + s.attempt > free_before - used and s.allocations:
                live, attempt = first_short(s.allocations, free_before - used)
            free = free_before - used - live
            if attempt > free:
                tried = round_reserved(attempt)  # the caching allocator's request: large ones in 2 MiB pages
                return StartFailure(s.name, tried, max(free, 0), self.oom_text(s, tried, free), "allocation", live)
            used += s.held
        return None

    def oom_text(self, step: StartStep, tried: int, free: int) -> str:
        """PyTorch's caching-allocator message for a step's allocation (the size it asks the device for), wrapped as
        vLLM wraps it where it does (the V1 runner's ``_dummy_sampler_run``)."""
        raw = (
            f"CUDA out of memory. Tried to allocate {format_size(tried)}. GPU 0 has a total capacity of "
            f"{format_size(self.total)} of which {format_size(max(free, 0))} is free."
        )
        if step.name == "sampler_warmup" and self.runner == "v1":
            return (
                f"CUDA out of memory occurred when warming up sampler with {self.warmup_rows} dummy requests. Please "
                f"try lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine. ({raw})"
            )
        return f"{raw} (vLLM start-up: {step.name})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "vllm_version": self.version,
            "runner": self.runner,
            "context_bytes": self.context,
            "requested_bytes": self.requested,
            "peak_bytes": self.peak(),
            "beyond_budget_bytes": self.peak_beyond_budget,
            "warmup_rows": self.warmup_rows,
            "kv_blocks": self.kv.num_blocks if self.kv is not None else 0,
            "cuda_graph_sizes": len(self.capture_sizes),
            "steps": [s.as_dict() for s in self.steps],
        }


def first_short(allocations: tuple[int, ...], free: int) -> tuple[int, int]:
    """``(allocated before, size)`` of the first of a step's allocations, in order, that does not fit in ``free``
    bytes; the last one when they all fit (the caller then finds no failure)."""
    allocated = 0
    for size in allocations[:-1]:
        if allocated + size > free:
            return allocated, size
        allocated += size
    return allocated, allocations[-1]


def mamba_blocks_message(max_num_seqs: int, blocks: int) -> str:
    """vLLM's refusal, word for word (``config/compilation.py``)."""
    return (
        f"max_num_seqs ({max_num_seqs}) exceeds available Mamba cache blocks ({blocks}). Each decode sequence "
        "requires one Mamba cache block, so CUDA graph capture cannot proceed. Please lower max_num_seqs to at most "
        f"{blocks} or increase gpu_memory_utilization."
    )


def request_memory_message(start: VllmStart, free: int) -> str:
    """vLLM's refusal when the device cannot supply the budget (``vllm/v1/worker/utils.py``: ``request_memory``)."""
    return request_memory_text(start.requested, start.total, free, start.utilization)


def request_memory_text(requested: int, total: int, free: int, util: float) -> str:
    """``request_memory``'s message, word for word."""
    return (
        f"Free memory on device cuda:0 ({format_gib(free)}/{format_gib(total)} GiB) on startup is less than desired "
        f"GPU memory utilization ({util}, {format_gib(requested)} GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )


def format_gib(nbytes: int) -> float:
    """vLLM's ``format_gib``: GiB rounded to two places."""
    return round(nbytes / GIB, 2)


def vllm_start(endpoint: Endpoint, model: ModelArch, total: int | None = None) -> VllmStart:
    """vLLM's start on one worker of a device of ``total`` bytes (default: ``hardware.device_memory_gib``)."""
    total = total if total is not None else int(endpoint.hardware.device_memory_gib * GIB)
    kind = budget.runner(endpoint, model)
    profiled = budget.profiled_budget(endpoint, model, total)
    refusal: KvCacheRefused | None = None
    kv: KvCacheSize | None = None
    try:
        kv = kv_cache_size(endpoint, model, total)
    except KvCacheRefused as exc:
        refusal = exc
    kv_bytes = kv.num_blocks * kv.bytes_per_block if kv is not None else 0
    num_blocks = kv.num_blocks if kv is not None else 0
    rows = budget.warmup_rows(endpoint, model, num_blocks, kv.block_size if kv is not None else block_size(endpoint))
    steps = [load_step(endpoint, model, profiled)]
    slots = lora_slots_step(endpoint, model)
    if slots is not None:
        steps.append(slots)
    if budget.profile_runs(endpoint, model):
        steps.append(profile_step(endpoint, model))
    steps.append(kv_step(endpoint, model, kv_bytes, num_blocks))
    graphs = graph_step(endpoint, model)
    warmup = warmup_step(endpoint, model, rows)
    later = [warmup, graphs] if kind == "v2" and endpoint.vllm.mrv2_warmup_before_capture else [graphs, warmup]
    steps += [s for s in later if s is not None]
    return VllmStart(
        version=endpoint.vllm.version,
        runner=kind,
        total=total,
        context=int(endpoint.hardware.reserve_gib * GIB),
        requested=profiled.requested_bytes,
        utilization=endpoint.inference.gpu_memory_utilization,
        steps=tuple(steps),
        kv=kv,
        refusal=refusal,
        warmup_rows=rows,
        capture_sizes=budget.cudagraph_capture_sizes(endpoint),
        max_num_seqs=endpoint.inference.max_num_seqs,
        mamba_layers=any(kind == "linear_attention" for kind in model.layer_types),
        config_refusal=lora_rank_refusal(endpoint.lora.rank) if endpoint.inference.enable_lora else "",
        lora_refusal=lora_vocab_refusal(endpoint, model),
    )


def load_step(endpoint: Endpoint, model: ModelArch, profiled: budget.ProfiledBudget) -> StartStep:
    """``load_model`` under the ``weights`` pool: the weights, then the runner's buffers."""
    held = profiled.weights_bytes + profiled.buffers_bytes
    largest = min(budget.largest_weight_bytes(endpoint, model), held)
    detail = f"weights {format_size(profiled.weights_bytes)}"
    if profiled.buffers_bytes:
        detail += f", V2 sampler state {format_size(profiled.buffers_bytes)}"
    return StartStep(
        "load_weights", held, held - largest, largest, True, "gpu_worker.py: load_model", detail,
        load_allocations(endpoint, model, profiled.buffers_bytes),
    )


def load_allocations(endpoint: Endpoint, model: ModelArch, buffers: int) -> tuple[int, ...]:
    """What ``load_model`` allocates, in order: the vision tower's tensors (``vision_weights``), each weight tensor as
    the model's modules are built (the model's order, ``weight_tensors.model_tensors``; a TP rank's shard of each),
    then the V2 sampler's two state tensors (``v1/worker/gpu/sample/penalties.py``: ``PenaltiesState.__init__``
    makes ``prompt_bin_mask``, then ``output_bin_counts``)."""
    tp = endpoint.inference.tensor_parallel_size
    fp8 = vllm_load_tensors(endpoint, model)  # an FP8 checkpoint: each module's fp8 weight and scales
    weights = tuple(fp8) if fp8 is not None else tuple(t // tp for t in model_tensors(model, budget.dtype_bytes(endpoint)))
    # the vision tower first: Qwen3_5ForConditionalGeneration.__init__ builds self.visual before the language model
    weights = tuple(nbytes for nbytes, _ in vision_tensors(endpoint, model) if nbytes) + weights
    if not buffers:
        return weights
    counts = endpoint.inference.max_num_seqs * model.vocab_size * budget.INT32_BYTES
    return (*weights, buffers - counts, counts)


def lora_slots_step(endpoint: Endpoint, model: ModelArch) -> StartStep | None:
    """``load_lora_model`` at the end of ``load_model`` (``lora/model_manager.py``: ``_create_lora_modules``): the
    punica wrapper's index buffers, then each wrapped module's A and B buffers; None where vLLM serves no LoRA."""
    tensors = tuple(t for t in lora_slot_tensors(endpoint, model) if t)
    if not tensors:
        return None
    parts = lora_slots(endpoint, model)
    inference = endpoint.inference
    detail = (
        f"{inference.max_loras} x rank {endpoint.lora.rank}: linears {format_size(parts.linears)}, embedding and "
        f"LM head {format_size(parts.embeddings)}, punica metadata {format_size(parts.metadata)}"
    )
    largest = max(tensors)
    return StartStep(
        "lora_slots", sum(tensors), sum(tensors) - largest, largest, True, "lora/model_manager.py: "
        "_create_lora_modules", detail, tensors,
    )


def profile_step(endpoint: Endpoint, model: ModelArch) -> StartStep:
    """``profile_run``: for a multimodal checkpoint the vision encoder over the dummy image batch first, its outputs
    kept in the encoder cache; then the larger of the forward and the dummy sampler step; all of it is freed
    (``vllm_budget.profile_activation_bytes``)."""
    forward = budget.forward_peak_bytes(endpoint, model, endpoint.inference.max_num_batched_tokens)
    sampler = budget.profile_sampler_bytes(endpoint, model)
    encoder = budget.encoder_forward_peak_bytes(endpoint, model)
    outputs = budget.encoder_output_bytes(endpoint, model)
    peak = budget.profile_activation_bytes(endpoint, model)
    logits = budget.profile_rows(endpoint) * model.vocab_size * budget.dtype_bytes(endpoint)
    attempt = logits if sampler >= forward else forward
    detail = f"forward {format_size(forward)}, sampler over {budget.profile_rows(endpoint)} rows {format_size(sampler)}"
    if encoder:
        items, per_item = budget.encoder_profile_items(endpoint, model)
        detail = (
            f"vision encoder over {items} x {per_item:,}-token dummy image(s) {format_size(encoder)}, its outputs "
            f"{format_size(outputs)} kept in the encoder cache; {detail}"
        )
        if encoder > outputs + max(forward, sampler):  # at the encoder's peak the last made is linear_fc1's output
            tower = tower_built(endpoint, model)
            assert tower is not None
            patches = items * per_item * tower.spatial_merge_size**2
            tp = endpoint.inference.tensor_parallel_size
            attempt = patches * (tower.intermediate_size // tp) * budget.dtype_bytes(endpoint)
    return StartStep("profile_run", 0, peak - attempt, attempt, True, "gpu_model_runner.py: profile_run", detail)


def kv_step(endpoint: Endpoint, model: ModelArch, kv_bytes: int, num_blocks: int) -> StartStep:
    """``initialize_kv_cache``: the pool's allocations. From vLLM 0.30 one backing tensor of the whole pool
    (``allocate_kv_cache``); before, one tensor per position in a KV cache group, ``page x num_blocks`` each
    (``get_kv_cache_config_from_groups``), the page every layer shares in the worker's layout (``kv_cache.layout``:
    the per-layer cache specs of full, sliding-window, MLA and gated-DeltaNet layers, grouped as vLLM groups them)."""
    if endpoint.vllm.kv_cache_one_allocation or num_blocks == 0:
        largest = kv_bytes
    else:
        largest = num_blocks * layout(endpoint, model).page_bytes
    return StartStep(
        "kv_cache",
        kv_bytes,
        kv_bytes - largest,
        largest,
        True,
        "gpu_worker.py: initialize_from_config",
        f"{num_blocks} blocks",
    )


def graph_step(endpoint: Endpoint, model: ModelArch) -> StartStep | None:
    """``capture_model``: the graphs' pool, in the budget only where the version estimated it."""
    sizes = budget.cudagraph_capture_sizes(endpoint)
    if not sizes:
        return None
    pool = budget.cuda_graph_bytes(endpoint, model)
    inside = budget.graphs_in_budget(endpoint, model)
    detail = f"{len(sizes)} sizes up to {sizes[-1]}"
    return StartStep("cuda_graphs", pool, 0, pool, inside, "gpu_model_runner.py: capture_model", detail)


def warmup_step(endpoint: Endpoint, model: ModelArch, rows: int) -> StartStep | None:
    """The sampler warm-up: its tensors in order; the last is its largest allocation. Nothing is held after it.
    Beyond the profile run's peak it is on top of the budget."""
    if profile_device(endpoint.hardware.profile) != "cuda":
        return None
    tensors = budget.warmup_tensors(endpoint, model, rows)
    total = sum(tensors)
    inside = total <= budget.profile_activation_bytes(endpoint, model)
    v2 = budget.runner(endpoint, model) == "v2"
    source = "warmup.py: warmup_kernels" if v2 else "gpu_model_runner.py: _dummy_sampler_run"
    detail = f"{rows} requests, {' + '.join(format_size(t) for t in tensors)}"
    return StartStep("sampler_warmup", 0, total - tensors[-1], tensors[-1], inside, source, detail, tensors)


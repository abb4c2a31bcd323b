"""Endpoint: the model, the hardware, and the settings of the stack that serves it.

An endpoint describes the implementation, not only the model: memory depends on how the stack runs the model
(recompute, sequence parallel, LoRA targets, a fused LM head, an fp32 upcast of the output, logits re-expanded to the
global width). Every field is a setting a user could change on a SkyRL deployment, or a fact about the hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from skyrl_sim.errors import UserError
from skyrl_sim.schema.hardware import load_profile
from skyrl_sim.schema.inference import Inference
from skyrl_sim.schema.limits import (
    MAX_DEVICE_MEMORY_GIB,
    MAX_DEVICES,
    MAX_ITERATION_SLEEP_S,
    MAX_MICRO_BATCH,
    MAX_MODEL_DIM,
    MAX_MODEL_LAYERS,
    MAX_REQUESTS,
    MAX_TOKENS,
    MIN_ITERATION_SLEEP_S,
)
from skyrl_sim.schema.placement import Placement
from skyrl_sim.schema.skyrl_versions import (
    ASSUMED,
    DEFAULT_VERSION,
    SkyrlRules,
    SkyrlVersion,
    lora_target_modules,
    rules,
)
from skyrl_sim.schema.strict import Strict
from skyrl_sim.schema.tinker_sdk import TINKER_LORA_RANK
from skyrl_sim.schema.vllm_versions import SKYRL_VLLM_PINS, VllmRules, vllm_rules
from skyrl_sim.units import GIB

if TYPE_CHECKING:
    from skyrl_sim.schema.architecture import ModelArch

DEFAULT_PROFILE = "h200"
"""The card an endpoint that names none runs on (a run says so in its notes: ``Endpoint.assumptions``)."""

LoraModule = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj"]


class Hardware(Strict):
    """One accelerator type and how many of them serve the model.

    The card's memory is the profile's (``HardwareProfile.device_memory_gib``, what PyTorch reports on that card) and
    so is the memory outside PyTorch's allocator (``reserve_gib``: the CUDA context and workspaces) unless the endpoint
    gives its own; ``devices`` is what the parallel sizes multiply to unless given. After validation every field
    holds a number; ``model_fields_set`` still says which ones the user wrote (``Endpoint.assumptions``)."""

    profile: str = Field(
        DEFAULT_PROFILE, description="hardware profile: a shipped name (h100, h200, b200, l4, ...) or a profile file"
    )
    device_memory_gib: float | None = Field(
        None,
        gt=0,
        le=MAX_DEVICE_MEMORY_GIB,
        description="memory PyTorch reports per device, GiB; null: the profile's",
    )
    reserve_gib: float | None = Field(
        None,
        ge=0,
        description="memory outside PyTorch's allocator: context, NCCL, workspaces; null: the profile's",
    )
    devices: int | None = Field(
        None, ge=1, le=MAX_DEVICES, description="devices that serve this model; null: tp x pp x cp x dp"
    )

    @model_validator(mode="after")
    def _from_profile(self) -> Hardware:
        """The card's memory and reserve from its profile where the endpoint leaves them out (set without
        re-validation, so ``model_fields_set`` keeps what the user wrote)."""
        if self.device_memory_gib is None or self.reserve_gib is None:
            try:
                card = load_profile(self.profile)
            except UserError as exc:
                raise ValueError(str(exc)) from None
            if self.device_memory_gib is None:
                object.__setattr__(self, "device_memory_gib", card.device_memory_gib)
            if self.reserve_gib is None:
                object.__setattr__(self, "reserve_gib", card.reserve_gib)
        if self.reserve_gib >= self.device_memory_gib:
            raise ValueError(f"reserve_gib {self.reserve_gib} leaves nothing of device_memory_gib {self.device_memory_gib}")
        return self


class Parallelism(Strict):
    tp: int = Field(1, ge=1, le=MAX_DEVICES)
    pp: int = Field(1, ge=1, le=MAX_DEVICES)
    cp: int = Field(1, ge=1, le=MAX_DEVICES)
    dp: int = Field(1, ge=1, le=MAX_DEVICES)
    ep: int = Field(1, ge=1, le=MAX_DEVICES, description="expert parallelism (MoE)")
    sequence_parallel: bool = Field(True, description="Megatron sequence parallel (SkyRL sets it when tp > 1)")


class Lora(Strict):
    rank: int = Field(8, ge=1, le=MAX_MODEL_DIM)
    alpha: float = Field(32, gt=0, le=1e6)
    targets: list[LoraModule] | Literal["all-linear"] = Field(
        "all-linear",
        description="SkyRL's lora.target_modules: all-linear (what the endpoint's skyrl_version expands it to on "
        "Megatron) or the module names",
    )
    dtype: Literal["bf16", "fp16", "fp32"] | None = Field(
        None,
        description="the adapters' parameter dtype; null: trainer.params_dtype (Megatron-Bridge's adapters). fp32 "
        "adapters need no separate fp32 master copy",
    )

    merge_lora: bool = Field(
        True,
        description="SkyRL's megatron lora_config.merge_lora: a weight sync sends merged full weights and vLLM runs "
        "without LoRA; false: only the adapter is exported and vLLM serves it (enable_lora; multi-tenancy)",
    )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Tenancy(Strict):
    """How the service holds many LoRA models on one base (SkyRL's adapter store): each registered model id keeps a
    host slot (its adapter, gradients, fp32 main copy and Adam moments) beside one pristine slot."""

    host_memory_gib: float | None = Field(
        None,
        gt=0,
        le=MAX_DEVICE_MEMORY_GIB,
        description="host memory per worker for adapter slots; a create_model whose slot does not fit fails; "
        "null: unlimited",
    )
    keep_runtime_warm_on_last_unload: bool = Field(
        True,
        description="SkyRL's backend setting: the runtime (workers, base weights) outlives the last unload_model, so "
        "the next create_model only registers an adapter; false: it is torn down and the next create rebuilds it",
    )


class Recompute(Strict):
    granularity: Literal["full", "selective", "none"] = "full"
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = Field(1, ge=1, le=MAX_MODEL_LAYERS)


class Fsdp(Strict):
    """SkyRL's ``trainer.policy.fsdp_config`` (``train/config/config.py``: ``FSDPConfig``), read when
    ``trainer.strategy`` is ``fsdp``. The mixed-precision ``param_dtype`` (the dtype FSDP2 all-gathers and computes
    in) is ``trainer.params_dtype``; the sharded parameters themselves are fp32, the dtype SkyRL loads a training
    model in (``fsdp_worker.py``: ``HFModelWrapper(bf16=inference_only_init)``)."""

    cpu_offload: bool = Field(
        False,
        description="fsdp_config.cpu_offload: FSDP2's CPUOffloadPolicy keeps the sharded parameters, gradients and "
        "optimizer state on the host; the device holds only the units in flight",
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp_config.reshard_after_forward: false keeps every unit unsharded from its forward to "
        "its backward (ZeRO-2-like)"
    )
    reduce_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "fp32", description="fsdp_config.mixed_precision.reduce_dtype: the gradients' reduce-scatter dtype"
    )


BUSIEST_RANK_SHARE = 1.25
"""The default busiest expert-parallel rank's token-expert pairs over its even share: the median over the calls of
what the real backend's routers gave at EP 2 with nothing replayed (``scripts/measure_routing_spread.py`` on
``moe_r3_tiny_ep2``: 1.15, 1.23, 1.26 and 1.58; docs/moe-r3.md). Even routing (1.0) is what no router promises."""
BUSIEST_EXPERT_LOAD = 2.0
"""The default busiest expert's token-expert pairs over the even share (capped at ``experts / top_k``, every token
once): below the real backend's untrained routers (2.0 to 3.2 per call, of at most 4), the level trained routers
without a balancing loss leave (SkyRL's ``moe_router_load_balancing_type`` is ``none``)."""


class MoeRouting(Strict):
    """How a call's tokens spread over the experts, which the memory walk prices on the busiest rank.

    ``even``: every expert its share (the optimistic bound); ``skew``: the busiest expert-parallel rank holds
    ``busiest_rank_share`` times its even share of the token-expert pairs and, on it, the busiest expert
    ``busiest_expert_load`` times an expert's even share; ``recorded``: the spread of the routes the call replays
    (R3), which the scenario's synthetic recorded routes (uniform draws) make even; null (the default): ``recorded``
    when the endpoint replays routes, else ``skew``."""

    spread: Literal["even", "skew", "recorded"] | None = None
    busiest_rank_share: float = Field(BUSIEST_RANK_SHARE, ge=1.0, le=1024.0)
    busiest_expert_load: float = Field(BUSIEST_EXPERT_LOAD, ge=1.0, le=1 << 20)


class CudaAllocConf(Strict):
    """``PYTORCH_CUDA_ALLOC_CONF`` options of the training workers' caching allocator beyond expandable segments
    (``CUDAAllocatorConfig``). They change the classic allocator (``trainer.use_expandable_segments: false``); with
    expandable segments the walk rounds reserved memory to pages and they change nothing it models."""

    max_split_size_mb: int | None = Field(
        None,
        gt=20,
        le=MAX_DEVICE_MEMORY_GIB * 1024,
        description="blocks at least this large are never split and serve only requests at least this large; null: "
        "unlimited (PyTorch's default; it refuses 20 or less)",
    )
    garbage_collection_threshold: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="with a memory fraction (memory_limit_gib), free old whole cached segments before a cudaMalloc once "
        "the reserve passes this share of it; null: off",
    )

    def text(self, expandable_segments: bool) -> str:
        """These options and expandable segments as ``PYTORCH_CUDA_ALLOC_CONF`` writes them (what the real backend's
        workers set after loading the model, as SkyRL's ``Worker._set_expandable_segments`` does)."""
        parts = [f"expandable_segments:{expandable_segments}"]
        if self.max_split_size_mb is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_mb}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        return ",".join(parts)


class Trainer(Strict):
    """SkyRL-Train settings that decide shapes and memory."""

    strategy: str = Field("megatron", description="backend padding rule: megatron, fsdp, jax, or a plugin's")
    micro_train_batch_size_per_gpu: int = Field(1, ge=1, le=MAX_MICRO_BATCH)
    micro_forward_batch_size_per_gpu: int = Field(1, ge=1, le=MAX_MICRO_BATCH)
    remove_microbatch_padding: bool = True
    max_tokens_per_microbatch: int = Field(
        -1, le=MAX_TOKENS * MAX_MICRO_BATCH, description="> 0 packs micro-batches by a token budget"
    )
    recompute: Recompute = Field(default_factory=Recompute)
    language_model_only: bool = Field(False, description="drop the vision tower (native GPTModel path)")
    fused_lm_head_logprob: bool = Field(False, description="log-probs from hidden states, never full logits")
    fp32_output: bool = Field(True, description="Float16Module upcasts the last stage's output to fp32")
    logprobs_chunk_size: int = Field(1024, ge=1, le=MAX_TOKENS)
    logprob_kernel: Literal["chunked_distributed_logprob", "vocab_parallel_cross_entropy"] = Field(
        "chunked_distributed_logprob",
        description="how per-token log-probs are taken from the logits: SkyRL's ChunkedDistributedLogprob after "
        "Float16Module's upcast and recover_left_padding (SkyRL-Train), or the real backend's per-row cast into a "
        "zeroed fp32 tensor and megatron-core's vocab_parallel_cross_entropy on a copy of each chunk",
    )
    fused_lm_head_logprob_backend: Literal["torch", "triton"] = Field(
        "torch",
        description="the fused LM head's kernels (SkyRL 0.4.0): torch (chunked matmuls) or triton (one kernel per "
        "chunk, no fp32 chunk copies beside the logits)",
    )
    vocab_entropy_chunk_memory_mb: int = Field(
        512, ge=1, le=1 << 30, description="RL losses (SkyRL 0.4.0): the entropy metric's chunk budget, MiB"
    )
    vocab_entropy_chunk_size: int | None = Field(
        0, ge=0, le=MAX_TOKENS, description="RL losses: tokens per entropy chunk; 0: from the budget; null: one chunk"
    )
    use_expandable_segments: bool | None = Field(
        None,
        description="SkyRL's trainer.use_expandable_segments: PyTorch's expandable segments on the training workers "
        "(reserved memory grows in pages); false: the classic caching allocator, whose fixed segments fragment as "
        "sizes vary from call to call; null: the SkyRL version's default (true)",
    )
    pytorch_cuda_alloc_conf: CudaAllocConf = Field(
        default_factory=CudaAllocConf, description="PYTORCH_CUDA_ALLOC_CONF options of the training workers"
    )
    empty_cuda_cache: bool | None = Field(
        None,
        description="SkyRL's megatron_config.empty_cuda_cache: torch.cuda.empty_cache() after every forward and "
        "forward_backward that succeeds; null: the SkyRL version's default (true)",
    )
    params_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    optimizer_offload: bool = False
    layer_spec: Literal["transformer_engine", "local"] = Field(
        "transformer_engine",
        description="transformer_engine: fused norm+linear, flash attention; local: megatron-core's local spec "
        "(separate norms, unfused dot-product attention that materialises the scores)",
    )
    attention: Literal["unfused", "flash"] | None = Field(
        None,
        description="the core attention kernel: unfused (the scores and probabilities are materialised) or flash "
        "(fused, nothing quadratic kept); null = what layer_spec builds by default (local: unfused, "
        "transformer_engine: flash). The memory walk and the time model both read it (attention_kernel)",
    )
    bias_activation_fusion: bool = Field(True, description="fused SwiGLU keeps only its input for backward")
    train_base_weights: bool = Field(
        False,
        description="full fine-tuning, SkyRL's trainer.policy.model.lora.rank: 0 (a Tinker create_model without "
        "LoRA): every weight trains (gradients, optimizer state, linears keep their inputs) and the lora block is "
        "not used",
    )
    grad_reduce_in_fp32: bool = Field(
        True,
        description="megatron_config.ddp_config.grad_reduce_in_fp32: megatron-core's gradient buffer is fp32 "
        "(false: params_dtype)",
    )
    offload_after_step: bool = Field(
        True,
        description="trainer.policy.optimizer_config.offload_after_step: colocated runs move the optimizer to the "
        "host around weight syncs; false keeps it on the device while vLLM is awake",
    )
    fsdp: Fsdp = Field(default_factory=Fsdp, description="fsdp_config (trainer.strategy: fsdp)")
    routed_expert_replay: Literal["off", "compact", "int32-all-layers"] = Field(
        "off", description="MoE R3: how replayed expert ids are held per micro-batch"
    )
    moe_routing: MoeRouting = Field(
        default_factory=MoeRouting, description="how tokens spread over the experts (MoE): even, skew or recorded"
    )

    @property
    def routing_spread(self) -> Literal["even", "skew", "recorded"]:
        """The spread the walk prices: ``moe_routing.spread``, else ``recorded`` under replay and ``skew`` without."""
        if self.moe_routing.spread is not None:
            return self.moe_routing.spread
        return "skew" if self.routed_expert_replay == "off" else "recorded"

    @model_validator(mode="before")
    @classmethod
    def _removed_settings(cls, data: Any) -> Any:
        """``expandable_segments`` was accepted and never read; SkyRL's own key is ``use_expandable_segments``, which
        chooses the allocator the walk models. The old key is refused, naming the new one."""
        if isinstance(data, dict) and "expandable_segments" in data:
            raise ValueError(
                "trainer.expandable_segments is not a setting: SkyRL's key is trainer.use_expandable_segments (true: "
                "expandable segments, false: the classic caching allocator)"
            )
        return data

    def expandable_segments(self, rules: SkyrlRules) -> bool:
        """Whether the training workers' allocator uses expandable segments: the setting, else ``rules``' default."""
        if self.use_expandable_segments is None:
            return rules.trainer_expandable_segments
        return self.use_expandable_segments

    @property
    def attention_kernel(self) -> Literal["unfused", "flash"]:
        """The core attention kernel this trainer runs: ``attention`` when set, else the layer spec's own
        (megatron-core's local spec: unfused dot-product attention; TransformerEngine's: flash)."""
        if self.attention is not None:
            return self.attention
        return "unfused" if self.layer_spec == "local" else "flash"

    @field_validator("max_tokens_per_microbatch")
    @classmethod
    def _budget(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be -1 (off) or a positive token budget")
        return value


class Engine(Strict):
    """The Tinker engine's scheduling settings (SkyRL main plus PR #1874's options)."""

    forward_backward_max_request_count: int | None = Field(
        None, le=MAX_REQUESTS, description="cut the forward_backward set into calls of at most N requests; null = unlimited"
    )
    cap_aware_padding: bool = Field(False, description="pad rows to min(batch size, micro) instead of micro")
    sampling: Literal["continuous", "serial", "forwarded"] | None = Field(
        None,
        description="how samples run: serial (one wave per iteration, every future at the wave's end), continuous "
        "(concurrent, drained before blocking work), forwarded (around the engine, straight to vLLM); null: as SkyRL "
        "decides from trainer.strategy and placement.colocate_all (engine.rules.sampling_mode)",
    )
    sample_max_num_sequences: int | None = Field(None, ge=1, le=MAX_REQUESTS)
    iteration_sleep_s: float = Field(0.1, ge=MIN_ITERATION_SLEEP_S, le=MAX_ITERATION_SLEEP_S)
    poll_interval_s: float = Field(
        0.05,
        ge=MIN_ITERATION_SLEEP_S,
        le=MAX_ITERATION_SLEEP_S,
        description="how often a result poller checks the database",
    )

    @field_validator("forward_backward_max_request_count")
    @classmethod
    def _cap(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("must be null (unlimited) or a positive integer; 0 and negatives are rejected")
        return value


class Admission(Strict):
    """What the service refuses at submission, before a request reaches the queue. SkyRL's Tinker API refuses
    nothing by length; Thinking Machines' hosted Tinker refuses a datum longer than the model's maximum context
    length with HTTP 400 (the SDK's ``GetServerCapabilitiesResponse`` reports it per model)."""

    max_context_length: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="tokens a datum (or a sample's prompt plus generation) may have; null: none"
    )


class Endpoint(Strict):
    """A model served by a stack on hardware."""

    name: str = "unnamed"
    description: str = ""
    skyrl_version: SkyrlVersion = Field(
        DEFAULT_VERSION,
        description="the SkyRL revision whose rules the endpoint runs: 0.4.0 (the newest release) or pr1874 (the base "
        "of PR #1874 with its two engine settings, never released); see docs/skyrl-versions.md",
    )
    model: str | dict[str, Any] = Field(..., description="preset name, {config: path}, or {preset: name, ...}")
    hardware: Hardware = Field(default_factory=Hardware)
    parallelism: Parallelism = Field(default_factory=Parallelism)
    lora: Lora = Field(default_factory=Lora)
    trainer: Trainer = Field(default_factory=Trainer)
    engine: Engine = Field(default_factory=Engine)
    admission: Admission = Field(default_factory=Admission)
    tenancy: Tenancy = Field(default_factory=Tenancy)
    inference: Inference = Field(default_factory=Inference)
    placement: Placement = Field(default_factory=Placement)
    memory_limit_gib: float | None = Field(
        None,
        gt=0,
        le=MAX_DEVICE_MEMORY_GIB,
        description=(
            "cap the memory a rank may use below the device's: the walk's capacity, and on the real backend the CPU "
            "tensor limit or the CUDA memory fraction"
        ),
    )
    service_log: str | None = Field(None, description="tinker backend: path of the service's log to parse calls from")
    base_url: str | None = Field(None, description="tinker backend: the service's URL")

    @model_validator(mode="after")
    def _world(self) -> Endpoint:
        p = self.parallelism
        world = p.tp * p.pp * p.cp * p.dp
        if self.hardware.devices is None:  # what the parallel sizes say (set without re-validation, as the memory is)
            object.__setattr__(self.hardware, "devices", world)
        if world != self.hardware.devices:
            sizes = f"parallelism.tp {p.tp} × parallelism.pp {p.pp} × parallelism.cp {p.cp} × parallelism.dp {p.dp}"
            raise ValueError(f"{sizes} = {world} devices, but hardware.devices is {self.hardware.devices}")
        if self.memory_limit_gib is not None and self.memory_limit_gib <= self.hardware.reserve_gib:
            raise ValueError(
                f"memory_limit_gib {self.memory_limit_gib} leaves nothing above "
                f"hardware.reserve_gib {self.hardware.reserve_gib}"
            )
        self._version_settings()
        self._lora_serving()
        self._inference_devices()
        if self.trainer.use_expandable_segments is False and p.pp > 1:
            raise ValueError(
                "trainer.use_expandable_segments false with parallelism.pp > 1: the classic allocator is replayed on "
                "whole-model ranks; pipeline stages are not replayed"
            )
        self._kv_offload()
        self._eager_with_lora_sync()
        self._language_model_only()
        return self

    @property
    def vllm_language_model_only(self) -> bool:
        """Whether vLLM runs the language model only: ``inference.language_model_only``, else the trainer's."""
        own = self.inference.language_model_only
        return self.trainer.language_model_only if own is None else own

    def _language_model_only(self) -> None:
        """SkyRL 0.4.0's ``validate_cfg`` (``skyrl/train/utils/utils.py``) asserts that a language-model-only policy
        has a language-model-only inference engine."""
        if self.trainer.language_model_only and self.inference.language_model_only is False:
            raise ValueError(
                "inference.language_model_only false with trainer.language_model_only true: SkyRL requires the "
                "inference engine to be language-model-only when the policy is (validate_cfg)"
            )

    @property
    def runs_vllm(self) -> bool:
        """Whether the endpoint's stack starts vLLM engines: SkyRL-Train's backends (FSDP, Megatron) do."""
        return self.trainer.strategy in ("fsdp", "megatron")

    @property
    def vllm_devices(self) -> int:
        """The devices vLLM adds to the trainer's: none when they share the trainer's (``placement.colocate_all``),
        ``num_engines x tensor_parallel_size`` when the engines run on devices of their own."""
        if not self.runs_vllm or self.placement.colocate_all:
            return 0
        return self.inference.devices

    def _inference_devices(self) -> None:
        """vLLM's devices against the placement. Colocated, the engines run on the trainer's devices, one engine
        shard per device: SkyRL asserts ``num_policy_gpus == num_rollout_gpus`` when it builds the policy
        (``skyrl/backends/skyrl_train_backend.py``: ``_build_policy``; ``skyrl/train/utils/utils.py``:
        ``validate_cfg``), so a count stated in the endpoint that differs is refused (left at SkyRL's defaults, one
        engine of TP 1, it is not a statement about the deployment and the simulator follows the busiest device).
        On devices of their own, they are added to the trainer's, within ``MAX_DEVICES``."""
        if not self.runs_vllm:
            return
        inference, devices = self.inference, self.hardware.devices
        if self.placement.colocate_all:
            stated = {"num_engines", "tensor_parallel_size"} & inference.model_fields_set
            if stated and inference.devices != devices:
                raise ValueError(
                    f"inference.num_engines x tensor_parallel_size = {inference.num_engines} x "
                    f"{inference.tensor_parallel_size} = {inference.devices} devices, but placement.colocate_all puts "
                    f"vLLM on the trainer's hardware.devices = {devices}: SkyRL refuses this (num_policy_gpus must "
                    "equal num_rollout_gpus when colocating all models); give as many engine shards as devices, or "
                    "placement.colocate_all: false for engines on devices of their own"
                )
        elif devices + inference.devices > MAX_DEVICES:
            raise ValueError(
                f"hardware.devices {devices} + vLLM's {inference.devices} devices of its own (placement.colocate_all "
                f"false) = {devices + inference.devices}, over the limit of {MAX_DEVICES:,}"
            )

    def placement_line(self) -> str | None:
        """The devices the endpoint takes when vLLM has its own (None when it shares the trainer's, or there is
        none): what a run on it needs beyond ``hardware.devices``."""
        extra = self.vllm_devices
        if not extra:
            return None
        inference = self.inference
        return (
            f"devices: {self.hardware.devices} for the trainer + {extra} for vLLM ({inference.num_engines} engine(s) x "
            f"tensor_parallel_size {inference.tensor_parallel_size}, placement.colocate_all false) = "
            f"{self.hardware.devices + extra}"
        )

    def _kv_offload(self) -> None:
        """``offload_kv_for_weight_sync`` as SkyRL checks it (``train/utils/utils.py: validate_cfg``): a setting
        from PR #1934 on, for engines on their own devices and full-weight training only."""
        if not self.inference.offload_kv_for_weight_sync:
            return
        if not self.rules.offload_kv_for_weight_sync:
            raise ValueError(
                f"inference.offload_kv_for_weight_sync is not a setting of SkyRL {self.skyrl_version} (PR #1934)"
            )
        if self.placement.colocate_all:
            raise ValueError(
                "inference.offload_kv_for_weight_sync is for non-colocated weight sync only; colocated mode already "
                "sleeps the engines and wakes weights/KV cache around sync (placement.colocate_all is true)"
            )
        if not self.trainer.train_base_weights:
            raise ValueError(
                "inference.offload_kv_for_weight_sync does not support LoRA weight sync (SkyRL requires lora rank 0: "
                "set trainer.train_base_weights true)"
            )

    def _lora_serving(self) -> None:
        """SkyRL derives vLLM's ``enable_lora`` from the weight-sync mode (``inference_servers/utils.py``:
        ``_uses_lora_weight_sync``, then ``args.enable_lora``): true exactly when the trainer syncs LoRA adapters
        (FSDP with LoRA, Megatron with ``merge_lora: false``), false for merged weights and full fine-tuning. An
        endpoint that leaves it out gets that value (set without re-validation, as ``hardware.devices`` is); one that
        states the other value describes a vLLM SkyRL never starts, and is refused."""
        if not self.runs_vllm:
            return
        derived = self.adapter_weight_sync
        if "enable_lora" not in self.inference.model_fields_set:
            object.__setattr__(self.inference, "enable_lora", derived)
            return
        if self.inference.enable_lora == derived:
            return
        if self.inference.enable_lora and self.trainer.train_base_weights:
            raise ValueError(
                "inference.enable_lora true with trainer.train_base_weights true: full fine-tuning syncs merged weights "
                "and SkyRL starts vLLM without LoRA (lora rank 0: _uses_lora_weight_sync)"
            )
        if self.inference.enable_lora:
            raise ValueError(
                "inference.enable_lora true needs lora.merge_lora false on megatron: SkyRL serves LoRA adapters from "
                "vLLM only when the trainer syncs adapters, not merged weights (_uses_lora_weight_sync)"
            )
        raise ValueError(
            f"inference.enable_lora false, but the trainer syncs LoRA adapters ({self.trainer.strategy}"
            + (" with lora.merge_lora false" if self.trainer.strategy == "megatron" else " with LoRA")
            + "): SkyRL then always starts vLLM with LoRA (inference_servers/utils.py: _uses_lora_weight_sync); "
            "leave inference.enable_lora out or set it true"
        )

    def _eager_with_lora_sync(self) -> None:
        """SkyRL turns ``enforce_eager`` back off, with a warning, when the trainer syncs LoRA adapters
        (``train/config/config.py``: ``SkyRLTrainConfig.__post_init__``, ``_uses_lora_weight_sync``; SkyRL PR #665,
        in both modelled revisions): an endpoint asking for it would be simulated as a deployment SkyRL never runs."""
        if self.inference.enforce_eager and self.adapter_weight_sync:
            raise ValueError(
                "inference.enforce_eager true is turned back off by SkyRL when the trainer syncs LoRA adapters (LoRA on "
                "FSDP, or on Megatron with lora.merge_lora false; SkyRL PR #665: eager LoRA generation is 2-3x slower), "
                "so vLLM runs with CUDA graphs: set it false"
            )

    def vllm_max_model_len(self, model: ModelArch) -> int | None:
        """The longest sequence a vLLM engine admits: ``inference.max_model_len``, else the model's context length
        when its description has one (``max_position_embeddings``, vLLM's default); None when neither is known."""
        if self.inference.max_model_len is not None:
            return self.inference.max_model_len
        value = model.extra.get("max_position_embeddings")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def adapter_weight_sync(self) -> bool:
        """SkyRL's ``_uses_lora_weight_sync``: LoRA adapters train (lora rank > 0) and weight syncs send them rather
        than merged weights."""
        return self.lora_weight_sync and not self.trainer.train_base_weights

    @property
    def lora_weight_sync(self) -> bool:
        """Whether weight syncs send the LoRA adapter rather than merged full weights (SkyRL's
        ``_uses_lora_weight_sync``: LoRA on FSDP, or on Megatron with ``merge_lora: false``)."""
        if self.trainer.strategy == "megatron":
            return not self.lora.merge_lora
        return True

    def _version_settings(self) -> None:
        """A setting the endpoint's SkyRL revision does not have is refused when it is given another value than the
        revision's behaviour (the PR #1874 settings excepted: they are a labelled what-if on every version). The
        defaults are what the older revision does, so a dumped and re-read endpoint stays valid."""
        version = self.rules
        t = self.trainer
        fields = Trainer.model_fields
        if not version.fused_lm_head_backends and t.fused_lm_head_logprob_backend != "torch":
            raise ValueError(
                f"trainer.fused_lm_head_logprob_backend is not a setting of SkyRL {self.skyrl_version} (first in 0.4.0)"
            )
        if version.entropy == "unchunked":
            for key in ("vocab_entropy_chunk_memory_mb", "vocab_entropy_chunk_size"):
                if getattr(t, key) != fields[key].default:
                    raise ValueError(
                        f"trainer.{key} is not a setting of SkyRL {self.skyrl_version}: its entropy is never chunked"
                    )

    @property
    def assumptions(self) -> list[str]:
        """What the endpoint does not say and skyrl-sim assumes in its place, one line each (a run's notes, printed
        by ``run`` and ``check``). Settings whose default is SkyRL's own default are not assumptions."""
        lines = []
        if "skyrl_version" not in self.model_fields_set:
            lines.append(f"{ASSUMED} skyrl_version {self.skyrl_version} (the endpoint names no SkyRL version)")
        if "profile" not in self.hardware.model_fields_set:
            lines.append(
                f"{ASSUMED} hardware.profile {self.hardware.profile}, {self.hardware.device_memory_gib:g} GiB per device "
                "(the endpoint names no card)"
            )
        if "strategy" not in self.trainer.model_fields_set:
            lines.append(
                f"{ASSUMED} trainer.strategy {self.trainer.strategy} (the endpoint names none; SkyRL-Train's own "
                "default is fsdp)"
            )
        if "rank" not in self.lora.model_fields_set and not self.trainer.train_base_weights:  # full FT: no adapter
            lines.append(
                f"{ASSUMED} lora.rank {self.lora.rank} (the endpoint names none; a Tinker client asks for "
                f"{TINKER_LORA_RANK} unless told)"
            )
        return lines

    @property
    def rules(self) -> SkyrlRules:
        """The rules of the endpoint's SkyRL revision (``skyrl_versions.VERSIONS``)."""
        return rules(self.skyrl_version)

    @property
    def full_fine_tune(self) -> bool:
        """Whether every weight trains (``trainer.train_base_weights``, SkyRL's ``lora.rank: 0``) rather than LoRA
        adapters on frozen weights."""
        return self.trainer.train_base_weights

    @property
    def vllm(self) -> VllmRules:
        """The start-up rules of the endpoint's vLLM: ``inference.vllm_version``, else the one its SkyRL pins."""
        return vllm_rules(self.inference.vllm_version or SKYRL_VLLM_PINS[self.skyrl_version])

    def adapted_targets(self, model: ModelArch | None = None) -> frozenset[str]:
        """The modules LoRA wraps: ``lora.targets`` as the endpoint's SkyRL expands it (``all-linear``), with the
        gated-DeltaNet ``in_proj`` dropped where the version checks the model's checkpoint layout and it is fused.
        Empty without LoRA targets, and with full fine-tuning (no adapters at all)."""
        if self.full_fine_tune:
            return frozenset()
        fused = bool(model is not None and model.linear_attention and model.linear_attention.fused_in_proj_checkpoint)
        return lora_target_modules(self.lora.targets, self.rules, fused)

    @property
    def capacity_bytes(self) -> int:
        """Memory PyTorch's allocator may use per device."""
        gib = self.memory_limit_gib if self.memory_limit_gib is not None else self.hardware.device_memory_gib
        return int((gib - self.hardware.reserve_gib) * GIB)

    def micro_batch_size(self, kind: str) -> int:
        """Megatron micro size for a pass: train micro for forward_backward, forward micro for forward."""
        if kind == "forward":
            return self.trainer.micro_forward_batch_size_per_gpu
        return self.trainer.micro_train_batch_size_per_gpu

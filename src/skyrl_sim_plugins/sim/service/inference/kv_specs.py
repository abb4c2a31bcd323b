"""What each layer of a model keeps in vLLM's KV cache, and how vLLM groups the layers into one block pool.

vLLM asks every attention layer for its ``KVCacheSpec`` (``vllm/v1/kv_cache_interface.py``) and packs the layers into
KV cache groups that share one pool of blocks (``vllm/v1/core/kv_cache_utils.py``: ``get_kv_cache_groups``). This
module is that, per engine worker (one tensor-parallel rank), for the layer kinds the simulator models:

* **Full attention** (``FullAttentionSpec``, from ``Attention.get_kv_cache_spec`` in
  ``model_executor/layers/attention/attention.py``): K and V of ``max(1, kv_heads // tp)`` heads, ``head_dim`` wide,
  per token: a page of ``block_size x heads x 2 x head_dim x dtype`` bytes. A request holds ``ceil(tokens /
  block_size)`` blocks.
* **Multi-latent attention** (``MLAAttentionSpec``, from ``MLAAttention.get_kv_cache_spec`` in
  ``model_executor/layers/attention/mla_attention.py``): one latent vector per token, ``kv_lora_rank +
  qk_rope_head_dim`` wide (``ModelConfig.get_head_size`` for a DeepSeek-style MLA model), one "head"
  (``num_kv_heads=1``), no separate V (``head_size_v=0``), and ``max_tp_shards=1``: every TP rank holds the whole
  latent. A page is ``block_size x (kv_lora_rank + qk_rope_head_dim) x dtype`` bytes.
* **Sliding-window attention** (``SlidingWindowSpec``): the full-attention page, but a request keeps only the blocks
  of its last ``sliding_window - 1`` tokens plus the tokens in flight and one more block
  (``SlidingWindowSpec.max_admission_blocks_per_request``); older blocks go back to the pool
  (``SlidingWindowManager.remove_skipped_blocks``). The trainer-side block size is the primary one (vLLM keeps it when
  the backend can run it unsplit: ``_largest_kernel_block_within``).

**Groups** (``_get_kv_cache_groups_uniform_page_size``; a model whose layers share one spec is one group,
``_get_kv_cache_groups_uniform_spec``): layers with equal specs form a bucket; every bucket is cut into groups of
``group_size`` layers, the smallest bucket's size (or the largest's when it is under 1.5 times the smallest),
``layers[i::n]`` to group ``i``. Every group shares the pool's ``num_blocks`` blocks, and a block is as many bytes
as the largest group's pages together (``_get_kv_cache_bytes_per_block``), so a request takes one block per group per
``block_size`` tokens (fewer in a window group once its window is full).

Not modelled here: gated-DeltaNet (Mamba-style) state specs, which a hybrid's groups add with the same interface
(``LayerCacheSpec``); block-outermost packed layouts (``_get_packed_kv_cache_groups``: only with mixed page sizes,
which no modelled family has); quantized KV caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from skyrl_sim.api import ModelArch

SpecKind = Literal["full_attention", "mla_attention", "sliding_window"]
"""vLLM's ``KVCacheSpecKind`` values of the modelled specs."""


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's KV cache spec on one worker: what vLLM's ``KVCacheSpec`` says about memory."""

    kind: SpecKind
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    sliding_window: int = 0

    @property
    def page_size_bytes(self) -> int:
        """One block of this layer (``AttentionSpec.page_size_bytes``: heads x tokens x (K + V widths) x dtype)."""
        return self.num_kv_heads * self.block_size * (self.head_size + self.head_size_v) * self.dtype_bytes

    def blocks_held(self, tokens: int, in_flight: int = 0) -> int:
        """Blocks a request of ``tokens`` computed tokens holds in this layer's group; a window layer holds at most its
        window's (``SlidingWindowSpec.max_admission_blocks_per_request``: ``cdiv(window - 1 + in_flight,
        block_size) + 1``), never more than a full layer's."""
        full = -(-tokens // self.block_size)
        if self.kind != "sliding_window":
            return full
        return min(full, -(-(self.sliding_window - 1 + in_flight) // self.block_size) + 1)


@dataclass(frozen=True)
class CacheGroup:
    """A KV cache group: one spec, the layers that share its block table."""

    spec: LayerCacheSpec
    layers: tuple[int, ...]

    @property
    def page_bytes(self) -> int:
        """Bytes one block of the pool holds for this group: its layers' pages together."""
        return len(self.layers) * self.spec.page_size_bytes


def layer_spec(model: ModelArch, index: int, block_size: int, tp: int, dtype_bytes: int) -> LayerCacheSpec | None:
    """The KV cache spec of ``model``'s layer ``index`` on a worker of ``tp`` ranks; None for a layer that keeps no
    attention KV (gated DeltaNet: its state is another spec kind)."""
    kind = model.layer_types[index]
    if kind == "linear_attention":
        return None
    if model.mla is not None:
        latent = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim
        return LayerCacheSpec("mla_attention", block_size, 1, latent, 0, dtype_bytes)
    heads = max(1, model.num_kv_heads // tp)
    if kind == "sliding_attention":
        return LayerCacheSpec(
            "sliding_window", block_size, heads, model.head_dim, model.head_dim, dtype_bytes, model.sliding_window
        )
    return LayerCacheSpec("full_attention", block_size, heads, model.head_dim, model.head_dim, dtype_bytes)


def kv_cache_groups(model: ModelArch, block_size: int, tp: int, dtype_bytes: int) -> list[CacheGroup]:
    """vLLM's KV cache groups of ``model`` on one worker (``get_kv_cache_groups``, the uniform-page-size path)."""
    buckets: dict[LayerCacheSpec, list[int]] = {}
    for index in range(model.num_layers):
        spec = layer_spec(model, index, block_size, tp, dtype_bytes)
        if spec is not None:
            buckets.setdefault(spec, []).append(index)
    if len(buckets) <= 1:
        return [CacheGroup(spec, tuple(layers)) for spec, layers in buckets.items()]
    sizes = [len(layers) for layers in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for spec, layers in buckets.items():
        count = -(-len(layers) // group_size)
        groups += [CacheGroup(spec, tuple(layers[i::count])) for i in range(count)]
    return groups


def bytes_per_block(groups: Sequence[CacheGroup]) -> int:
    """One pool block's bytes: the largest group's pages together (``_get_kv_cache_bytes_per_block``)."""
    return max((group.page_bytes for group in groups), default=0)


def blocks_held(groups: Sequence[CacheGroup], tokens: int, in_flight: int = 0) -> int:
    """Pool blocks a request of ``tokens`` computed tokens holds: one per group per block of tokens, a window group's
    capped at its window."""
    return sum(group.spec.blocks_held(tokens, in_flight) for group in groups)

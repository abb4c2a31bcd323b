"""What one vLLM worker's KV cache holds per layer, and how vLLM lays the layers out in one block pool.

vLLM describes each layer's cache with a ``KVCacheSpec`` (``vllm/v1/kv_cache_interface.py``) and shares one pool of
equal-sized blocks between every layer (``vllm/v1/core/kv_cache_utils.py``). This module follows both for the
simulator, one kind per vLLM spec:

- ``full_attention`` (``FullAttentionSpec``): K and V of ``block_size`` tokens per block: a page of ``block_size x
  kv_heads x (head_size + head_size_v) x dtype`` bytes (``AttentionSpec.page_size_bytes``); a sequence of ``T``
  tokens holds ``ceil(T / block_size)`` blocks.
- ``sliding_window`` (``SlidingWindowSpec``): the same page; a sequence holds the blocks of its window only.
- ``mla`` (``MLAAttentionSpec``): one latent vector of ``head_size`` (``kv_lora_rank + qk_rope_head_dim``) per token,
  one head, no separate V.
- ``mamba`` (``MambaSpec``): a fixed state per sequence (for gated DeltaNet: the short convolution's last
  ``kernel - 1`` inputs and the ``[heads, v_dim, k_dim]`` recurrent state), whatever its length: the page is the
  state's bytes (``MambaSpec.page_size_bytes``), padded to the attention page (below); a sequence holds one block
  per mamba group (``MambaManager``; with prefix caching, ``mamba_cache_mode`` ``align``, it briefly holds a second
  one when its state crosses a block boundary).

**Hybrid models** (attention and mamba layers; ``Platform._align_hybrid_block_size``, ``vllm/platforms/
interface.py``): the attention block size grows until one attention page is at least the mamba page: ``block_size
= alignment x ceil(mamba_page / (alignment x attention_page_per_token))`` with ``alignment = max(the attention
backend's smallest kernel block, the configured block size)``, rounded up to every backend's smallest kernel block;
the mamba page is then padded to exactly the attention page (``mamba_page_size_padded``), so every layer's page is
the same size. **Groups** (``_get_kv_cache_groups_uniform_page_size``): layers of one spec form a bucket; every
group has ``group_size`` layers (the smallest bucket's count, or the largest's when it is under 1.5 times the
smallest), a bucket of ``n`` layers makes ``ceil(n / group_size)`` groups (the last one padded). A block is one
page for each of ``group_size`` layers (``_get_kv_cache_bytes_per_block``), and each block in use belongs to one
group: the pool has ``kv_bytes // (group_size x page)`` blocks (``get_kv_cache_config_from_groups``).

The dtypes of a gated-DeltaNet state (``MambaStateDtypeCalculator.gated_delta_net_state_dtype``): the convolution
state in the KV cache dtype (the model's), the recurrent state in ``mamba_ssm_cache_dtype``, or the model's when that
is ``auto``; Qwen3.5/3.6 checkpoints set it from their config's ``mamba_ssm_dtype``
(``Qwen3_5ForConditionalGenerationConfig.verify_and_update_config``, ``vllm/model_executor/models/config.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

CacheKind = Literal["full_attention", "sliding_window", "mla", "mamba"]
ATTENTION_KINDS: frozenset[str] = frozenset({"full_attention", "sliding_window", "mla"})

GROUP_SIZE_SLACK = 1.5
"""vLLM takes the largest bucket's layer count as the group size when it is under 1.5 times the smallest's
(``_get_kv_cache_groups_uniform_page_size``: fewer padding layers); otherwise the smallest's."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's cache on one worker, as vLLM's ``KVCacheSpec`` of that kind describes it.

    Attention kinds: ``token_bytes`` is what one token takes in the layer (K and V of its heads, or MLA's latent);
    ``sliding_window`` the window of a ``sliding_window`` layer. ``mamba``: ``state_bytes`` is one sequence's state.
    """

    kind: CacheKind
    token_bytes: int = 0
    state_bytes: int = 0
    sliding_window: int | None = None

    def page_bytes(self, block_size: int) -> int:
        """The unpadded page: ``block_size`` tokens of an attention layer, one state of a mamba layer."""
        return self.state_bytes if self.kind == "mamba" else block_size * self.token_bytes

    def blocks_for(self, tokens: int, block_size: int) -> int:
        """Blocks a sequence of ``tokens`` computed tokens holds in one group of this kind (steady state)."""
        if self.kind == "mamba":
            return 1
        if self.kind == "sliding_window" and self.sliding_window is not None:
            # SlidingWindowManager frees blocks that left the window; the window may straddle one block more
            return min(cdiv(tokens, block_size), cdiv(self.sliding_window - 1, block_size) + 1)
        return cdiv(tokens, block_size)


def attention_spec(num_kv_heads: int, head_size: int, dtype_bytes: int, head_size_v: int | None = None) -> LayerCacheSpec:
    """``FullAttentionSpec``: K and V of ``num_kv_heads`` heads per token."""
    v = head_size if head_size_v is None else head_size_v
    return LayerCacheSpec("full_attention", token_bytes=num_kv_heads * (head_size + v) * dtype_bytes)


def sliding_window_spec(num_kv_heads: int, head_size: int, dtype_bytes: int, window: int) -> LayerCacheSpec:
    """``SlidingWindowSpec``: the full-attention page; only the window's blocks are held."""
    page = attention_spec(num_kv_heads, head_size, dtype_bytes)
    return LayerCacheSpec("sliding_window", token_bytes=page.token_bytes, sliding_window=window)


def mla_spec(latent_size: int, dtype_bytes: int) -> LayerCacheSpec:
    """``MLAAttentionSpec``: one ``kv_lora_rank + qk_rope_head_dim`` latent per token, one head, no V."""
    return LayerCacheSpec("mla", token_bytes=latent_size * dtype_bytes)


def mamba_spec(shapes: Sequence[Sequence[int]], dtype_bytes: Sequence[int]) -> LayerCacheSpec:
    """``MambaSpec``: the sum of its state tensors' bytes (``MambaSpec.page_size_bytes`` unpadded)."""
    return LayerCacheSpec("mamba", state_bytes=sum(math.prod(s) * b for s, b in zip(shapes, dtype_bytes, strict=True)))


def gated_deltanet_state_shapes(
    tp: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int, num_spec: int = 0
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One gated-DeltaNet layer's per-sequence state on one of ``tp`` workers
    (``MambaStateShapeCalculator.gated_delta_net_state_shape``, ``vllm/model_executor/layers/mamba/mamba_utils.py``):
    the convolution state ``[kernel - 1 + num_spec, conv_dim / tp]`` (q, k and v channels; vLLM orients it
    channels-last, the same bytes) and the recurrent state ``[v_heads / tp, v_dim, k_dim]``."""
    conv_dim = head_k_dim * num_k_heads * 2 + head_v_dim * num_v_heads
    if conv_dim % tp or num_v_heads % tp:
        raise ValueError(f"tensor parallel {tp} does not divide the gated-DeltaNet widths (vLLM's divide() refuses it)")
    return (conv_kernel - 1 + num_spec, conv_dim // tp), (num_v_heads // tp, head_v_dim, head_k_dim)


def align_hybrid_block_size(
    block_size: int, attention_token_bytes: int, mamba_page_bytes: int, kernel_block: int, backend_alignment: int
) -> tuple[int, int]:
    """vLLM's block size and shared page for a hybrid model (``Platform._align_hybrid_block_size``): the smallest
    multiple of ``max(kernel_block, block_size)`` (then of ``backend_alignment``, every backend's smallest kernel
    block) whose attention page holds the mamba page; a configured block size above it is kept. Returns the block
    size and the page every layer then has (the mamba page padded to it)."""
    alignment = max(kernel_block, block_size)
    aligned = alignment * cdiv(mamba_page_bytes, alignment * attention_token_bytes)
    aligned = backend_alignment * cdiv(aligned, backend_alignment)
    size = max(block_size, aligned)
    return size, size * attention_token_bytes


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group: ``layers`` layers of one spec (up to the group size; vLLM pads the rest)."""

    spec: LayerCacheSpec
    layers: int


@dataclass(frozen=True)
class CacheLayout:
    """One worker's cache layout: the block size, the page every layer has, the groups sharing the pool."""

    block_size: int
    page_bytes: int
    group_size: int
    groups: tuple[CacheGroup, ...]
    mamba_page_unpadded: int = 0

    @property
    def bytes_per_block(self) -> int:
        """One block: a page for each of ``group_size`` layers (``_get_kv_cache_bytes_per_block``)."""
        return self.group_size * self.page_bytes

    @property
    def has_mamba(self) -> bool:
        return any(g.spec.kind == "mamba" for g in self.groups)

    @property
    def mamba_groups(self) -> int:
        return sum(g.spec.kind == "mamba" for g in self.groups)

    @property
    def state_blocks_per_sequence(self) -> int:
        """Blocks a running sequence holds whatever its length: one per mamba group."""
        return self.mamba_groups

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` computed tokens holds over every group."""
        return sum(g.spec.blocks_for(tokens, self.block_size) for g in self.groups)

    def token_blocks_for(self, tokens: int) -> int:
        """The blocks of the attention groups only (what grows with the sequence)."""
        return sum(g.spec.blocks_for(tokens, self.block_size) for g in self.groups if g.spec.kind != "mamba")

    def num_blocks(self, kv_bytes: int) -> int:
        """The pool's blocks for ``kv_bytes`` (``get_kv_cache_config_from_groups``)."""
        return kv_bytes // self.bytes_per_block if kv_bytes > 0 else 0


def group_layers(specs: Sequence[LayerCacheSpec]) -> tuple[int, tuple[CacheGroup, ...]]:
    """vLLM's grouping of layers with one page size (``_get_kv_cache_groups_uniform_page_size``): the group size and
    the groups, in the order each spec first appears. One spec: one group of every layer
    (``_get_kv_cache_groups_uniform_spec``)."""
    buckets: dict[LayerCacheSpec, int] = {}
    for spec in specs:
        buckets[spec] = buckets.get(spec, 0) + 1
    if not buckets:
        return 0, ()
    if len(buckets) == 1:
        spec, count = next(iter(buckets.items()))
        return count, (CacheGroup(spec, count),)
    smallest, largest = min(buckets.values()), max(buckets.values())
    size = largest if largest < smallest * GROUP_SIZE_SLACK else smallest
    groups: list[CacheGroup] = []
    for spec, count in buckets.items():
        n = cdiv(count, size)
        # layers[i::n]: group i gets every n-th layer of the bucket
        groups += [CacheGroup(spec, len(range(i, count, n))) for i in range(n)]
    return size, tuple(groups)


def cache_layout(
    specs: Sequence[LayerCacheSpec], block_size: int, kernel_block: int, backend_alignment: int
) -> CacheLayout:
    """The layout of a worker whose layers have ``specs`` (one per layer), for a configured ``block_size``.

    Attention layers only: every page is ``block_size`` tokens (the spec kinds' pages must then agree, as vLLM's
    uniform-page grouping needs). With mamba layers: the hybrid alignment above. Mixed attention token sizes (a
    model whose attention layers differ) are refused, as this layout does not model vLLM's page unification for
    them."""
    attention = {s.token_bytes for s in specs if s.kind in ATTENTION_KINDS}
    mamba = {s.state_bytes for s in specs if s.kind == "mamba"}
    if len(attention) > 1 or len(mamba) > 1:
        raise ValueError("layers of one kind with different page sizes are not modelled")
    size, page, unpadded = block_size, 0, 0
    if attention and mamba:
        unpadded = mamba.pop()
        size, page = align_hybrid_block_size(block_size, next(iter(attention)), unpadded, kernel_block, backend_alignment)
    elif attention:
        page = block_size * next(iter(attention))
    elif mamba:
        unpadded = page = mamba.pop()
    group_size, groups = group_layers(specs)
    return CacheLayout(size, page, group_size, groups, unpadded)

"""A rank's allocation sequence replayed through PyTorch's classic caching allocator, call after call.

The walk (``memory_walk``) decides whether a call's live tensors fit, with reserved memory rounded as expandable
segments round it. Without expandable segments what is reserved also depends on the order and sizes of every
allocation since the process started: ``RankAllocator`` keeps one rank's ``caching_allocator.CachingAllocator``
from call to call, replays each call's micro-batches step by step (the same segments, in the same order, as the walk
applies them), and reports what PyTorch would: the reserve at the call's peak and after it, the part of it that is
reserved but unallocated, and an out-of-memory error where no cached block and no free device memory fits a request,
even when the walk's live bytes fit: fragmentation.

What a step frees is matched to what was allocated: by the step's tensor key (the latest live allocation of that key),
else by size (the latest live allocation of that size), as the walk's segments free across segment boundaries under
other names. The static memory (weights, the adapters' state) is allocated once, when the rank's allocator is made,
as one block each (parameters are allocated once and never freed, so their segments never hold a free block). After
a call that returns, SkyRL's ``empty_cuda_cache`` empties the cache when the endpoint says so; a call that raised
frees the tensors it still held (they die with the exception) and empties nothing. Allocations still live when a call
ends are megatron's persistent buffers, which stay for the next call; any other tensor of the call still live then (a
free of the walk that matched no live allocation by key or size, counted) is freed before the cache is emptied, as
the walk's own state carries nothing else between calls. A colocated trainer's static memory leaves the device
and comes back around vLLM's turns (``offload``, ``backload``): the reload needs one contiguous block per part, which
fragmented free memory may not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from skyrl_sim_plugins.sim.reference.allocator import CATEGORY_INDEX, Step
from skyrl_sim_plugins.sim.reference.caching_allocator import (
    AllocatorSettings,
    Block,
    CachingAllocator,
    CachingAllocatorOutOfMemory,
    OutOfMemory,
)

PERSISTENT = CATEGORY_INDEX["persistent_buffers"]
STATIC = "static:"  # the key prefix of a rank's static memory (weights, adapter state)


@dataclass(frozen=True)
class ReplayStep:
    """One step of a call in walk order: where it is (micro-batch, phase, layer) and the step itself."""

    microbatch: int
    phase: str
    layer: Any
    step: Step


@dataclass(frozen=True)
class ReplayFailure:
    """The request the classic allocator could not serve, where it is, and PyTorch's numbers at that moment."""

    at: ReplayStep
    oom: OutOfMemory


@dataclass(frozen=True)
class CallReplay:
    """What one call did to a rank's classic allocator."""

    peak_reserved: int  # the highest reserve during the call
    unallocated_at_peak: int  # reserved but unallocated when the reserve peaked
    reserved_after: int  # the reserve the next call starts from (after ``empty_cache`` when it ran)
    unallocated_after: int  # the part of it reserved but unallocated
    largest_free_after: int  # the largest cached free block the next call finds
    segments_after: int
    failure: ReplayFailure | None = None
    unmatched_free_bytes: int = 0  # frees that matched no live allocation (not applied)


@dataclass
class RankAllocator:
    """One rank's classic allocator and the allocations it holds between calls."""

    allocator: CachingAllocator
    live: dict[str, list[Block]] = field(default_factory=dict)  # tensor key -> its live blocks, latest last
    categories: dict[int, int] = field(default_factory=dict)  # id(block) -> the step's category
    offloaded: dict[str, int] = field(default_factory=dict)  # static part -> its bytes, while on the host

    @classmethod
    def start(cls, capacity: int, static: dict[str, int], settings: AllocatorSettings | None = None) -> RankAllocator:
        """A rank's allocator after the model is loaded: each static part allocated once, as one block."""
        rank = cls(CachingAllocator(capacity, settings or AllocatorSettings()))
        for name, nbytes in static.items():
            if nbytes > 0:
                rank._keep(f"{STATIC}{name}", rank.allocator.malloc(nbytes), -1)
        return rank

    def _keep(self, key: str, block: Block, category: int) -> None:
        self.live.setdefault(key, []).append(block)
        self.categories[id(block)] = category

    def _release(self, key: str, nbytes: int) -> Block | None:
        """The live block a free of ``nbytes`` under ``key`` releases: the latest of that key and size, else the
        latest of that size under any key; None when nothing live has that size (a free the walk's bookkeeping makes
        of a tensor it never allocated: counted in ``CallReplay.unmatched_free_bytes``, not applied)."""
        for blocks in (self.live.get(key, []), *self.live.values()):
            for i in range(len(blocks) - 1, -1, -1):
                if blocks[i].requested == nbytes:
                    return blocks.pop(i)
        return None

    def replay_call(self, steps: Iterable[ReplayStep], empty_cache: bool) -> CallReplay:
        """Replay a call's steps; stop at the first request the allocator cannot serve. After a call that returned,
        ``empty_cache`` empties the cache; after one that failed, the call's live tensors are freed."""
        allocator = self.allocator
        peak, unallocated_at_peak = allocator.reserved, allocator.unallocated
        made: list[Block] = []  # this call's allocations, in order
        failure = None
        unmatched = 0
        for item in steps:
            step = item.step
            if step.nbytes > 0:
                try:
                    block = allocator.malloc(step.nbytes)
                except CachingAllocatorOutOfMemory as error:
                    failure = ReplayFailure(item, error.oom)
                    break
                self._keep(step.key, block, step.category)
                made.append(block)
                if allocator.reserved > peak:
                    peak, unallocated_at_peak = allocator.reserved, allocator.unallocated
            elif step.nbytes < 0:
                block = self._release(step.key, -step.nbytes)
                if block is None:
                    unmatched -= step.nbytes
                    continue
                self.categories.pop(id(block), None)
                allocator.free(block)
        # A call ends holding only what outlives it (megatron's persistent buffers): its other tensors are freed,
        # by its own steps, by the exception that stopped it, or here when a free of the walk matched nothing.
        self._drop(made)
        if failure is None and empty_cache:
            allocator.empty_cache()
        return CallReplay(
            peak,
            unallocated_at_peak,
            allocator.reserved,
            allocator.unallocated,
            allocator.largest_free_block(),
            allocator.segments,
            failure,
            unmatched,
        )

    def offload(self) -> None:
        """SkyRL's ``offload_to_cpu`` (colocated training): the weights, gradients and optimizer state go to the
        host, then ``torch.cuda.empty_cache()``; megatron's persistent buffers stay."""
        for key in [k for k in self.live if k.startswith(STATIC)]:
            for block in self.live.pop(key):
                self.offloaded[key] = self.offloaded.get(key, 0) + block.requested
                self.categories.pop(id(block), None)
                self.allocator.free(block)
        self.allocator.empty_cache()

    def backload(self) -> OutOfMemory | None:
        """SkyRL's ``backload_to_gpu``: every offloaded part allocated again, one contiguous buffer each (megatron's
        ``reload_from_cpu``); the allocator's error when one does not fit (the parts not reloaded stay offloaded)."""
        for key, nbytes in list(self.offloaded.items()):
            try:
                block = self.allocator.malloc(nbytes)
            except CachingAllocatorOutOfMemory as error:
                return error.oom
            del self.offloaded[key]
            self._keep(key, block, -1)
        return None

    def _drop(self, made: list[Block]) -> None:
        """Free the call's tensors still held, except its persistent buffers: after a failure they die with the
        exception; after a call that returned, only a free the walk made under another size leaves one (counted in
        ``unmatched_free_bytes``)."""
        doomed = {id(b) for b in made if b.allocated and self.categories.get(id(b)) != PERSISTENT}
        for key, blocks in self.live.items():
            kept = []
            for block in blocks:
                if id(block) in doomed:
                    self.categories.pop(id(block), None)
                    self.allocator.free(block)
                else:
                    kept.append(block)
            self.live[key] = kept


def order_steps(orders: Iterable[Any]) -> Iterator[ReplayStep]:
    """Every step of a rank's micro-batch orders (``SegmentOrder``: ``segments`` as (segment, layer) pairs) in walk
    order."""
    for index, order in enumerate(orders):
        for segment, layer in order.segments:
            array = segment.array
            for i in range(len(array.allocated)):
                yield ReplayStep(index, segment.phase, layer, array.step(i))

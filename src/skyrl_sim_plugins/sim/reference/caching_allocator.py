"""PyTorch's CUDA caching allocator without expandable segments (the classic allocator), replayed request by request.

``reference.allocator`` models the allocator as SkyRL 0.4.0's trainer runs it, with expandable segments: reserved
memory grows and shrinks in pages, so it stays within a page of what is allocated and a free byte is a usable byte.
Without them (``trainer.use_expandable_segments: false``, older SkyRL, vLLM's actors by default) every ``cudaMalloc``
is a *segment* of fixed size and address, carved into *blocks*; a freed block is cached for reuse but can only be
merged with its free neighbours of the same segment, and only a segment that is wholly free can be returned to the
device. When sizes vary from call to call the cache fills with free blocks that no larger request fits:
"reserved by PyTorch but unallocated", the fragmentation SkyRL PR #1768 hit.

This module is that allocator's rules, read from ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``)
of PyTorch 2.x; each function names the C++ it follows, and ``tests/test_caching_allocator.py`` checks them case by
case. One stream (the compute stream every trainer allocation is made on), no CUDA graph pools, no events (no tensor
is used on a second stream), no ``roundup_power2_divisions`` (its default, off):

* **rounding** (``round_size``): a request rounds up to a multiple of 512 bytes (``kMinBlockSize``);
* **pools** (``get_pool``): requests of at most 1 MiB (``kSmallSize``) use the small pool, the rest the large pool;
* **segment sizes** (``get_allocation_size``): a new small segment is 2 MiB (``kSmallBuffer``); a large request under
  10 MiB (``kMinLargeAlloc``) gets a 20 MiB segment (``kLargeBuffer``); a larger one its size rounded up to 2 MiB
  (``kRoundLarge``);
* **best fit** (``get_free_block``): the smallest cached free block of the pool that fits (ties: the lowest address);
  with ``max_split_size_mb``, a block of at least that size serves only requests of at least that size, and only if it
  is less than 20 MiB larger (``max_non_split_rounding_mb``'s default);
* **splitting** (``should_split``): the rest of a block becomes a free block when it is at least 512 bytes (small
  pool) or more than 1 MiB (large pool, and only for requests under ``max_split_size``);
* **freeing** (``free_block``, ``try_merge_blocks``): a freed block merges with a free neighbour of its segment;
* **out of memory** (``malloc``): no cached block fits, so ``cudaMalloc`` is tried; when the device has no room, first
  the cached blocks of at least ``max_split_size`` are freed (``release_available_cached_blocks``, only with that
  setting), then every wholly free segment (``release_cached_blocks``, what ``torch.cuda.empty_cache()`` does), each
  followed by another ``cudaMalloc``; then PyTorch raises its message, naming what is reserved but unallocated;
* **garbage collection** (``garbage_collect_cached_blocks``): with ``garbage_collection_threshold`` and a memory
  fraction set, before a ``cudaMalloc`` the wholly free large segments that have waited at least the average number
  of best-fit searches are freed until the reserve falls under the threshold's share of the allowed memory.

A segment's address only orders equal-sized free blocks (the best fit takes the lowest): segments get increasing
addresses as ``cudaMalloc`` would hand out fresh memory, and a block's address is its segment's plus its offset.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from skyrl_sim.api import format_size

MIN_BLOCK_BYTES = 512
"""``kMinBlockSize``: every request rounds up to a multiple of this."""
SMALL_SIZE_BYTES = 1 << 20
"""``kSmallSize``: the largest request of the small pool."""
SMALL_BUFFER_BYTES = 2 << 20
"""``kSmallBuffer``: the segment the small pool allocates."""
LARGE_BUFFER_BYTES = 20 << 20
"""``kLargeBuffer``: the segment a large request under ``MIN_LARGE_ALLOC_BYTES`` gets, and the most an oversize block
may exceed the request it serves (``max_non_split_rounding_mb``'s default)."""
MIN_LARGE_ALLOC_BYTES = 10 << 20
"""``kMinLargeAlloc``: large requests under this share 20 MiB segments."""
ROUND_LARGE_BYTES = 2 << 20
"""``kRoundLarge``: a larger request's segment is its size rounded up to this."""
SEGMENT_GAP_BYTES = 1 << 40
"""How far apart consecutive segments' addresses are (any gap larger than a segment keeps their blocks apart)."""


def round_size(nbytes: int) -> int:
    """``round_size``: the bytes a request takes, a multiple of 512 and at least 512 (``roundup_power2_divisions``
    off, its default)."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return MIN_BLOCK_BYTES * ((nbytes + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES)


def is_small(size: int) -> bool:
    """``get_pool``: a rounded request of at most 1 MiB is the small pool's."""
    return size <= SMALL_SIZE_BYTES


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` is asked for when no cached block fits a rounded request."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * ((size + ROUND_LARGE_BYTES - 1) // ROUND_LARGE_BYTES)


@dataclass(frozen=True)
class AllocatorSettings:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings the classic allocator reads (``CUDAAllocatorConfig``), and the memory
    fraction (``torch.cuda.set_per_process_memory_fraction``) the garbage collection is measured against."""

    max_split_size: int | None = None
    """``max_split_size_mb`` in bytes; None: unlimited (PyTorch's default, ``SIZE_MAX``)."""
    garbage_collection_threshold: float = 0.0
    """``garbage_collection_threshold`` (0 < t < 1); 0: off (the default)."""
    memory_fraction_bytes: int | None = None
    """The allowed maximum set by a memory fraction; None: no fraction (then garbage collection never runs, as in
    ``malloc``: it needs ``set_fraction``)."""

    @property
    def split_limit(self) -> int:
        """``max_split_size()``: SIZE_MAX when unset."""
        return self.max_split_size if self.max_split_size is not None else 1 << 63


@dataclass(eq=False)
class Block:
    """A piece of a segment: allocated to one request, or cached free (``Block`` in the C++)."""

    address: int
    size: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None
    gc_count_base: int = 0  # the pool's best-fit searches when the block was cached

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int]:
        """``BlockComparatorSize`` (one stream): by size, then address."""
        return (self.size, self.address)


@dataclass
class BlockPool:
    """The cached free blocks of one pool, ordered as ``BlockComparatorSize`` orders them."""

    small: bool
    keys: list[tuple[int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int], Block] = field(default_factory=dict)
    searches: int = 0  # ``get_free_blocks_call_count``

    def insert(self, block: Block) -> None:
        """``insert_into_blocks``: cache a free block (its age for garbage collection starts now)."""
        block.gc_count_base = self.searches
        key = block.key()
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = block.key()
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def lower_bound(self, size: int) -> Block | None:
        """The first cached block of at least ``size`` bytes (the smallest; ties: the lowest address)."""
        index = bisect.bisect_left(self.keys, (size, -1))
        return self.blocks[self.keys[index]] if index < len(self.keys) else None

    def __iter__(self) -> Iterator[Block]:
        """The cached blocks in order, over a copy (a caller may remove blocks as it goes)."""
        return (self.blocks[key] for key in list(self.keys))


@dataclass(frozen=True)
class OutOfMemory:
    """Why a request failed, with what PyTorch's message reports (``malloc``'s ``TORCH_CHECK_WITH``)."""

    requested: int  # the request, rounded (``round_size``)
    attempted: int  # what ``cudaMalloc`` was asked for: PyTorch's "Tried to allocate" (``alloc_size``)
    allocated: int  # "allocated by PyTorch"
    reserved: int  # allocated + "reserved by PyTorch but unallocated"
    free_device: int  # the device's free bytes after the allocator released what it could
    largest_free_block: int  # the largest cached free block left

    @property
    def unallocated(self) -> int:
        """PyTorch's "reserved by PyTorch but unallocated": cached blocks no segment release could return."""
        return self.reserved - self.allocated

    @property
    def fragmented(self) -> bool:
        """The request would fit in the free memory (the device's plus the cache's) but in no one piece of it: the
        failure is fragmentation, not a lack of memory."""
        return self.requested <= self.unallocated + self.free_device


class CachingAllocatorOutOfMemory(Exception):
    """``torch.OutOfMemoryError`` from the classic allocator."""

    def __init__(self, oom: OutOfMemory) -> None:
        super().__init__(f"out of memory: {oom.requested} bytes requested")
        self.oom = oom


@dataclass
class CachingAllocator:
    """One device's classic caching allocator (``DeviceCachingAllocator``, one stream). ``capacity`` is what
    ``cudaMalloc`` may hand out in all: the device's memory less what sits outside PyTorch (the CUDA context,
    NCCL and workspaces). The allocator outlives a call: its cached blocks are what the next call starts from."""

    capacity: int
    settings: AllocatorSettings = field(default_factory=AllocatorSettings)
    allocated: int = 0  # ``allocated_bytes``: blocks handed out
    reserved: int = 0  # ``reserved_bytes``: segments held (``total_allocated_memory``)
    peak_reserved: int = 0
    segments: int = 0  # ``stats.segment``: segments held
    small_pool: BlockPool = field(default_factory=lambda: BlockPool(small=True))
    large_pool: BlockPool = field(default_factory=lambda: BlockPool(small=False))
    _next_address: int = SEGMENT_GAP_BYTES

    @property
    def unallocated(self) -> int:
        """What ``torch.cuda.memory_reserved() - memory_allocated()`` reports: cached, not handed out."""
        return self.reserved - self.allocated

    def largest_free_block(self) -> int:
        """The largest cached free block of either pool (0 when none)."""
        sizes = [pool.keys[-1][0] for pool in (self.small_pool, self.large_pool) if pool.keys]
        return max(sizes, default=0)

    # -- malloc -------------------------------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> Block:
        """``malloc``: a block for a request of ``nbytes``, raising ``CachingAllocatorOutOfMemory`` as PyTorch raises
        its OOM error."""
        size = round_size(nbytes)
        pool = self.small_pool if is_small(size) else self.large_pool
        alloc_size = allocation_size(size)
        block = self._get_free_block(pool, size)
        if block is None:
            if self.settings.garbage_collection_threshold > 0 and self.settings.memory_fraction_bytes is not None:
                self._garbage_collect()
            block = self._alloc_block(pool, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, alloc_size)
            if block is None and self.release_cached_blocks():
                block = self._alloc_block(pool, alloc_size)
        if block is None:
            oom = OutOfMemory(
                size, alloc_size, self.allocated, self.reserved, self._device_free(), self.largest_free_block()
            )
            raise CachingAllocatorOutOfMemory(oom)
        return self._alloc_found_block(pool, block, size, nbytes, self._should_split(block, size))

    def _get_free_block(self, pool: BlockPool, size: int) -> Block | None:
        """``get_free_block``: the best-fitting cached block, within the oversize rules."""
        if self.settings.garbage_collection_threshold > 0 and self.settings.memory_fraction_bytes is not None:
            pool.searches += 1
        block = pool.lower_bound(size)
        if block is None:
            return None
        limit = self.settings.split_limit
        if size < limit and block.size >= limit:  # an oversize block never serves a request under the limit
            return None
        if size >= limit and block.size >= size + LARGE_BUFFER_BYTES:  # nor one it exceeds by 20 MiB or more
            return None
        pool.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """``should_split``: whether the rest of the block becomes a free block of its own."""
        remaining = block.size - size
        if block.small:
            return remaining >= MIN_BLOCK_BYTES
        return size < self.settings.split_limit and remaining > SMALL_SIZE_BYTES

    def _alloc_found_block(self, pool: BlockPool, block: Block, size: int, nbytes: int, split: bool) -> Block:
        """``alloc_found_block``: hand out the block's first ``size`` bytes, caching the rest when split."""
        if split:
            rest = Block(block.address + size, block.size - size, block.small, prev=None, next=block.next)
            block.size = size
            if rest.next is not None:
                rest.next.prev = rest
            rest.prev = block
            block.next = rest
            pool.insert(rest)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        return block

    def _device_free(self) -> int:
        """The device's free bytes as ``cudaMalloc`` sees them."""
        return max(0, self.capacity - self.reserved)

    def _alloc_block(self, pool: BlockPool, alloc_size: int) -> Block | None:
        """``alloc_block``: a new segment from ``cudaMalloc``, or None when the device (or the memory fraction) has
        no room."""
        allowed = self.settings.memory_fraction_bytes
        if allowed is not None and self.reserved + alloc_size > allowed:
            return None
        if self.reserved + alloc_size > self.capacity:
            return None
        block = Block(self._next_address, alloc_size, pool.small)
        self._next_address += SEGMENT_GAP_BYTES
        self.reserved += alloc_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segments += 1
        return block

    # -- free ---------------------------------------------------------------------------------------------------------

    def free(self, block: Block) -> None:
        """``free`` / ``free_block``: cache the block, merged with the free neighbours of its segment."""
        assert block.allocated, "a block is freed once"
        pool = self.small_pool if block.small else self.large_pool
        block.allocated = False
        block.requested = 0
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour, pool)
        pool.insert(block)

    @staticmethod
    def _try_merge(block: Block, neighbour: Block | None, pool: BlockPool) -> None:
        """``try_merge_blocks``: absorb a free neighbour (it leaves the pool)."""
        if neighbour is None or neighbour.allocated:
            return
        pool.remove(neighbour)
        if block.prev is neighbour:  # [neighbour block]
            block.address = neighbour.address
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:  # [block neighbour]
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size

    # -- returning memory to the device -------------------------------------------------------------------------------

    def _release_block(self, pool: BlockPool, block: Block) -> None:
        """``release_block``: ``cudaFree`` a wholly free segment."""
        pool.remove(block)
        self.reserved -= block.size
        self.segments -= 1

    def release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` (``torch.cuda.empty_cache()``): every wholly free segment goes back to the
        device; a segment with any block in use keeps all of it."""
        for pool in (self.large_pool, self.small_pool):
            for block in pool:
                if not block.is_split:
                    self._release_block(pool, block)
        return True

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``."""
        self.release_cached_blocks()

    def _release_available_cached_blocks(self, pool: BlockPool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size`` set, free one cached oversize segment of at
        least the request's size (at least the limit), else the largest ones until that much is freed."""
        limit = self.settings.max_split_size
        if limit is None:
            return False
        wanted = max(size, limit)
        block = pool.lower_bound(wanted)
        if block is not None:
            if block.is_split:  # release_block asserts a whole segment; PyTorch only caches oversize blocks unsplit
                return False
            self._release_block(pool, block)
            return True
        released = 0
        for candidate in reversed(list(pool)):
            if released >= wanted or candidate.size < limit or candidate.is_split:
                break
            released += candidate.size
            self._release_block(pool, candidate)
        return released >= wanted

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: free the oldest wholly free large segments (age: best-fit searches
        since they were cached, at least the average) until the reserve is under the threshold's share of the
        allowed memory."""
        allowed = self.settings.memory_fraction_bytes
        assert allowed is not None
        threshold = int(self.settings.garbage_collection_threshold * allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        pool = self.large_pool
        freeable = [b for b in pool if not b.is_split]
        total_age = sum(pool.searches - b.gc_count_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            average = total_age / count
            freed = False
            for block in list(pool):
                if block.is_split:
                    continue
                age = pool.searches - block.gc_count_base
                if age >= average:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(pool, block)


def cuda_oom_message(
    attempted: int, total: float, in_use: float, allocated: int, reserved: int, other_process: float = 0
) -> str:
    """PyTorch's ``torch.OutOfMemoryError`` text (``malloc``'s ``TORCH_CHECK_WITH``): ``attempted`` is what it tried
    to allocate, ``total`` the device's memory, ``in_use`` what the process holds (its reserve plus what sits outside
    the allocator); "reserved by PyTorch but unallocated" is ``reserved - allocated``. ``other_process``: what another
    process holds on the device (vLLM's engine worker beside the colocated trainer), which the message lists on a line
    of its own (``reportProcessMemoryInfo`` names every process on the device, by pid, and this one as "this
    process"; vLLM's pid is not known here, and the order is NVML's, not known either)."""
    others = f"Process (vLLM's engine worker) has {format_size(other_process)} memory in use. " if other_process else ""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(attempted)}. GPU 0 has a total capacity of "
        f"{format_size(total)} of which {format_size(max(0.0, total - in_use - other_process))} is free. {others}"
        "Including non-PyTorch memory, "
        f"this process has {format_size(in_use)} memory in use. Of the allocated memory {format_size(allocated)} is "
        f"allocated by PyTorch, and {format_size(max(0, reserved - allocated))} is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
        "avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )

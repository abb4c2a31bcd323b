"""PyTorch's classic caching allocator, rule by rule (``sim.reference.caching_allocator``).

Each test names the function of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) whose rule it
checks, with a worked example derived from that code: the constants (``kMinBlockSize`` 512 B, ``kSmallSize`` 1 MiB,
``kSmallBuffer`` 2 MiB, ``kMinLargeAlloc`` 10 MiB, ``kLargeBuffer`` 20 MiB, ``kRoundLarge`` 2 MiB) and the order in
which ``malloc`` tries the cache, ``cudaMalloc``, and the releases before it raises. ``scripts/gpu_check.sh`` replays
the same sequences through ``torch.cuda`` on a GPU and compares reserved bytes step by step.
"""

from __future__ import annotations

import pytest

from skyrl_sim_plugins.sim.reference.caching_allocator import (
    AllocatorSettings,
    CachingAllocator,
    CachingAllocatorOutOfMemory,
    allocation_size,
    cuda_oom_message,
    is_small,
    round_size,
)

KIB, MIB = 1 << 10, 1 << 20
BIG = 1 << 40  # a device with room for anything


def test_round_size_rounds_to_512_bytes() -> None:
    """``round_size``: ``kMinBlockSize * ceil(size / kMinBlockSize)``, at least ``kMinBlockSize``."""
    assert [round_size(n) for n in (0, 1, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024, 1024]


def test_get_pool_splits_at_one_mib() -> None:
    """``get_pool``: ``size <= kSmallSize`` is the small pool."""
    assert is_small(MIB) and not is_small(MIB + 512)


@pytest.mark.parametrize(
    ("size", "segment"),
    [
        (512, 2 * MIB),  # size <= kSmallSize: kSmallBuffer
        (MIB, 2 * MIB),
        (MIB + 512, 20 * MIB),  # size < kMinLargeAlloc: kLargeBuffer
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),  # else kRoundLarge * ceil(size / kRoundLarge)
        (11 * MIB, 12 * MIB),
        (18 * MIB + 512, 20 * MIB),
    ],
)
def test_get_allocation_size(size: int, segment: int) -> None:
    """``get_allocation_size``: the segment ``cudaMalloc`` is asked for."""
    assert allocation_size(size) == segment


def test_small_requests_are_packed_into_one_2_mib_segment() -> None:
    """``should_split`` (small pool: ``remaining >= kMinBlockSize``): four 512 KiB requests share one kSmallBuffer."""
    allocator = CachingAllocator(BIG)
    blocks = [allocator.malloc(512 * KIB) for _ in range(4)]
    assert allocator.reserved == 2 * MIB and allocator.segments == 1 and allocator.allocated == 2 * MIB
    assert [b.address - blocks[0].address for b in blocks] == [0, 512 * KIB, 1024 * KIB, 1536 * KIB]
    allocator.malloc(1)  # the segment is full: a second one
    assert allocator.reserved == 4 * MIB and allocator.segments == 2


def test_a_mid_sized_request_splits_a_20_mib_segment_and_the_rest_serves_the_next() -> None:
    """``get_allocation_size`` (1-10 MiB: kLargeBuffer) and ``should_split`` (large pool: ``remaining > kSmallSize``):
    the rest of the 20 MiB segment is cached and the next request is carved from it."""
    allocator = CachingAllocator(BIG)
    allocator.malloc(3 * MIB)
    assert allocator.reserved == 20 * MIB and allocator.unallocated == 17 * MIB
    allocator.malloc(5 * MIB)
    assert allocator.reserved == 20 * MIB and allocator.segments == 1 and allocator.allocated == 8 * MIB


def test_a_remainder_of_1_mib_or_less_is_not_split_off() -> None:
    """``should_split``: an 11 MiB request gets a 12 MiB segment; the 1 MiB left is not more than kSmallSize, so the
    whole block is handed out and counted as allocated (``allocated_bytes`` adds ``block->size``)."""
    allocator = CachingAllocator(BIG)
    block = allocator.malloc(11 * MIB)
    assert block.size == 12 * MIB and allocator.allocated == 12 * MIB and allocator.unallocated == 0


def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    """``get_free_block``: ``lower_bound`` on blocks ordered by (size, address)."""
    allocator = CachingAllocator(BIG)
    big, small = allocator.malloc(50 * MIB), allocator.malloc(30 * MIB)
    allocator.free(big)
    allocator.free(small)
    again = allocator.malloc(25 * MIB)
    assert again.address == small.address and allocator.segments == 2
    assert allocator.largest_free_block() == 50 * MIB  # the 30 MiB block was split: 25 handed out, 5 cached
    assert allocator.unallocated == 50 * MIB + 5 * MIB


def test_freed_neighbours_merge_and_empty_cache_returns_the_whole_segment() -> None:
    """``free_block`` / ``try_merge_blocks`` merge free neighbours of a segment; ``release_cached_blocks``
    (``empty_cache``) frees the segments that are no longer split."""
    allocator = CachingAllocator(BIG)
    a, b = allocator.malloc(3 * MIB), allocator.malloc(4 * MIB)
    allocator.free(a)
    assert allocator.largest_free_block() == 13 * MIB  # a is cached apart from the 13 MiB tail: b sits between
    allocator.free(b)
    assert allocator.largest_free_block() == 20 * MIB  # a, b and the tail are one block again
    allocator.empty_cache()
    assert allocator.reserved == 0 and allocator.segments == 0


def test_empty_cache_keeps_a_segment_with_any_block_in_use() -> None:
    """``release_blocks``: only blocks with neither ``prev`` nor ``next`` are freed; a split segment stays whole."""
    allocator = CachingAllocator(BIG)
    allocator.malloc(3 * MIB)
    allocator.empty_cache()
    assert allocator.reserved == 20 * MIB and allocator.unallocated == 17 * MIB


def test_a_failed_cudamalloc_frees_the_cached_segments_and_retries() -> None:
    """``malloc``: ``alloc_block`` fails, then ``release_cached_blocks`` and ``alloc_block`` again succeeds."""
    allocator = CachingAllocator(100 * MIB)
    allocator.free(allocator.malloc(60 * MIB))  # cached, whole: too small for the next request
    block = allocator.malloc(70 * MIB)
    assert block.size == 70 * MIB and allocator.reserved == 70 * MIB and allocator.segments == 1


def test_free_memory_in_a_split_segment_cannot_serve_a_larger_request_and_the_oom_says_so() -> None:
    """``malloc``'s OOM: 30 MiB are cached in a segment whose other half is in use (``release_cached_blocks`` cannot
    free it) and 2 MiB are free on the device; a 32 MiB request fits neither. PyTorch reports the 30 MiB as reserved
    but unallocated and tried to allocate the request's segment (``alloc_size``)."""
    allocator = CachingAllocator(100 * MIB)
    allocator.free(allocator.malloc(60 * MIB))
    allocator.malloc(30 * MIB)  # best fit: the cached 60 MiB segment, split 30 + 30
    allocator.malloc(38 * MIB)  # no cached block fits: a new segment; 98 MiB reserved
    with pytest.raises(CachingAllocatorOutOfMemory) as raised:
        allocator.malloc(32 * MIB)
    oom = raised.value.oom
    assert (oom.attempted, oom.allocated, oom.reserved, oom.free_device) == (32 * MIB, 68 * MIB, 98 * MIB, 2 * MIB)
    assert oom.unallocated == 30 * MIB and oom.largest_free_block == 30 * MIB and oom.fragmented
    message = cuda_oom_message(oom.attempted, 100 * MIB, oom.reserved, oom.allocated, oom.reserved)
    assert "Tried to allocate 32.00 MiB" in message and "30.00 MiB is reserved by PyTorch but unallocated" in message
    assert allocator.reserved == 98 * MIB  # nothing could be returned


def test_an_oom_with_little_cached_is_not_fragmentation() -> None:
    """The same message when the device is simply full: the request exceeds the cached and the free bytes."""
    allocator = CachingAllocator(100 * MIB)
    allocator.malloc(90 * MIB)
    with pytest.raises(CachingAllocatorOutOfMemory) as raised:
        allocator.malloc(20 * MIB)
    assert not raised.value.oom.fragmented and raised.value.oom.unallocated == 0


def test_max_split_size_keeps_oversize_blocks_for_large_requests() -> None:
    """``get_free_block``: with ``max_split_size_mb``, a cached block of at least that size does not serve a smaller
    request (``p.size() < max_split_size && block->size >= max_split_size``), and ``should_split`` never splits for a
    request of at least that size."""
    allocator = CachingAllocator(BIG, AllocatorSettings(max_split_size=64 * MIB))
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(30 * MIB)
    assert allocator.segments == 2  # the 100 MiB block was not split for 30 MiB
    block = allocator.malloc(90 * MIB)  # 100 < 90 + 20: the oversize block serves it, unsplit
    assert block.size == 100 * MIB and allocator.segments == 2


def test_an_oversize_block_20_mib_larger_than_the_request_is_not_used() -> None:
    """``get_free_block``: ``p.size() >= max_split_size && block->size >= p.size() + kLargeBuffer`` refuses it."""
    allocator = CachingAllocator(BIG, AllocatorSettings(max_split_size=64 * MIB))
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(80 * MIB)
    assert allocator.segments == 2 and allocator.reserved == 180 * MIB


def test_release_available_cached_blocks_frees_an_oversize_segment_first() -> None:
    """``release_available_cached_blocks`` (only with ``max_split_size``): before freeing every cached segment,
    ``malloc`` frees one cached oversize block of at least the request, then retries ``cudaMalloc``."""
    allocator = CachingAllocator(200 * MIB, AllocatorSettings(max_split_size=64 * MIB))
    small = allocator.malloc(3 * MIB)
    allocator.free(small)  # a whole 20 MiB segment, cached
    allocator.free(allocator.malloc(150 * MIB))  # oversize, cached
    allocator.malloc(40 * MIB)  # 40 < 64: the oversize block may not serve it; 190 MiB reserved, 10 free: release
    assert allocator.reserved == 20 * MIB + 40 * MIB  # the 150 MiB segment went; the 20 MiB one stayed cached


def test_garbage_collection_frees_old_whole_segments_once_past_the_threshold() -> None:
    """``garbage_collect_cached_blocks`` (``garbage_collection_threshold`` with a memory fraction): before a
    ``cudaMalloc``, when the reserve passes threshold x allowed, whole large segments at least as old as the average
    (in best-fit searches) are freed."""
    settings = AllocatorSettings(garbage_collection_threshold=0.5, memory_fraction_bytes=100 * MIB)
    allocator = CachingAllocator(BIG, settings)
    allocator.free(allocator.malloc(40 * MIB))
    allocator.malloc(30 * MIB)  # best fit: the cached 40 MiB segment, split 30 + 10; under the threshold: no GC
    allocator.malloc(25 * MIB)  # a new 26 MiB segment (rounded to 2 MiB); reserved 66 MiB
    assert allocator.reserved == 66 * MIB
    cached = CachingAllocator(BIG, settings)
    cached.free(cached.malloc(60 * MIB))
    cached.malloc(70 * MIB)  # no block fits; 60 MiB reserved > 50: GC frees the cached 60 MiB segment first
    assert cached.reserved == 70 * MIB and cached.segments == 1
    without = CachingAllocator(BIG, AllocatorSettings(garbage_collection_threshold=0.5))  # no fraction: no GC
    without.free(without.malloc(60 * MIB))
    without.malloc(70 * MIB)
    assert without.reserved == 130 * MIB


def test_the_memory_fraction_caps_cudamalloc() -> None:
    """``alloc_block``: ``set_fraction && total_allocated_memory + size > allowed_memory_maximum`` fails."""
    allocator = CachingAllocator(BIG, AllocatorSettings(memory_fraction_bytes=50 * MIB))
    allocator.malloc(40 * MIB)
    with pytest.raises(CachingAllocatorOutOfMemory):
        allocator.malloc(12 * MIB)


def test_sizes_growing_call_by_call_leave_slivers_the_expandable_note_describes() -> None:
    """Note [Expandable Segments]: a batch of N then N + 1 rows makes a new, slightly larger segment each call, while
    a tensor that outlives the call and grows with it (a buffer sized by the call's longest sequence) is carved from
    that segment once the activation is freed (best fit: the old slivers are too small), and ``empty_cache`` cannot
    return a segment in use. The slivers add up call by call to more than the next request, which still fails:
    fragmentation."""
    allocator = CachingAllocator(400 * MIB)
    unallocated = []
    for rows in (40, 44, 48, 52, 56):
        allocator.free(allocator.malloc(rows * MIB))  # a call's big activation, freed at its end
        allocator.malloc(rows // 2 * MIB)  # the buffer that outlives the call: the first half of that segment
        allocator.empty_cache()  # SkyRL's empty_cuda_cache after the call
        unallocated.append(allocator.unallocated // MIB)
    assert unallocated == [20, 42, 66, 92, 120]  # reserved but unallocated, growing from call to call
    with pytest.raises(CachingAllocatorOutOfMemory) as raised:
        allocator.malloc(200 * MIB)
    oom = raised.value.oom
    assert oom.fragmented and oom.free_device == 160 * MIB and oom.largest_free_block == 28 * MIB


def test_pytorchs_own_allocator_settings_test() -> None:
    """PyTorch's ``test_allocator_settings`` (test/test_cuda.py; read here in its port to Cambricon's torch_mlu, which
    keeps its lines): with ``garbage_collection_threshold:0.5,max_split_size_mb:40`` a tensor of 21 Mi floats
    (84 MiB) adds exactly its bytes to the active bytes: at least ``max_split_size``, it is rounded and never split.
    The same test refuses ``max_split_size_mb:2`` and ``garbage_collection_threshold:1.2``, as the endpoint's schema
    does (``tests/test_classic_allocator_run.py``)."""
    nbytes = 4 * 21 * MIB
    allocator = CachingAllocator(BIG, AllocatorSettings(max_split_size=40 * MIB, garbage_collection_threshold=0.5))
    before = allocator.allocated
    allocator.malloc(nbytes)
    assert allocator.allocated - before == nbytes and allocator.unallocated == 0


def test_a_smaller_weight_placed_in_a_cached_larger_block_strands_the_rest_unless_max_split_size_forbids_it() -> None:
    """The worked example of vLLM PR #41268 (GPT-OSS 120B loading on H100s): each layer's 530 MiB w13 buffer is freed
    after processing, then its 270 MiB w2 weight is made and kept. ``get_free_block`` hands the 270 MiB request the
    cached 530 MiB block and ``should_split`` splits it (260 MiB left > kSmallSize): the 260 MiB remainder is stranded
    in a segment the kept weight pins, and the next layer's 530 MiB needs a new segment. With
    ``max_split_size_mb:20`` the 530 MiB block is at least 20 MiB larger than the request, so ``get_free_block`` refuses
    it; the weight gets its own segment and the 530 MiB one is reused by every layer."""
    layers = 6

    def load(settings: AllocatorSettings) -> CachingAllocator:
        allocator = CachingAllocator(BIG, settings)
        for _ in range(layers):
            allocator.free(allocator.malloc(530 * MIB))  # w13 processed and dropped
            allocator.malloc(270 * MIB)  # w2 kept
        return allocator

    default = load(AllocatorSettings())
    assert default.reserved == layers * 530 * MIB and default.unallocated == layers * 260 * MIB
    limited = load(AllocatorSettings(max_split_size=20 * MIB))
    assert limited.reserved == 530 * MIB + layers * 270 * MIB and limited.unallocated == 530 * MIB

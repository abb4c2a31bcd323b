"""The classic caching allocator bound to a run: one rank allocator per data-parallel rank, kept from call to call.

An endpoint with ``trainer.use_expandable_segments: false`` on a CUDA card runs PyTorch's classic allocator on its
training workers (the allocator axis's ``cuda-classic`` option, ``device_memory.ALLOCATORS``, whose rule
``replays``). The run's bound walk (``bound.memory.BoundWalk``) still decides whether each call's live tensors fit; then
``ClassicAllocators.replay`` replays every rank's steps of the call, in the walk's order
(``memory_walk.wrapped_orders``), through that rank's ``allocation_replay.RankAllocator``, which keeps its cached
segments from the previous call (SkyRL's ``empty_cuda_cache`` returns only whole free segments). The call's report
gains what the allocator holds (``MemoryReport.allocator``: reserved and reserved-but-unallocated at the peak and
after the call, the largest free block) and, where a request finds no cached block and no free device memory though
the walk's live bytes fit, PyTorch's out-of-memory error: the fragmentation.

This is the only state the classic allocator keeps between calls, and it lives as long as the run's executor.
Pipeline stages are not replayed (the schema refuses the setting with ``pp > 1``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from skyrl_sim.api import CallShape, CarriedMemory, DeviceMemory, Endpoint, MemoryReport, OomRecord
from skyrl_sim_plugins.sim.bound.memory import BoundWalk
from skyrl_sim_plugins.sim.reference.allocation_replay import (
    CallReplay,
    RankAllocator,
    ReplayFailure,
    ReplayStep,
    order_steps,
)
from skyrl_sim_plugins.sim.reference.caching_allocator import AllocatorSettings, OutOfMemory
from skyrl_sim_plugins.sim.reference.device_memory import endpoint_allocator, oom_message
from skyrl_sim_plugins.sim.reference.memory_walk import empties_cache, microbatch_orders, wrapped_orders

MIB = 1 << 20


def classic_allocator(endpoint: Endpoint) -> bool:
    """Whether the endpoint's training workers run the classic allocator: a CUDA card without expandable segments
    (``trainer.use_expandable_segments``, else the SkyRL version's default), the allocator axis's option that
    ``replays``."""
    return endpoint_allocator(endpoint).replays


def allocator_settings(endpoint: Endpoint) -> AllocatorSettings:
    """The endpoint's ``PYTORCH_CUDA_ALLOC_CONF`` options, and its memory fraction when it caps the device
    (``memory_limit_gib``: the real backend sets the CUDA memory fraction from it)."""
    conf = endpoint.trainer.pytorch_cuda_alloc_conf
    return AllocatorSettings(
        max_split_size=conf.max_split_size_mb * MIB if conf.max_split_size_mb is not None else None,
        garbage_collection_threshold=conf.garbage_collection_threshold or 0.0,
        memory_fraction_bytes=endpoint.capacity_bytes if endpoint.memory_limit_gib is not None else None,
    )


def rank_call_steps(walk: BoundWalk, shape: CallShape, rank: int, held: dict[str, int]) -> tuple[Iterator[ReplayStep], int]:
    """One rank's steps of a call in the walk's order (its micro-batches wrapped as the walk wraps them, from the
    buffers ``held`` before the call), and how many there are."""
    endpoint, model, bound = walk.endpoint, walk.model, walk.bound
    segments_of = walk.segments_of(bound)
    mbs = shape.microbatches_of_rank(rank)
    shapes, orders = microbatch_orders(mbs, shape, endpoint, model, bound.facts, segments_of)
    items = list(wrapped_orders(mbs, shape, endpoint, model, bound.facts, shapes, orders, held))
    count = sum(len(segment.array.allocated) for item in items for segment, _ in item.order.segments)
    return order_steps(item.order for item in items), count


class ClassicAllocators:
    """Every data-parallel rank's classic allocator over a run (made at a rank's first call, with its static
    memory), and the replay of each call through them."""

    def __init__(self, walk: BoundWalk) -> None:
        self.walk = walk
        self.ranks: dict[int, RankAllocator] = {}

    def replay(self, shape: CallShape, before: CarriedMemory, report: MemoryReport, device: DeviceMemory) -> MemoryReport:
        """The call's report with the classic allocator's view added (a new report: the walk's may be cached and
        shared), from the buffers each rank held ``before`` the call, on ``device`` (the memory the call's walk had:
        a colocated vLLM asleep may hold part of the card). A rank whose request fails although the walk fitted fails
        the call with PyTorch's message; a call the walk failed is replayed up to its failing micro-batch (its
        tensors then die with the exception)."""
        endpoint, bound = self.walk.endpoint, self.walk.bound
        capacity = device.capacity_bytes
        settings = allocator_settings(endpoint)
        stop = report.oom.where.get("microbatch") if report.oom is not None else None
        replays: dict[int, tuple[CallReplay, float]] = {}
        for rank in range(endpoint.parallelism.dp):
            if not shape.microbatches_of_rank(rank):
                continue
            state = self.ranks.get(rank)
            if state is None:
                state = self.ranks[rank] = RankAllocator.start(capacity, bound.facts.static, settings)
            state.allocator.capacity = capacity  # a colocated vLLM may hold part of the device now
            state.allocator.settings = settings
            if state.offloaded:  # a reload that failed before: the call needs its weights first
                missing = state.backload()
                if missing is not None:
                    return dataclasses.replace(report, oom=backload_oom(missing, rank, endpoint, device), progress=0.0)
            steps, count = rank_call_steps(self.walk, shape, rank, before.held(rank))
            if stop is not None:
                steps = (s for s in steps if s.microbatch < int(stop))
            done = _Counted(steps)
            outcome = state.replay_call(done, empties_cache(endpoint) and report.oom is None)
            replays[rank] = (outcome, done.count / count if count else 1.0)
        if not replays:
            return report
        return self._reported(report, replays, device)

    def _reported(
        self, report: MemoryReport, replays: dict[int, tuple[CallReplay, float]], device: DeviceMemory
    ) -> MemoryReport:
        """The report with the busiest rank's allocator numbers, and a fragmentation failure if one rank's came
        first (the one that got least far)."""
        failed = {rank: r for rank, r in replays.items() if r[0].failure is not None}
        if failed and report.oom is None:
            rank, (outcome, progress) = min(failed.items(), key=lambda item: item[1][1])
        else:
            rank, (outcome, progress) = max(replays.items(), key=lambda item: item[1][0].peak_reserved)
        view = {
            "kind": "classic",
            "rank": rank,
            "peak_reserved_bytes": outcome.peak_reserved,
            "unallocated_at_peak_bytes": outcome.unallocated_at_peak,
            "reserved_after_bytes": outcome.reserved_after,
            "unallocated_after_bytes": outcome.unallocated_after,
            "largest_free_block_bytes": outcome.largest_free_after,
            "segments_after": outcome.segments_after,
        }
        if outcome.unmatched_free_bytes:
            view["unmatched_free_bytes"] = outcome.unmatched_free_bytes
        changes: dict[str, Any] = {"allocator": view}
        if report.oom is None and outcome.failure is not None:
            changes["oom"] = fragmentation_oom(outcome.failure, rank, self.walk.endpoint, device)
            changes["progress"] = progress
        return dataclasses.replace(report, **changes)

    def switched(self, steps: list[str], device: DeviceMemory) -> OomRecord | None:
        """The trainer's side of a colocated switch on every rank made so far: ``trainer_offload`` (SkyRL's
        ``offload_to_cpu``: static memory to the host, then ``empty_cache``) and ``trainer_backload``
        (``backload_to_gpu``: one contiguous block per part again). The first rank whose reload does not fit fails
        the switch with PyTorch's message. ``device``: the memory the trainer has once the switches are made."""
        for step in steps:
            for rank, state in self.ranks.items():
                state.allocator.capacity = device.capacity_bytes
                if step == "trainer_offload":
                    state.offload()
                elif step == "trainer_backload":
                    oom = state.backload()
                    if oom is not None:
                        return backload_oom(oom, rank, self.walk.endpoint, device)
        return None


def backload_oom(oom: OutOfMemory, rank: int, endpoint: Endpoint, device: DeviceMemory) -> OomRecord:
    """A reload the classic allocator cannot place, as the switch's OOM record (phase ``backload``)."""
    where = {
        "phase": "backload",
        "step": "trainer_backload",
        "dp_rank": rank,
        "allocator": "classic",
        "fragmented": oom.fragmented,
        "reserved_unallocated_bytes": oom.unallocated,
        "largest_free_block_bytes": oom.largest_free_block,
    }
    message = oom_message(oom.attempted, oom.allocated, oom.reserved, endpoint, device)
    return OomRecord(oom.attempted, where, message, oom.allocated, device.capacity_bytes)


class _Counted:
    """An iterator of steps that counts how many were taken (how far a replay got)."""

    def __init__(self, steps: Iterator[ReplayStep]) -> None:
        self.steps = steps
        self.count = 0

    def __iter__(self) -> Iterator[ReplayStep]:
        for step in self.steps:
            self.count += 1
            yield step


def fragmentation_oom(failure: ReplayFailure, rank: int, endpoint: Endpoint, device: DeviceMemory) -> OomRecord:
    """The classic allocator's failure as the call's OOM record, in PyTorch's words."""
    oom, at = failure.oom, failure.at
    step = at.step
    where = {
        "phase": at.phase,
        "layer": at.layer,
        "op": step.op,
        "shape": list(step.shape),
        "dtype": step.dtype,
        "microbatch": at.microbatch,
        "dp_rank": rank,
        "allocator": "classic",
        "fragmented": oom.fragmented,
        "reserved_unallocated_bytes": oom.unallocated,
        "largest_free_block_bytes": oom.largest_free_block,
    }
    message = oom_message(oom.attempted, oom.allocated, oom.reserved, endpoint, device)
    return OomRecord(oom.attempted, where, message, oom.allocated, device.capacity_bytes)

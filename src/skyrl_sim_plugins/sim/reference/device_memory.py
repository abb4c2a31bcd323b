"""The endpoint's device as a memory model sees it: how its allocator sizes a request (``endpoint_allocator``: the
CUDA caching allocator's rounding, or the CPU allocator's exact bytes) and how PyTorch words running out of it
(``oom_message``).

Read by the walk (its failing allocation), by vLLM's start-up on a device it shares with the trainer
(``service.colocation``) and by whatever rounds a size as the device does.
"""

from __future__ import annotations

from skyrl_sim.api import GIB, Endpoint, cpu_oom_message, format_size, profile_device
from skyrl_sim_plugins.sim.reference.allocator import AllocatorRule, allocator_rule


def oom_message(attempted: int, allocated: int, reserved: int, endpoint: Endpoint) -> str:
    """PyTorch's wording: the CUDA caching allocator's message, or the CPU allocator's on a ``cpu`` profile."""
    if profile_device(endpoint.hardware.profile) == "cpu":
        return cpu_oom_message(attempted)
    total_gib = endpoint.memory_limit_gib if endpoint.memory_limit_gib is not None else endpoint.hardware.device_memory_gib
    total = total_gib * GIB
    in_use = endpoint.hardware.reserve_gib * GIB + reserved
    return (
        f"CUDA out of memory. Tried to allocate {format_size(attempted)}. GPU 0 has a total capacity of "
        f"{format_size(total)} of which {format_size(max(0.0, total - in_use))} is free. Including non-PyTorch memory, "
        f"this process has {format_size(in_use)} memory in use. Of the allocated memory {format_size(allocated)} is "
        f"allocated by PyTorch, and {format_size(max(0, reserved - allocated))} is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
        "avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def endpoint_allocator(endpoint: Endpoint) -> AllocatorRule:
    """How the allocator of the endpoint's device sizes a request: CUDA's caching rule, or the CPU's exact bytes."""
    return allocator_rule(profile_device(endpoint.hardware.profile) == "cuda")

"""The endpoint's device as a memory model sees it: how its allocator sizes a request (``endpoint_allocator``: the
CUDA caching allocator's rounding, or the CPU allocator's exact bytes) and how PyTorch words running out of it
(``oom_message``).

Read by the walk (its failing allocation), by vLLM's start-up on a device it shares with the trainer
(``service.colocation``) and by whatever rounds a size as the device does.
"""

from __future__ import annotations

from skyrl_sim.api import DeviceMemory, Endpoint, ModelArch, cpu_oom_message, format_size, profile_device
from skyrl_sim_plugins.sim.description.axes import Axis
from skyrl_sim_plugins.sim.reference.allocator import CPU_EXACT, CUDA_CACHING, AllocatorRule


def device_kind(endpoint: Endpoint, model: ModelArch | None = None) -> str:
    """The torch device type whose kernels run the endpoint's trainer: its hardware profile's ``device``."""
    return profile_device(endpoint.hardware.profile)


ALLOCATORS: Axis[AllocatorRule] = Axis("allocator", device_kind)
"""The allocator axis: how a device hands out its memory, picked by the device type (``cuda``: PyTorch's CUDA caching
allocator, ``cpu``: the CPU allocator's exact bytes)."""
ALLOCATORS.register("cuda", CUDA_CACHING)
ALLOCATORS.register("cpu", CPU_EXACT)


def oom_message(attempted: int, allocated: int, reserved: int, endpoint: Endpoint, device: DeviceMemory) -> str:
    """PyTorch's wording: the CUDA caching allocator's message about ``device`` (its total, and the process's memory
    in use: its non-PyTorch reserve and what the allocator reserved), or the CPU allocator's on a ``cpu`` profile."""
    if profile_device(endpoint.hardware.profile) == "cpu":
        return cpu_oom_message(attempted)
    total = device.total_bytes
    in_use = device.reserve_bytes + reserved
    return (
        f"CUDA out of memory. Tried to allocate {format_size(attempted)}. GPU 0 has a total capacity of "
        f"{format_size(total)} of which {format_size(max(0, total - in_use))} is free. Including non-PyTorch memory, "
        f"this process has {format_size(in_use)} memory in use. Of the allocated memory {format_size(allocated)} is "
        f"allocated by PyTorch, and {format_size(max(0, reserved - allocated))} is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
        "avoid fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def endpoint_allocator(endpoint: Endpoint) -> AllocatorRule:
    """How the allocator of the endpoint's device sizes a request: the option of the allocator axis the endpoint
    picks (``ALLOCATORS``)."""
    return ALLOCATORS.choose(endpoint)

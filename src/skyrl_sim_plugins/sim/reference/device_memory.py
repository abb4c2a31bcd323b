"""The endpoint's device as a memory model sees it: how its allocator sizes a request (``endpoint_allocator``: the
CUDA caching allocator's rounding, with or without expandable segments, or the CPU allocator's exact bytes: the
allocator axis ``ALLOCATORS``) and how PyTorch words running out of it (``oom_message``).

Read by the walk (its failing allocation), by vLLM's start-up on a device it shares with the trainer
(``service.colocation``) and by whatever rounds a size as the device does.
"""

from __future__ import annotations

from skyrl_sim.api import DeviceMemory, Endpoint, ModelArch, cpu_oom_message, profile_device
from skyrl_sim_plugins.sim.description.axes import Axis
from skyrl_sim_plugins.sim.reference.allocator import CPU_EXACT, CUDA_CACHING, CUDA_CLASSIC, AllocatorRule
from skyrl_sim_plugins.sim.reference.caching_allocator import cuda_oom_message


def device_kind(endpoint: Endpoint, model: ModelArch | None = None) -> str:
    """The torch device type whose kernels run the endpoint's trainer: its hardware profile's ``device``."""
    return profile_device(endpoint.hardware.profile)


def allocator_kind(endpoint: Endpoint, model: ModelArch | None = None) -> str:
    """Which allocator the endpoint's trainer runs: the device type, and on CUDA whether its workers use expandable
    segments (``trainer.use_expandable_segments``, else the SkyRL version's default): ``cuda-classic`` when not."""
    kind = device_kind(endpoint, model)
    if kind == "cuda" and not endpoint.trainer.expandable_segments(endpoint.rules):
        return "cuda-classic"
    return kind


ALLOCATORS: Axis[AllocatorRule] = Axis("allocator", allocator_kind)
"""The allocator axis: how a device hands out its memory, picked by the device type and SkyRL's flag (``cuda``:
PyTorch's CUDA caching allocator with expandable segments, ``cuda-classic``: without them, ``cpu``: the CPU
allocator's exact bytes)."""
ALLOCATORS.register("cuda", CUDA_CACHING)
ALLOCATORS.register("cuda-classic", CUDA_CLASSIC)
ALLOCATORS.register("cpu", CPU_EXACT)


def oom_message(
    attempted: int, allocated: int, reserved: int, endpoint: Endpoint, device: DeviceMemory, other_process: int = 0
) -> str:
    """PyTorch's wording: the CUDA caching allocator's message about ``device`` (its total, and the process's memory
    in use: its non-PyTorch reserve and what the allocator reserved; ``other_process``: what another process on the
    device holds), or the CPU allocator's on a ``cpu`` profile."""
    if profile_device(endpoint.hardware.profile) == "cpu":
        return cpu_oom_message(attempted)
    in_use = device.reserve_bytes + reserved
    return cuda_oom_message(attempted, device.total_bytes, in_use, allocated, reserved, other_process)


def endpoint_allocator(endpoint: Endpoint) -> AllocatorRule:
    """How the allocator of the endpoint's device sizes a request: the option of the allocator axis the endpoint
    picks (``ALLOCATORS``)."""
    return ALLOCATORS.choose(endpoint)

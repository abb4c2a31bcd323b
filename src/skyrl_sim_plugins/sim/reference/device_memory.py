"""The endpoint's device as a memory model sees it: how its allocator sizes a request (``endpoint_allocator``: the
CUDA caching allocator's rounding, or the CPU allocator's exact bytes) and how PyTorch words running out of it
(``oom_message``).

Read by the walk (its failing allocation), by vLLM's start-up on a device it shares with the trainer
(``service.colocation``) and by whatever rounds a size as the device does.
"""

from __future__ import annotations

from skyrl_sim.api import GIB, Endpoint, cpu_oom_message, profile_device
from skyrl_sim_plugins.sim.reference.allocator import AllocatorRule, allocator_rule
from skyrl_sim_plugins.sim.reference.caching_allocator import cuda_oom_message


def oom_message(attempted: int, allocated: int, reserved: int, endpoint: Endpoint) -> str:
    """PyTorch's wording: the CUDA caching allocator's message, or the CPU allocator's on a ``cpu`` profile."""
    if profile_device(endpoint.hardware.profile) == "cpu":
        return cpu_oom_message(attempted)
    total_gib = endpoint.memory_limit_gib if endpoint.memory_limit_gib is not None else endpoint.hardware.device_memory_gib
    in_use = endpoint.hardware.reserve_gib * GIB + reserved
    return cuda_oom_message(attempted, total_gib * GIB, in_use, allocated, reserved)


def endpoint_allocator(endpoint: Endpoint) -> AllocatorRule:
    """How the allocator of the endpoint's device sizes a request: CUDA's caching rule, or the CPU's exact bytes."""
    return allocator_rule(profile_device(endpoint.hardware.profile) == "cuda")

"""A run's choices, made once when it binds its models: the ``Binding`` both bound models (memory and time) hold.

A simulated run is modelled along the axes a user chooses (``description.axes``): the card (a hardware profile is
data), the allocator (how the card's memory is handed out), and, as they become registries, the model family, the
trainer and the vLLM version. ``Binding.of`` makes every choice for one endpoint and model, once, and the device
memory a call may use is given in bytes (``DeviceMemory``): the bound models answer every call of the run from it,
and nothing downstream recognises the endpoint again or rewrites a user setting to pass a number along.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_sim.api import DeviceMemory, Endpoint, HardwareProfile, ModelArch, load_profile
from skyrl_sim_plugins.sim.reference.allocator import AllocatorRule
from skyrl_sim_plugins.sim.reference.device_memory import ALLOCATORS


@dataclass(frozen=True)
class Binding:
    """One endpoint and model with what they chose on each axis.

    ``card``: the endpoint's hardware profile; ``allocator``: the allocator axis's option (``ALLOCATORS``);
    ``device``: the device memory a call may use when nothing else is on the device (``DeviceMemory.of``: a call
    may be walked on less, a colocated vLLM asleep keeping its share)."""

    endpoint: Endpoint
    model: ModelArch
    card: HardwareProfile
    allocator: AllocatorRule
    device: DeviceMemory

    @classmethod
    def of(cls, endpoint: Endpoint, model: ModelArch) -> Binding:
        """Every choice of ``endpoint`` and ``model``, made now."""
        return cls(
            endpoint=endpoint,
            model=model,
            card=load_profile(endpoint.hardware.profile),
            allocator=ALLOCATORS.choose(endpoint, model),
            device=DeviceMemory.of(endpoint),
        )

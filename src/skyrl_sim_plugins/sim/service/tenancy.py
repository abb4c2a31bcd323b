"""The simulator's adapter store: host memory per model id and the time of each adapter swap.

What the device holds does not change with the number of tenants: the memory walk counts the base and one adapter
set with its state (``static_memory.static_bytes``), which is the live adapter. What the tenants add is host memory and time
(``skyrl_sim.engine.tenancy`` says when each happens; this module prices it):

- **A slot** per registered model id, plus the pristine slot, mirrors the live adapter's state on one worker: the LoRA
  parameters (the adapter dtype), their fp32 gradient buffer, and the distributed optimizer's fp32 main copy (16-bit
  adapters only) and two Adam moments, sharded over data parallelism (``static_memory.trainable_state_bytes``, with the
  optimizer state counted even when ``optimizer_offload`` keeps it off the device: the slot holds it either way).
- **A swap** copies a slot's bytes device to host (the live adapter into its owner's slot; skipped when the live state
  is pristine or stale) and host to device (the target's slot into the live state), each at the profile's
  ``host_bandwidth`` (PCIe or NVLink-C2C on a GPU; a memory copy on a CPU) times ``efficiency.host``, split between the
  devices when the profile's peaks are the machine's, plus ``overheads.swap_s`` (barriers and stream syncs).
- **A create_model** that only registers an adapter costs ``overheads.register_adapter_s`` plus one slot's copy from
  the pristine slot; the one that builds the runtime costs the time model's ``create_model`` (the base weights' load).

Only the Megatron strategy keeps an adapter store (SkyRL's FSDP and JAX backends do not swap): other strategies get
no registry, no swaps and no host slots here.
"""

from __future__ import annotations

from typing import Any

from skyrl_sim.api import (
    GIB,
    AdapterRegistry,
    Endpoint,
    HardwareProfile,
    ModelArch,
    Swap,
    load_profile,
    lora_signature,
    stage_layers,
)
from skyrl_sim_plugins.sim.bound.cache import BoundedCache
from skyrl_sim_plugins.sim.reference.static_memory import lora_params_per_rank, trainable_state_bytes

STORE_STRATEGIES = frozenset({"megatron"})
SWAP_RECORDS = 4096
"""Swap records a run's adapter store keeps (one per pair of tenants it swapped between)."""
"""The trainer strategies whose workers keep SkyRL's adapter store."""


def slot_bytes(model: ModelArch, endpoint: Endpoint) -> int:
    """One adapter slot on one worker: the live adapter's state as the device holds it, optimizer state included."""
    params = lora_params_per_rank(model, endpoint, stage_layers(model, endpoint))
    if not endpoint.lora.targets:
        return 0
    if endpoint.trainer.optimizer_offload:  # the slot holds the optimizer state wherever the live one is kept
        trainer = endpoint.trainer.model_copy(update={"optimizer_offload": False})
        endpoint = endpoint.model_copy(update={"trainer": trainer})
    return trainable_state_bytes(params, endpoint, endpoint.lora.dtype)


def host_rate(profile: HardwareProfile, endpoint: Endpoint) -> float:
    """Bytes/s one copy between a slot and the live state reaches on one worker."""
    return profile.bytes_host * profile.share(endpoint.hardware.devices)


def swap_seconds(swap: Swap, slot: int, rate: float, profile: HardwareProfile) -> float:
    """A swap's time: its slot-sized copies (one or two) over the host link (``rate``: ``host_rate``), plus the fixed
    part."""
    return swap.copies * slot / rate + profile.overheads.swap_s


def register_seconds(slot: int, rate: float, profile: HardwareProfile) -> float:
    """A create_model that registers an adapter: the fixed part and the pristine slot's copy into the new one (over
    the host link, ``rate``: ``host_rate``)."""
    return profile.overheads.register_adapter_s + slot / rate


class SimAdapterStore:
    """The registry of one run's model ids with the sizes and times above (None as ``registry`` when the strategy
    keeps no store)."""

    def __init__(self, endpoint: Endpoint, model: ModelArch) -> None:
        self.endpoint = endpoint
        self.profile = load_profile(endpoint.hardware.profile)
        self.rate = host_rate(self.profile, endpoint)  # the run's host link, once (a run swaps on most calls)
        self.slot_bytes = slot_bytes(model, endpoint)
        tenancy = endpoint.tenancy
        limit = int(tenancy.host_memory_gib * GIB) if tenancy.host_memory_gib is not None else None
        self.registry: AdapterRegistry | None = None
        # a swap's record by what it saved and restored: the same pair always costs the same, and a long run swaps
        # between a few tenants millions of times (every record is read, never changed)
        self._records: BoundedCache[tuple[str | None, str], dict[str, Any]] = BoundedCache(SWAP_RECORDS)
        if endpoint.trainer.strategy in STORE_STRATEGIES:
            signature = lora_signature(endpoint.lora.rank, endpoint.lora.alpha)
            keep = tenancy.keep_runtime_warm_on_last_unload
            self.registry = AdapterRegistry(signature, self.slot_bytes, host_limit_bytes=limit, keep_warm=keep)

    def swap(self, kind: str, model_id: str | None) -> dict[str, Any] | None:
        """The swap before a ``kind`` call of ``model_id`` as a call's ``extra["swap"]`` (None: no swap)."""
        if self.registry is None:
            return None
        swap = self.registry.swap_for(kind, model_id)
        if swap is None:
            return None
        key = (swap.saved, swap.restored)
        record = self._records.get(key)
        if record is None:
            seconds = swap_seconds(swap, self.slot_bytes, self.rate, self.profile)
            record = self._records.put(key, swap.record(self.slot_bytes, seconds))
        return record

    def start(self, model_ids: list[str]) -> None:
        """The models loaded when the run starts (``TenantStore.start``)."""
        if self.registry is not None:
            self.registry.start(model_ids)

    def register_seconds(self) -> float:
        return register_seconds(self.slot_bytes, self.rate, self.profile)

    def report(self) -> dict[str, Any]:
        """``TenantStore.report``: one slot's bytes and the most the slots held at once, per worker."""
        if self.registry is None:
            return {}
        return {"slot_bytes": self.slot_bytes, "host_bytes_peak": self.registry.host_bytes_peak}

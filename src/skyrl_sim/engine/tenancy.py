"""SkyRL's multi-tenant rules: one base model per worker, one live LoRA adapter, a host slot per model id.

SkyRL 0.4.0 serves many LoRA models on one base model (``skyrl/backends/skyrl_train/workers/megatron/adapter_store.py``,
``worker_dispatch.py``, ``skyrl_train_backend.py``):

- **Runtime.** The first ``create_model`` builds the runtime (workers, base weights, the first adapter and its
  optimizer). Later ones only register an adapter: a host slot seeded from the *pristine* slot (the adapter as it was
  built, before any step). A LoRA signature (rank, alpha) that differs from the first model's is refused.
  ``unload_model`` frees the model's slot; the last one tears the runtime down unless
  ``keep_runtime_warm_on_last_unload`` (SkyRL's default: keep it).
- **Slots.** Each registered model id has a host slot holding its LoRA parameters, gradient buffer, fp32 main copy and
  Adam moments; the pristine slot is one more. The device holds the base and the *live* adapter with its state.
- **Swaps.** Before every per-model operation (forward, forward_backward, optim_step, save_weights_for_sampler,
  save_weights, load_weights) of a model id that is not live, ``ensure_active_adapter`` swaps: the live state is
  copied into the current model's slot (device to host), then the target's slot into the live state (host to device),
  with ``tensor.copy_()``. Unloading the live model leaves the live state stale: the next swap only restores.
  Gradients travel with the slot, so a tenant's gradients survive other tenants' calls until its ``optim_step``.

The rules are written once here and every backend calls them: the simulator prices what ``AdapterRegistry`` says
happens, the real backend's workers do it and report what they did, so the two can only differ in what a swap costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from skyrl_sim.engine.frozen import quick_init
from skyrl_sim.units import format_size

SWAPPING_KINDS: frozenset[str] = frozenset(
    {"forward_backward", "forward", "optim_step", "save_weights_for_sampler", "save_weights", "load_weights"}
)
"""The per-model operations before which SkyRL makes the model's adapter live (``ensure_active_adapter``)."""

Signature = tuple[int, int]
"""A LoRA signature as SkyRL compares them: ``(int(rank), int(alpha))`` (``_lora_signature_from``)."""


class TenancyError(Exception):
    """A ``create_model`` the service refuses; the message is the service's."""


def lora_signature(rank: int, alpha: float) -> Signature:
    """SkyRL's signature of a LoRA config: rank and alpha as integers (Tinker's alpha is a float)."""
    return (int(rank), int(alpha))


def signature_mismatch_error(model_id: str, got: Signature, first: Signature) -> str:
    """SkyRL's text when a ``create_model`` names another LoRA signature than the first model's."""
    return (
        f"LoRA signature mismatch for model '{model_id}': "
        f"got (rank, alpha)={got}, "
        f"first adapter registered with {first}. "
        "Multi-LoRA with the SkyRLTrainBackend requires identical (rank, alpha) across all "
        "adapters; target_modules is fixed server-side."
    )


def already_exists_error(model_id: str) -> str:
    """SkyRL's text for a ``create_model`` of a model id that is registered."""
    return f"Model '{model_id}' already exists"


def host_memory_error(model_id: str, slots: int, slot_bytes: int, limit_bytes: int) -> str:
    """The failure of a ``create_model`` whose slot does not fit in the worker's host memory."""
    return (
        f"create_model {model_id}: host memory per worker exhausted: {slots} adapter slots (the pristine slot "
        f"included) of {format_size(slot_bytes)} need {format_size(slots * slot_bytes)}, over "
        f"tenancy.host_memory_gib ({format_size(limit_bytes)})"
    )


class TenantStore(Protocol):
    """A call executor's adapter store, as the run driver sees it (``executor.tenants``; optional)."""

    def start(self, model_ids: list[str]) -> None:
        """Register the models loaded when the run starts, in order (the first one's adapter is live). Raises
        TenancyError when they do not fit."""
        ...

    def report(self) -> dict[str, Any]:
        """The store's host memory per worker: ``slot_bytes`` (one slot) and ``host_bytes_peak`` (the most the slots
        held at once, the pristine slot included); empty when the backend keeps no store."""
        ...


@quick_init
@dataclass(frozen=True, slots=True)  # one per swap, and a long run swaps on most calls
class Swap:
    """One adapter swap: the live adapter saved to ``saved``'s slot (None when the live state mirrors no registered
    model: a fresh runtime's pristine state, or an unloaded model's stale state) and ``restored``'s slot made live."""

    saved: str | None
    restored: str

    @property
    def copies(self) -> int:
        """How many slot-sized copies the swap makes: device to host (when saving) and host to device."""
        return 2 if self.saved is not None else 1

    def record(self, slot_bytes: int, seconds: float) -> dict[str, Any]:
        """The swap as a call records it (``CallRecord.extra["swap"]``): what was saved and restored, the bytes copied
        both ways (``copies`` slots of ``slot_bytes``), and the seconds it took (modelled or measured)."""
        return {"saved": self.saved, "restored": self.restored, "bytes": self.copies * slot_bytes, "seconds": seconds}


@dataclass
class AdapterRegistry:
    """Which model ids hold a host slot on a worker, which one is live, whether the runtime is up.

    ``slot_bytes`` is one slot's size on one worker (the backend's: modelled or measured); ``host_limit_bytes`` the
    worker's host memory for slots (None: unlimited). Registered ids keep their registration order."""

    signature: Signature
    slot_bytes: int = 0
    host_limit_bytes: int | None = None
    keep_warm: bool = True
    registered: list[str] = field(default_factory=list)
    live: str | None = None
    stale: bool = False
    runtime_up: bool = False
    host_bytes_peak: int = 0

    @property
    def host_bytes(self) -> int:
        """Host memory the slots hold now: one per registered model plus the pristine slot, while the runtime is up."""
        return (len(self.registered) + 1) * self.slot_bytes if self.runtime_up else 0

    def start(self, model_ids: list[str]) -> None:
        """The models loaded when the run starts (the runtime is up when there is one). Raises TenancyError when
        their slots do not fit in host memory."""
        for model_id in model_ids:
            self.create(model_id, self.signature)

    def create(self, model_id: str, signature: Signature) -> str:
        """Register ``model_id``: ``"runtime"`` when this builds the runtime, ``"adapter"`` when it only adds a slot.
        Raises TenancyError with the service's text when SkyRL refuses it."""
        if model_id in self.registered:
            raise TenancyError(already_exists_error(model_id))
        if signature != self.signature:
            raise TenancyError(signature_mismatch_error(model_id, signature, self.signature))
        slots = len(self.registered) + 2  # with this one and the pristine slot
        if self.host_limit_bytes is not None and slots * self.slot_bytes > self.host_limit_bytes:
            raise TenancyError(host_memory_error(model_id, slots, self.slot_bytes, self.host_limit_bytes))
        built = not self.runtime_up
        if built:
            self.runtime_up, self.live, self.stale = True, None, False
        if self.live is None and not self.stale:
            self.live = model_id  # the live state is pristine: it becomes this model's, nothing is copied
        self.registered.append(model_id)
        self.host_bytes_peak = max(self.host_bytes_peak, self.host_bytes)
        return "runtime" if built else "adapter"

    def unload(self, model_id: str) -> str | None:
        """Free ``model_id``'s slot: ``"adapter"``, ``"runtime"`` when the last one tears the runtime down, or None
        when it is not registered (SkyRL ignores it)."""
        if model_id not in self.registered:
            return None
        self.registered.remove(model_id)
        if self.live == model_id:
            self.live, self.stale = None, True
        if not self.registered and not self.keep_warm:
            self.runtime_up, self.live, self.stale = False, None, False
            return "runtime"
        return "adapter"

    def swap_for(self, kind: str, model_id: str | None) -> Swap | None:
        """The swap SkyRL makes before a ``kind`` operation of ``model_id`` (None: none is needed), and it is made."""
        if kind not in SWAPPING_KINDS or model_id is None or model_id == self.live or model_id not in self.registered:
            return None
        swap = Swap(self.live, model_id)
        self.live, self.stale = model_id, False
        return swap

"""The real backend's adapter store: many model ids on one base model, one live adapter, a host slot per model id.

As SkyRL 0.4.0's ``AdapterStore`` (``skyrl/backends/skyrl_train/workers/megatron/adapter_store.py``) does on each
Megatron worker: the live adapter's state is the ``LoraModel``'s own tensors (the LoRA parameters, their gradient
buffers, fp32 master copies for 16-bit adapters, Adam's moments and step counts); every registered model id has a
slot of tensors of the same shapes in host memory, and one more *pristine* slot keeps the adapter as it was built, to
seed new models. ``swap_to`` copies the live state into the current model's slot and the target's slot into the live
state (``tensor.copy_()``, no new storage), so the gradients a tenant accumulated survive other tenants' calls until
its ``optim_step``. Which swap happens when is ``skyrl_sim.engine.tenancy.AdapterRegistry``'s rule, the one the
simulator prices.

Host memory: slots live on the CPU (pinned on CUDA, as SkyRL pins them); they are never handed to the memory meter,
which counts only what the device holds (the base, the live adapter and its state). On a CPU worker host and device
are the same memory, but the meter keeps them apart as a GPU does.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from skyrl_sim.api import AdapterRegistry, Signature


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like ``tensor``: pinned when a CUDA device exists (a fast, asynchronous copy)."""
    host = torch.empty_like(tensor, device="cpu")
    return host.pin_memory() if torch.cuda.is_available() else host


class AdapterStore:
    """Host slots of one worker's model ids around one live adapter (see the module docstring)."""

    def __init__(
        self, live: list[torch.Tensor], signature: Signature, host_limit_bytes: int | None, keep_warm: bool
    ) -> None:
        self.live = live
        self.pristine = self._new_slot()
        self._copy(self.live, self.pristine)
        self.slots: dict[str, list[torch.Tensor]] = {}
        self.registry = AdapterRegistry(
            signature, self.slot_bytes, host_limit_bytes=host_limit_bytes, keep_warm=keep_warm
        )

    @property
    def slot_bytes(self) -> int:
        """One slot's bytes (every slot, the pristine one included, has the live state's tensors)."""
        return sum(t.untyped_storage().nbytes() for t in self.pristine)

    @property
    def host_bytes(self) -> int:
        """What the slots hold in host memory now: the registered ones and the pristine one."""
        return self.slot_bytes * (len(self.slots) + 1)

    def _new_slot(self) -> list[torch.Tensor]:
        return [_host_like(t) for t in self.live]

    @staticmethod
    def _copy(source: list[torch.Tensor], target: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for into, value in zip(target, source, strict=True):
                into.copy_(value, non_blocking=into.is_cuda or value.is_cuda)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the copies into pinned memory have landed

    def create(self, model_id: str, signature: Signature) -> str:
        """Register ``model_id`` (``AdapterRegistry.create``'s answer; raises ``TenancyError`` as it does). A fresh
        runtime's first model owns the live state, which is pristine; any other gets a slot seeded from pristine."""
        kind = self.registry.create(model_id, signature)
        slot = self._new_slot()
        if self.registry.live != model_id:
            self._copy(self.pristine, slot)
        self.slots[model_id] = slot
        if kind == "runtime":
            self._copy(self.pristine, self.live)  # a rebuilt runtime starts from the adapter as it was built
        return kind

    def unload(self, model_id: str) -> str | None:
        """Free ``model_id``'s slot (``AdapterRegistry.unload``'s answer)."""
        kind = self.registry.unload(model_id)
        self.slots.pop(model_id, None)
        return kind

    def swap_to(self, kind: str, model_id: str) -> dict[str, Any] | None:
        """Make ``model_id`` live before a ``kind`` operation, if the rule says so: what was swapped, its bytes both
        ways and its seconds (None when no swap was needed)."""
        swap = self.registry.swap_for(kind, model_id)
        if swap is None:
            return None
        start = time.perf_counter()
        if swap.saved is not None:
            self._copy(self.live, self.slots[swap.saved])
        self._copy(self.slots[swap.restored], self.live)
        return swap.record(self.slot_bytes, time.perf_counter() - start)

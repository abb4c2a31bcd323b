"""Peak memory of one call on a worker, and real out-of-memory failures.

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (everything the caching allocator hands
out, parameters included). A memory limit below the card is applied with ``set_per_process_memory_fraction``.

CPU: ``LiveTensorMeter`` counts exactly the bytes of live tensor storages. At the start it counts the storages the
worker holds (parameters, gradients, Adam state: the baseline, each storage once). During the call a
``TorchDispatchMode`` sees every aten op's outputs; each storage not seen before adds its ``nbytes`` and gets a
finaliser that subtracts them when the storage dies. The peak is baseline + the highest running total. Not counted:
scratch memory inside kernels that never becomes a tensor, and allocator or Python-object overhead.
A limit is applied with ``RLIMIT_AS`` relative to the rank's VmSize after imports (the same headroom on every rank, so
all TP ranks fail at the same allocation); PyTorch's allocator then raises
``... you tried to allocate N bytes`` and the worker carries on with the next call. Address space that no tensor holds
counts against that limit too, so the workers are started with what keeps it flat (``workers.WorkerGroup``: few malloc
arenas, no oneDNN primitive cache), and the limit is re-based before every call (``rebase_memory_limit``).
"""

from __future__ import annotations

import re
import resource
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ATTEMPT = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)
CUDA_ATTEMPT = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def attempted_bytes(message: str) -> int | None:
    """The size of the failing allocation in PyTorch's OOM text (CPU: exact bytes; CUDA: rounded GiB/MiB)."""
    match = ATTEMPT.search(message)
    if match:
        return int(match.group(1))
    match = CUDA_ATTEMPT.search(message)
    if match:
        return int(float(match.group(1)) * _UNITS[match.group(2)])
    return None


def is_oom(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text.lower()


def process_buffers() -> list[torch.Tensor]:
    """The tensors megatron-core's process-wide ``GlobalMemoryBuffer`` holds (grown by earlier calls, never freed):
    memory a call finds held, like the model's own state. Empty before megatron's parallel state exists."""
    try:
        from megatron.core import parallel_state

        buffer = parallel_state.get_global_memory_buffer()
    except (ImportError, AssertionError, AttributeError):
        return []
    return [t for t in getattr(buffer, "buffer", {}).values() if isinstance(t, torch.Tensor)]


def vm_size_bytes() -> int:
    """This process's virtual address space (``VmSize`` in /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def apply_memory_limit(limit_bytes: int | None) -> dict[str, int]:
    """Cap this rank's usable memory; returns what was set (for the worker's hello)."""
    if limit_bytes is None:
        return {}
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if limit_bytes < total:
            torch.cuda.set_per_process_memory_fraction(limit_bytes / total)
        return {"cuda_limit_bytes": min(limit_bytes, total)}
    base = vm_size_bytes()
    cap = base + limit_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return {"vm_size_bytes": base, "rlimit_as_bytes": cap}


def rebase_memory_limit(limit_bytes: int | None, held_bytes: int) -> None:
    """Before a call on CPU: ``limit_bytes`` again for tensors, on top of the address space the rank holds now that no
    tensor holds (``held_bytes``: the storages the call finds held). Address space that earlier calls left behind
    without a tensor (malloc arenas and heap, kernel caches) then cannot eat into the limit, which stands for tensor
    memory as the simulator models it; it varied between runs and CPU models. On CUDA the device's limit stays."""
    if limit_bytes is None or torch.cuda.is_available():
        return
    cap = vm_size_bytes() - held_bytes + limit_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))


class LiveTensorMeter(TorchDispatchMode):
    """Exact live tensor storage bytes on CPU over one call (see the module docstring for what is counted)."""

    def __init__(self, held: Iterable[torch.Tensor], log: list[tuple[str, int, int]] | None = None) -> None:
        super().__init__()
        self.log = log  # when given: (op name, +bytes on allocation / -bytes on free, running total) per event
        self._live: dict[int, int] = {}
        self.baseline = 0
        for tensor in held:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._live:
                # counted in the baseline; a held storage that dies during the call (megatron's global buffer when it
                # grows) takes its bytes off the running total
                self._live[ptr] = storage.nbytes()
                self.baseline += storage.nbytes()
                weakref.finalize(storage, self._free, ptr)
        self.current = 0
        self.high = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                storage = leaf.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self._live:
                    size = storage.nbytes()
                    self._live[ptr] = size
                    self.current += size
                    self.high = max(self.high, self.current)
                    weakref.finalize(storage, self._free, ptr)
                    if self.log is not None:
                        self.log.append((str(func), size, self.current))
        return out

    def _free(self, ptr: int) -> None:
        size = self._live.pop(ptr, 0)
        self.current -= size
        if self.log is not None and size:
            self.log.append(("free", -size, self.current))

    @property
    def peak_bytes(self) -> int:
        return self.baseline + self.high


class CallMemory:
    """Context for one call: resets/reads the CUDA peak, or runs a ``LiveTensorMeter`` on CPU."""

    def __init__(self, held: Iterable[torch.Tensor]) -> None:
        self.cuda = torch.cuda.is_available()
        self.meter: LiveTensorMeter | None = None if self.cuda else LiveTensorMeter(held)
        self.peak_bytes = 0

    def __enter__(self) -> CallMemory:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.meter is not None:
            self.meter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
        elif self.meter is not None:
            self.meter.__exit__(*exc)
            self.peak_bytes = self.meter.peak_bytes

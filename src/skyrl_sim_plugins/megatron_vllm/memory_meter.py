"""Peak memory of one call on a worker, and real out-of-memory failures.

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (everything the caching allocator hands
out, parameters included). A memory limit below the card is applied with ``set_per_process_memory_fraction``.

CPU: ``LiveTensorMeter`` counts exactly the bytes of live tensor storages, and is also the memory limit. At the start
it counts the storages the worker holds (parameters, gradients, Adam state, megatron's persistent global buffer: the
baseline, each storage once). During the call a ``TorchDispatchMode`` sees every aten op's outputs; each storage not
seen before adds its ``nbytes`` and gets a finaliser that subtracts them when the storage dies. The peak is baseline +
the highest running total.

With a limit (``limit_bytes``: the endpoint's capacity), an op whose new storages would take baseline + live total
above it is refused, as a device allocator refuses the allocation: its outputs are dropped (their memory returns at
once) and ``torch.OutOfMemoryError`` is raised with the CPU allocator's wording and the size of the first output that
does not fit (``oom_message``). Every TP rank holds the same shards and makes the same tensors, so every rank refuses
at the same op and they fail together, before any collective can wait on a rank that failed. The verdict depends only
on tensor sizes, never on the process's address space (malloc arenas, heap not returned, thread stacks, kernel caches),
so it is the same on every machine and under any load.

What the meter cannot see: scratch memory inside a kernel that never becomes a tensor (oneDNN/MKL workspaces, the
flash kernel's tiles), allocator and Python-object overhead. The simulator's walk on a ``cpu`` profile has the same
scope: tensor storages at their exact size, no caching allocator (``sim.allocator.CPU_EXACT``), no kernel workspaces.

``RLIMIT_AS`` is kept only as a backstop against a runaway process (``BACKSTOP_BYTES`` above the tensor limit, on top
of the rank's address space after warm-up): it never decides a verdict the tensor limit would not.
"""

from __future__ import annotations

import gc
import resource
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from skyrl_sim.api import GIB, cpu_oom_message, is_oom_text
from skyrl_sim_plugins.megatron_vllm.failure_site import refusal_site

# The backstop's distance above the tensor limit: far beyond anything kernel scratch, malloc arenas and caches add over
# a run, so it only ever stops a runaway process (the tensor limit decides every verdict).
BACKSTOP_BYTES = 8 * GIB


UNSETTLED = frozenset({"send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_"})
"""c10d ops ``settle_collective`` leaves alone: point-to-point transfers (a pipeline stage waits on them itself, and its
peer runs other ops meanwhile) and barriers (nothing of the caller's is held)."""


def single_worker_gloo() -> None:
    """Make every gloo process group this process creates run its collectives on one worker thread (gloo's default
    is two), before ``init_process_group``: with one thread in order, a fence after a collective returns only once
    that thread is done with the collective (``settle_collective``)."""
    from torch.distributed import ProcessGroupGloo
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d.ProcessGroupGloo, "single_worker", False):
        return

    class SingleWorkerGloo(ProcessGroupGloo):  # type: ignore[misc]
        single_worker = True

        def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_default_device()]
            options._threads = 1
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SingleWorkerGloo


def settle_collective(out: Any, inputs: Any) -> None:
    """Let a finished collective's worker thread let go of its tensors before the caller goes on.

    gloo runs a collective on a worker thread, which drops its hold on the collective's tensors only after telling
    the caller the collective completed. A tensor the caller has already dropped (a gather's output buffer once its
    rows are copied out) would be freed by that thread at whatever moment the scheduler lets it, before or after the
    caller's next ops, so a call's peak would depend on the machine's load. Waiting for the collective, then for a
    fence queued behind it on the same group (``single_worker_gloo``: one thread, in order), every rank of the group
    goes on only once the worker is done with it: each of its tensors is then freed where the caller drops it. The
    fence is a one-element all-reduce: a gloo barrier holds on to the work queued before it until the barrier itself
    is let go of, by the same worker thread."""
    import torch.distributed as dist

    for work in tree_leaves(out):
        if isinstance(work, torch.ScriptObject) and str(work._type()).endswith("c10d.Work"):
            dist.distributed_c10d.Work.unbox(work).wait()
    groups = [
        dist.ProcessGroup.unbox(arg)
        for arg in tree_leaves(inputs)
        if isinstance(arg, torch.ScriptObject) and str(arg._type()).endswith("c10d.ProcessGroup")
    ]
    for group in groups[:1]:  # a fence, not a barrier: gloo's barrier keeps the work before it alive
        group.allreduce([torch.zeros(1)]).wait()


def is_oom(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return is_oom_text(str(error))


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
    """Cap this rank's usable memory; returns what was set (for the worker's hello).

    CUDA: the device's own allocator fails beyond the limit (``set_per_process_memory_fraction``). CPU: the tensor limit
    is the ``LiveTensorMeter`` of each call; here only the ``RLIMIT_AS`` backstop is set, ``BACKSTOP_BYTES`` above the
    limit on top of the address space the rank holds after warm-up."""
    if limit_bytes is None:
        return {}
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if limit_bytes < total:
            torch.cuda.set_per_process_memory_fraction(limit_bytes / total)
        return {"cuda_limit_bytes": min(limit_bytes, total)}
    base = vm_size_bytes()
    cap = base + limit_bytes + BACKSTOP_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return {"tensor_limit_bytes": limit_bytes, "vm_size_bytes": base, "rlimit_as_backstop_bytes": cap}


def apply_allocator_settings(text: str) -> dict[str, str]:
    """Set the CUDA caching allocator's settings after the model is loaded, as SkyRL's ``Worker._set_expandable_segments``
    does (the weights stay in classic segments; later allocations follow the settings); returns what was set (for the
    worker's hello). Nothing on CPU: its allocator has no segments."""
    if not torch.cuda.is_available():
        return {}
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        torch._C._accelerator_setAllocatorSettings(text)
    else:
        torch.cuda.memory._set_allocator_settings(text)
    return {"cuda_allocator_settings": text}


class LiveTensorMeter(TorchDispatchMode):
    """Exact live tensor storage bytes on CPU over one call, and the call's tensor limit (see the module docstring)."""

    def __init__(
        self,
        held: Iterable[torch.Tensor],
        log: list[tuple[str, int, int]] | None = None,
        limit_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.log = log  # when given: (op name, +bytes on allocation / -bytes on free, running total) per event
        self.limit_bytes = limit_bytes
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
        self.refusal: dict[str, Any] | None = None  # what was refused (``failure_site.refusal_site``)
        self._collector_was_on = True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and func._opname not in UNSETTLED:
            settle_collective(out, (args, kwargs))
        made = self._new_storages(out)
        if made and self.limit_bytes is not None:
            refused = self._first_refused(made)
            if refused is not None:
                self.refusal = refusal_site(func, refused)
                size = refused.untyped_storage().nbytes()
                del out, made, refused  # the op's outputs die here: their memory is back before the error travels up
                raise torch.OutOfMemoryError(cpu_oom_message(size))
        for ptr, storage, _ in made:
            size = storage.nbytes()
            self._live[ptr] = size
            self.current += size
            self.high = max(self.high, self.current)
            weakref.finalize(storage, self._free, ptr)
            if self.log is not None:
                self.log.append((str(func), size, self.current))
        return out

    def __enter__(self) -> LiveTensorMeter:
        # Python's cycle collector runs when enough objects have been allocated since its last run, a count that
        # earlier code and other threads move: a tensor held in a reference cycle would be freed at a different op
        # of the call from run to run. Collected before the call and paused during it, such a tensor is freed at
        # the call's end on every run.
        gc.collect()
        self._collector_was_on = gc.isenabled()
        gc.disable()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._collector_was_on:
                gc.enable()

    def _new_storages(self, out: Any) -> list[tuple[int, torch.UntypedStorage, torch.Tensor]]:
        """The storages among an op's outputs that no earlier op made (in output order, each once), with the output
        tensor that holds each."""
        made: list[tuple[int, torch.UntypedStorage, torch.Tensor]] = []
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                storage = leaf.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self._live and all(ptr != seen for seen, _, _ in made):
                    made.append((ptr, storage, leaf))
        return made

    def _first_refused(self, made: list[tuple[int, torch.UntypedStorage, torch.Tensor]]) -> torch.Tensor | None:
        """The first new output whose storage takes baseline + live total above the limit, as an allocator serving
        the op's outputs one after another would refuse it; None when all of them fit."""
        assert self.limit_bytes is not None
        total = self.baseline + self.current
        for _, storage, leaf in made:
            total += storage.nbytes()
            if total > self.limit_bytes:
                return leaf
        return None

    def _free(self, ptr: int) -> None:
        size = self._live.pop(ptr, 0)
        self.current -= size
        if self.log is not None and size:
            self.log.append(("free", -size, self.current))

    @property
    def peak_bytes(self) -> int:
        return self.baseline + self.high


class CallMemory:
    """Context for one call: resets/reads the CUDA peak, or runs a ``LiveTensorMeter`` (with the tensor limit) on CPU."""

    def __init__(self, held: Iterable[torch.Tensor], limit_bytes: int | None = None) -> None:
        self.cuda = torch.cuda.is_available()
        self.meter: LiveTensorMeter | None = None if self.cuda else LiveTensorMeter(held, limit_bytes=limit_bytes)
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

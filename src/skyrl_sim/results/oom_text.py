"""PyTorch's out-of-memory wording, written once for the backends that raise or log it and the models that predict it.

PyTorch's CPU allocator (``c10::alloc_cpu``) reports a failed ``posix_memalign`` as ``DefaultCPUAllocator: can't
allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)``. The real backend's CPU
tensor limit raises exactly this text, and the simulator writes it for a ``cpu`` profile, so a comparison reads the
attempted size from both the same way. The CUDA caching allocator writes ``CUDA out of memory. Tried to allocate
9.08 GiB. ...`` (the size rounded to two decimals); XLA writes ``RESOURCE_EXHAUSTED``. A service's database and log
hold these texts, which ``import`` and ``replay`` read with the same rules.
"""

from __future__ import annotations

import re

CPU_ATTEMPT = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)
CUDA_ATTEMPT = re.compile(r"Tried to allocate ([\d.]+) ?(GiB|MiB|KiB|B)\b")
ATTEMPT_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
OOM_MARKERS: tuple[str, ...] = ("out of memory", "outofmemoryerror", "resource_exhausted", "can't allocate memory")
"""Failure texts that report running out of memory: PyTorch's CUDA and CPU allocators, XLA's (case-insensitive)."""


def cpu_oom_message(attempted_bytes: int) -> str:
    """The CPU allocator's message for an allocation of ``attempted_bytes`` that cannot be served."""
    return (
        f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {attempted_bytes} bytes. "
        "Error code 12 (Cannot allocate memory)"
    )


def is_oom_text(error: str | None) -> bool:
    """Whether a failure text reports running out of memory (any of ``OOM_MARKERS``)."""
    return error is not None and any(marker in error.lower() for marker in OOM_MARKERS)


def attempted_bytes(message: str) -> int | None:
    """The size of the failing allocation in an OOM text (CPU: exact bytes; CUDA: the rounded GiB/MiB it prints);
    None when the text does not say."""
    match = CPU_ATTEMPT.search(message)
    if match:
        return int(match.group(1))
    match = CUDA_ATTEMPT.search(message)
    if match:
        return int(float(match.group(1)) * ATTEMPT_UNITS[match.group(2)])
    return None

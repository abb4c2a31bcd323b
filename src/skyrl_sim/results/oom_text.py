"""PyTorch's out-of-memory wording on CPU, written once for the backend that raises it and the model that predicts it.

PyTorch's CPU allocator (``c10::alloc_cpu``) reports a failed ``posix_memalign`` as ``DefaultCPUAllocator: can't
allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)``. The real backend's CPU
tensor limit raises exactly this text, and the simulator writes it for a ``cpu`` profile, so a comparison reads the
attempted size from both the same way.
"""

from __future__ import annotations

import re

CPU_ATTEMPT = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)


def cpu_oom_message(attempted_bytes: int) -> str:
    """The CPU allocator's message for an allocation of ``attempted_bytes`` that cannot be served."""
    return (
        f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {attempted_bytes} bytes. "
        "Error code 12 (Cannot allocate memory)"
    )

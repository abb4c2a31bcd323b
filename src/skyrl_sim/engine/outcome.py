"""What running one backend call gave (``CallOutcome``): what a ``CallExecutor`` and a ``Sampler`` hand back to the
engine loop (``loop``), which records it. Its own module, below both: the sampler returns one and the loop reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skyrl_sim.results.result import OomRecord


@dataclass(slots=True)  # one per call
class CallOutcome:
    """What running one call gave: its time, memory, failure, and results.

    ``wait_s`` is how far the clock must still advance for the call (its modelled duration in the simulator, 0 on
    real hardware where the time has already passed). ``metrics`` are the call's metrics (attached to every request
    of the call, as SkyRL does); ``outputs`` per request id; ``failed``: requests of the call that failed alone
    (a serial sample wave fails a request whose own sample failed), each with its error.
    """

    duration_s: float
    wait_s: float = 0.0
    peak_bytes: int | None = None
    oom: OomRecord | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    memory: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    fatal: bool = False
    failed: dict[int, str] = field(default_factory=dict)

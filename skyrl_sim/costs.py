"""The two cost questions a backend call raises, as interfaces: how much memory, and how long.

The simulator asks a ``MemoryModel`` and a ``TimeModel``; the real backend measures both. Keeping the questions
here lets either model be replaced (by a calibrated one, or a plugin's) without touching the engine loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from skyrl_sim.architecture import ModelArch
from skyrl_sim.endpoint import Endpoint
from skyrl_sim.result import OomRecord
from skyrl_sim.scenario import Request
from skyrl_sim.shapes import CallShape


@dataclass
class MemoryReport:
    """The memory walk of one call: its peak, what made the peak, and the failing allocation if capacity ran out.

    ``progress`` is the fraction of the call's work done when it failed (1.0 when it did not), so a failed call
    costs only the time it really ran.
    """

    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    oom: OomRecord | None = None
    progress: float = 1.0
    timeline: list[dict[str, Any]] = field(default_factory=list)


class MemoryModel(Protocol):
    def evaluate(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> MemoryReport: ...


class TimeModel(Protocol):
    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        """A forward_backward or forward call over these shapes."""
        ...

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        """One sampling call over these requests."""
        ...

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        """One single (optim_step, save_weights_for_sampler, ...)."""
        ...

"""Memory model of one backend call (placeholder until the allocation walk lands)."""

from __future__ import annotations

from skyrl_sim.architecture import ModelArch
from skyrl_sim.costs import MemoryReport
from skyrl_sim.endpoint import Endpoint
from skyrl_sim.shapes import CallShape


class AllocationWalk:
    """Walks a call's ops as allocations and frees and reports the peak."""

    def evaluate(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> MemoryReport:
        return MemoryReport(peak_bytes=0)


def default_memory_model() -> AllocationWalk:
    return AllocationWalk()

"""Cost models with fixed answers, for tests about scheduling and comparison rather than about memory or time."""

from __future__ import annotations

from skyrl_sim.plugin_host.costs import MemoryReport


class FixedCallTime:
    """Every batch call takes ``seconds``; singles take 10 ms."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def call_seconds(self, shape, endpoint, model) -> float:
        return self.seconds

    def sample_seconds(self, requests, endpoint, model) -> float:
        return self.seconds

    def single_seconds(self, request, endpoint, model) -> float:
        return 0.01


class FlatMemory:
    """Every call peaks at 1 MiB and never runs out."""

    def evaluate(self, shape, endpoint, model, carried=None) -> MemoryReport:
        return MemoryReport(peak_bytes=2**20)

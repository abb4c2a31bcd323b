"""Cost models with fixed answers, for tests about scheduling and comparison rather than about memory or time.

Each is its own bound model: ``bind`` (the cost contracts' ``MemoryModel.bind`` / ``TimeModel.bind``) returns it."""

from __future__ import annotations

from skyrl_sim.plugin_host.costs import MemoryReport


class FixedCallTime:
    """Every batch call takes ``seconds``; singles take 10 ms."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def bind(self, endpoint, model) -> FixedCallTime:
        return self

    def call_seconds(self, shape) -> float:
        return self.seconds

    def sample_seconds(self, requests) -> float:
        return self.seconds

    def single_seconds(self, request) -> float:
        return 0.01


class FlatMemory:
    """Every call peaks at 1 MiB and never runs out."""

    def bind(self, endpoint, model) -> FlatMemory:
        return self

    def evaluate(self, shape, carried=None, device=None) -> MemoryReport:
        return MemoryReport(peak_bytes=2**20)

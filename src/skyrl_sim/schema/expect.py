"""A scenario's ``expect`` sections: what a variant's run must do (checked by ``results.expectations``), and the
check that no run of the workload could meet them (bad input, not a failed check)."""

from __future__ import annotations

from pydantic import Field, model_validator

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.strict import Strict


class Range(Strict):
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is larger than max {self.max}: no value can meet it")
        return self

    def contains(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


class OomExpectation(Strict):
    """What every OOM of the variant must look like."""

    phase: str | None = None
    op_contains: str | None = None
    attempted_gib: Range | None = None


class Expectations(Strict):
    """What must happen. A variant with no expectations must complete every request."""

    all_completed: bool | None = None
    completed: int | None = Field(None, ge=0)
    failed: int | None = Field(None, ge=0)
    failed_requests: list[int] | None = None
    calls: int | None = Field(None, ge=0)
    oom_calls: int | None = Field(None, ge=0)
    oom: OomExpectation | None = None
    padded_rows: list[int] | None = Field(None, description="padded rows of every call, in order")
    request_metrics: dict[int, dict[str, float]] | None = None
    min_headroom_gib: float | None = None
    makespan_s: Range | None = None
    swaps: int | None = Field(None, ge=0, description="adapter swaps of the run (SkyRL's ensure_active_adapter)")
    host_memory_peak_gib: Range | None = Field(None, description="the adapter slots' peak host memory per worker")


def check_expectations(expect: Expectations, requests: int, path: str, where: str) -> None:
    """Expectations no run of this workload can meet are bad input (exit 2), not a failed check (exit 1)."""
    for key in ("completed", "failed"):
        value = getattr(expect, key)
        if value is not None and value > requests:
            raise ScenarioError(path, f"{where}.{key}", f"{value} is more than the workload's {requests} requests")
    if expect.completed is not None and expect.failed is not None and expect.completed + expect.failed > requests:
        raise ScenarioError(
            path, where, f"completed {expect.completed} + failed {expect.failed} is more than {requests} requests"
        )
    if expect.calls is not None and expect.oom_calls is not None and expect.oom_calls > expect.calls:
        raise ScenarioError(path, f"{where}.oom_calls", f"{expect.oom_calls} is more than calls {expect.calls}")
    if expect.all_completed and (expect.failed or expect.failed_requests or expect.completed not in (None, requests)):
        raise ScenarioError(path, f"{where}.all_completed", "contradicts the expected failures or completed count")
    known = range(1, requests + 1)
    for request_id in [*(expect.failed_requests or []), *(expect.request_metrics or {})]:
        if request_id not in known:
            raise ScenarioError(
                path, where, f"request {request_id} does not exist (request ids run from 1 to {requests})"
            )

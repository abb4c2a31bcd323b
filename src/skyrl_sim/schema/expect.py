"""A scenario's ``expect`` sections: what a variant's run must do (checked by ``results.expectations``), and the
checks that make an expectation mean something.

No expectation is met vacuously, and one that no run of the workload could meet is bad input (exit 2, naming the key),
not a failed check (exit 1). ``docs/verdict.md`` lists each key's exact meaning; in short:

- **completion is the default.** Unless an expectation names how many requests complete or fail (``all_completed``,
  ``completed``, ``failed``, ``failed_requests``) or expects a call to run out of memory (``oom``, ``oom_calls`` above
  0), every request must complete (``Expectations.effective``). ``expect: {}`` therefore means "every request
  completes";
- ``all_completed: false``: at least one request does not complete;
- ``oom``: at least one call runs out of memory, and every one that does matches;
- a range (``makespan_s``, ``oom.attempted_gib``, ``host_memory_peak_gib``) names at least one bound and leaves out
  some value the quantity can take (it is never negative, and never 0 for a run that did something);
- ``min_headroom_gib`` is above 0 and below the device's capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import Field, model_validator

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.strict import Strict

COMPLETION_KEYS = ("all_completed", "completed", "failed", "failed_requests")
"""The keys that say how many requests complete or fail: with none of them (and no OOM expected), every request must
complete."""


class Range(Strict):
    """Bounds on a quantity that is never negative and above 0 whenever it is measured at all (seconds, GiB). At
    least one bound; ``max`` above 0; ``min`` alone above 0 (a ``min`` of 0 or less alone is met by every value)."""

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _meaningful(self) -> Range:
        if self.min is None and self.max is None:
            raise ValueError("an empty range checks nothing: give min, max or both")
        if self.max is not None and self.max <= 0:
            raise ValueError(f"max {self.max} is not above 0: no value of this quantity can meet it")
        if self.max is None and self.min is not None and self.min <= 0:
            raise ValueError(f"min {self.min} alone is met by every value of this quantity (it is never negative)")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is larger than max {self.max}: no value can meet it")
        return self

    def contains(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


class OomExpectation(Strict):
    """At least one call runs out of memory, and every call that does matches each key given (``oom: {}``: at least
    one OOM call, anywhere)."""

    phase: str | None = Field(None, min_length=1, description="the phase every OOM happens in")
    op_contains: str | None = Field(None, min_length=1, description="text in the name of the op every OOM happens at")
    attempted_gib: Range | None = Field(None, description="what every failed allocation tried to allocate, GiB")


class Expectations(Strict):
    """What a variant's run must do. Completion is the default: see ``effective``."""

    all_completed: bool | None = Field(
        None, description="true: every request completes; false: at least one request does not"
    )
    completed: int | None = Field(None, ge=0, description="exactly this many requests complete")
    failed: int | None = Field(None, ge=0, description="exactly this many requests fail")
    failed_requests: list[int] | None = Field(None, description="exactly these requests fail (ids, each once)")
    calls: int | None = Field(None, ge=0, description="exactly this many backend calls")
    oom_calls: int | None = Field(None, ge=0, description="exactly this many calls run out of memory")
    oom: OomExpectation | None = None
    padded_rows: list[int] | None = Field(
        None, description="the padded rows of every forward and forward_backward call, in order (each at least 1)"
    )
    request_metrics: dict[int, dict[str, float]] | None = Field(
        None, description="a request's metrics, each equal to this value (relative tolerance 1e-6)"
    )
    min_headroom_gib: float | None = Field(
        None, gt=0, description="capacity minus the highest peak of any call, at least this (GiB)"
    )
    makespan_s: Range | None = Field(None, description="the run's makespan within this range")
    swaps: int | None = Field(None, ge=0, description="adapter swaps of the run (SkyRL's ensure_active_adapter)")
    host_memory_peak_gib: Range | None = Field(None, description="the adapter slots' peak host memory per worker")

    @property
    def expects_oom(self) -> bool:
        """Whether some call must run out of memory (which fails that call's requests)."""
        return self.oom is not None or bool(self.oom_calls)

    @property
    def states_completion(self) -> bool:
        """Whether the expectation itself says how many requests complete or fail."""
        return any(getattr(self, key) is not None for key in COMPLETION_KEYS)

    def effective(self) -> Expectations:
        """The expectation as it is checked: with ``all_completed: true`` added when it neither says how many
        requests complete or fail nor expects an OOM (completion is the default)."""
        if self.states_completion or self.expects_oom:
            return self
        return self.model_copy(update={"all_completed": True})

    @property
    def is_empty(self) -> bool:
        """No key given (``expect: {}``): a variant's empty block inherits the scenario's expectations."""
        return not self.model_fields_set or all(getattr(self, key) is None for key in type(self).model_fields)


@dataclass(frozen=True)
class WorkloadFacts:
    """What the checks need to know of the workload and the endpoint: how many requests, which request types (read
    only when a check needs them: a trace is not expanded otherwise), and the device's capacity."""

    requests: int
    capacity_gib: float
    request_types: Callable[[], frozenset[str]]
    forward_pass_requests: Callable[[], int]
    """The forward and forward_backward requests (a bound on the calls ``padded_rows`` lists)."""


def pick_expectations(variant: Expectations | None, scenario: Expectations | None) -> tuple[Expectations, str]:
    """The expectations a variant is judged by, and the key they come from: the variant's own unless absent or empty
    (``expect: {}`` inherits), else the scenario's unless absent or empty, else none (every request completes)."""
    if variant is not None and not variant.is_empty:
        return variant, "variant"
    if scenario is not None and not scenario.is_empty:
        return scenario, "scenario"
    return Expectations(), "default"


def check_expectations(expect: Expectations, facts: WorkloadFacts, path: str, where: str) -> None:
    """Expectations no run of this workload can meet are bad input (``ScenarioError`` naming the key: exit 2), not a
    failed check (exit 1). ``expect`` is the expectation as written (before ``effective``)."""

    def bad(key: str, reason: str) -> ScenarioError:
        return ScenarioError(path, f"{where}.{key}" if key else where, reason)

    requests = facts.requests
    e = expect.effective()
    for key in ("completed", "failed", "oom_calls"):
        value = getattr(e, key)
        if value is not None and value > requests:
            raise bad(key, f"{value} is more than the workload's {requests} requests")
    failed_ids = e.failed_requests
    if failed_ids is not None:
        repeated = sorted({i for i in failed_ids if failed_ids.count(i) > 1})
        if repeated:
            raise bad("failed_requests", f"request {repeated[0]} is listed more than once")
        for request_id in failed_ids:
            if not 1 <= request_id <= requests:
                raise bad("failed_requests", f"request {request_id} does not exist (ids run from 1 to {requests})")
        if e.failed is not None and e.failed != len(failed_ids):
            raise bad("failed", f"{e.failed} contradicts the {len(failed_ids)} requests of failed_requests")
    failures = e.failed if e.failed is not None else len(failed_ids) if failed_ids is not None else None
    if e.completed is not None and failures is not None and e.completed + failures > requests:
        raise bad("completed", f"completed {e.completed} + failed {failures} is more than the {requests} requests")
    _check_all_completed(e, failures, requests, bad)
    _check_ooms(e, failures, bad)
    _check_calls(e, facts, bad)
    for request_id, metrics in (e.request_metrics or {}).items():
        if not 1 <= request_id <= requests:
            raise bad("request_metrics", f"request {request_id} does not exist (ids run from 1 to {requests})")
        if not metrics:
            raise bad(f"request_metrics.{request_id}", "names no metric: it checks nothing")
    if e.request_metrics is not None and not e.request_metrics:
        raise bad("request_metrics", "names no request: it checks nothing")
    if e.min_headroom_gib is not None and e.min_headroom_gib >= facts.capacity_gib:
        raise bad(
            "min_headroom_gib",
            f"{e.min_headroom_gib} GiB is not below the device's capacity of {facts.capacity_gib:.2f} GiB: no call "
            "can leave that much",
        )
    if e.swaps is not None and e.swaps > requests:
        raise bad("swaps", f"{e.swaps} is more than the workload's {requests} requests (a swap precedes a call)")


def _check_all_completed(e: Expectations, failures: int | None, requests: int, bad: Callable[..., ScenarioError]) -> None:
    if e.all_completed is True:
        if failures or (e.completed is not None and e.completed != requests):
            raise bad("all_completed", "contradicts the expected failures or completed count")
        if e.expects_oom:
            raise bad("all_completed", "contradicts the expected OOM: a call that runs out of memory fails its requests")
    if e.all_completed is False and (failures == 0 or e.completed == requests):
        raise bad("all_completed", "false means some request does not complete: contradicts the counts given")


def _check_ooms(e: Expectations, failures: int | None, bad: Callable[..., ScenarioError]) -> None:
    """A call that runs out of memory fails its requests, and a failed request is in no other call: each OOM call
    fails at least one request of its own."""
    if e.oom is not None and e.oom_calls == 0:
        raise bad("oom", "expects at least one call to run out of memory, and oom_calls is 0")
    if e.expects_oom and failures == 0:
        raise bad("oom_calls" if e.oom_calls else "oom", "a call that runs out of memory fails its requests: failed is 0")
    if e.oom_calls and failures is not None and e.oom_calls > failures:
        raise bad("oom_calls", f"{e.oom_calls} calls out of memory fail at least {e.oom_calls} requests, not {failures}")
    if e.calls is not None and e.oom_calls is not None and e.oom_calls > e.calls:
        raise bad("oom_calls", f"{e.oom_calls} is more than calls {e.calls}")


def _check_calls(e: Expectations, facts: WorkloadFacts, bad: Callable[..., ScenarioError]) -> None:
    """A completed request other than a sample ran in a backend call (a forwarded sample may not), and a completed
    forward or forward_backward in a call with padded rows."""
    rows = e.padded_rows
    if rows is not None:
        for i, value in enumerate(rows):
            if value < 1:
                raise bad(f"padded_rows[{i}]", f"{value}: a forward or forward_backward call has at least one row")
        if e.calls is not None and len(rows) > e.calls:
            raise bad("padded_rows", f"{len(rows)} calls' rows, more than calls {e.calls}")
        if rows and len(rows) > (passes := facts.forward_pass_requests()):
            raise bad(
                "padded_rows",
                f"{len(rows)} calls' rows, but the workload has {passes} forward and forward_backward requests (a call "
                "holds at least one, and a request is in one call)",
            )
    if e.calls != 0 and rows != []:
        return
    types = facts.request_types()
    in_calls = types - {"sample"}  # a forwarded sample completes without a call of the engine
    if e.calls == 0 and ((e.all_completed and in_calls) or (e.completed and "sample" not in types)):
        raise bad("calls", "0, but requests must complete and the workload's requests run in backend calls")
    if rows == [] and e.all_completed and types & {"forward_backward", "forward"}:
        raise bad("padded_rows", "is empty, but every request must complete and the workload has forward passes")

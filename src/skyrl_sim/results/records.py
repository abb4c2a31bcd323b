"""The records of a run: one per call (``CallRecord``, with its ``OomRecord``), one per request (``RequestRecord``),
the type checks a record read from a file passes, and the schema name a RunResult file carries.

The bottom of ``results``: the RunResult (``result``), the spool that keeps a long run's request records on disk
(``record_spool``) and the reader that streams a large file (``result_stream``) all build on these records, and none
of them is imported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "skyrl-sim/run/1"
"""The schema name every RunResult (and every file of several) carries."""

RequestTimes = tuple[float | None, float | None, float | None, str]
"""One request's (submitted_s, started_s, completed_s, status): all the summary reads of a request."""


UNRECORDED = "unrecorded"
"""``CallRecord.extra[UNRECORDED]``: the shape fields a call's source does not know (a service log names a call's
requests but not its micro-batches); they are left out of both sides' shapes instead of reading as 0."""


@dataclass
class OomRecord:
    """Where capacity ran out: the allocation that failed, in PyTorch's words."""

    attempted_bytes: int
    where: dict[str, Any]
    message: str
    allocated_bytes: int | None = None
    capacity_bytes: int | None = None


@dataclass(slots=True)  # a long run holds one per call: no per-instance __dict__
class CallRecord:
    index: int
    kind: str
    model_id: str | None
    request_ids: list[int]
    rows: int = 0
    padded_rows: int = 0
    width: int = 0
    microbatches: int = 0
    start_s: float = 0.0
    end_s: float = 0.0
    peak_bytes: int | None = None
    oom: OomRecord | None = None
    real_tokens: int = 0
    slots: int = 0
    error: str | None = None
    memory: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def padding_waste(self) -> float:
        """Fraction of computed token slots that carry no real token."""
        return 1.0 - self.real_tokens / self.slots if self.slots else 0.0


@dataclass(slots=True)  # one per request
class RequestRecord:
    id: int
    type: str
    model_id: str
    tokens: int
    submitted_s: float | None = None
    started_s: float | None = None
    completed_s: float | None = None
    status: str = "pending"  # pending | completed | failed
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    client: str = ""
    datums: list[int] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def latency_s(self) -> float | None:
        if self.submitted_s is None or self.completed_s is None:
            return None
        return self.completed_s - self.submitted_s

    @property
    def queue_wait_s(self) -> float | None:
        """Time in the queue: from submission until the engine started the call that ran it."""
        if self.submitted_s is None or self.started_s is None:
            return None
        return self.started_s - self.submitted_s


def _is_number(value: Any, optional: bool = True) -> bool:
    if value is None:
        return optional
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_call(call: CallRecord) -> None:
    """A call record read from a file has the types reports compute with; ValueError naming the field otherwise."""
    for key in ("index", "rows", "padded_rows", "width", "microbatches", "real_tokens", "slots"):
        if not isinstance(getattr(call, key), int) or isinstance(getattr(call, key), bool):
            raise ValueError(f"call {call.index!r}: '{key}' must be an integer, got {getattr(call, key)!r}")
    for key in ("start_s", "end_s"):
        if not _is_number(getattr(call, key), optional=False):
            raise ValueError(f"call {call.index}: '{key}' must be a number, got {getattr(call, key)!r}")
    if not _is_number(call.peak_bytes) or not isinstance(call.request_ids, list):
        raise ValueError(f"call {call.index}: 'peak_bytes' or 'request_ids' has the wrong type")
    if call.oom is not None and not _is_number(call.oom.attempted_bytes, optional=False):
        raise ValueError(f"call {call.index}: 'oom.attempted_bytes' must be a number")


def check_request(request: RequestRecord) -> None:
    """A request record read from a file has the types reports compute with; ValueError naming the field otherwise."""
    if not isinstance(request.id, int) or isinstance(request.id, bool):
        raise ValueError(f"request id {request.id!r} is not an integer")
    for key in ("submitted_s", "started_s", "completed_s"):
        if not _is_number(getattr(request, key)):
            raise ValueError(f"request {request.id}: '{key}' must be a number, got {getattr(request, key)!r}")
    if request.status not in ("pending", "completed", "failed"):
        raise ValueError(f"request {request.id}: unknown status {request.status!r}")
    if not isinstance(request.metrics, dict) or not all(_is_number(v, False) for v in request.metrics.values()):
        raise ValueError(f"request {request.id}: 'metrics' must map names to numbers")

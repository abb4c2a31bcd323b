"""RunResult: the one result schema every backend writes and every report, comparison and check reads.

A number that more than one backend reports (padded rows, width, micro-batches) is set in one place, from a
``CallShape`` (``engine_loop.copy_shape_fields``), so two backends can only disagree about what they measured, never
about what a field means.
"""

from __future__ import annotations

import os
import stat
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import orjson

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.results import result_stream
from skyrl_sim.results.outputs import write_atomic, write_with
from skyrl_sim.results.records import (
    SCHEMA,
    UNRECORDED,
    CallRecord,
    OomRecord,
    RequestRecord,
    RequestTimes,
    check_call,
    check_request,
)
from skyrl_sim.results.tenants import nearest_rank, tenancy_summary
from skyrl_sim.schema.command_files import note_input
from skyrl_sim.schema.documents import read_bytes
from skyrl_sim.schema.limits import MAX_RESULT_BYTES

__all__ = [  # the records are defined in ``records`` and read from here as well (the one result schema)
    "SCHEMA",
    "UNRECORDED",
    "CallRecord",
    "OomRecord",
    "RequestRecord",
    "RequestTimes",
    "RunResult",
    "check_call",
    "check_request",
    "read_results",
    "write_results",
]

OPTIONAL_FIELDS = ("inference", "verdict")
"""RunResult fields left out of the JSON when empty."""
JSON_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS

@dataclass
class RunResult:
    scenario: str
    variant: str
    backend: str
    endpoint: str
    calls: list[CallRecord] = field(default_factory=list)
    requests: Sequence[RequestRecord] = field(default_factory=list)  # a long simulated run: a RecordSpool
    log: list[str] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    capacity_bytes: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    tenancy: dict[str, Any] = field(default_factory=dict)  # the adapter store's host memory (results.tenants)
    schema: str = SCHEMA
    inference: dict[str, Any] = field(default_factory=dict)
    """The inference engines' side of the run when samples ran on vLLM (``docs/sampling.md``): the sampling mode,
    the KV cache, per engine its counters and timeline; left out of the JSON when empty."""
    verdict: dict[str, Any] = field(default_factory=dict)
    """The run's verdict when ``check`` judged it (``results.verdict.Verdict.to_dict``: PASS / AT RISK / FAIL, the
    reasons, the margin); left out of the JSON when empty."""

    def request(self, request_id: int) -> RequestRecord:
        by_id = getattr(self.requests, "by_id", None)  # a RecordSpool finds a record without reading the others
        if by_id is not None:
            return by_id(request_id)  # type: ignore[no-any-return]
        for record in self.requests:
            if record.id == request_id:
                return record
        raise KeyError(request_id)

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.status == "completed"]

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.status == "failed"]

    @property
    def oom_calls(self) -> list[CallRecord]:
        return [c for c in self.calls if c.oom is not None]

    def request_times(self) -> Iterator[RequestTimes]:
        """Every request's times and status in id order: from a RecordSpool's columns without reading a record, or
        from the records held in memory. The summary reads requests only through this, so a spooled run and the same
        run held in memory summarise to the same bytes."""
        columns = getattr(self.requests, "request_times", None)
        if columns is not None:
            return columns()  # type: ignore[no-any-return]
        return ((r.submitted_s, r.started_s, r.completed_s, r.status) for r in self.requests)

    def request_models(self) -> Iterator[str]:
        """Every request's model id in id order (a RecordSpool answers from its columns)."""
        columns = getattr(self.requests, "request_models", None)
        if columns is not None:
            return columns()  # type: ignore[no-any-return]
        return (r.model_id for r in self.requests)

    @property
    def makespan_s(self) -> float:
        return _makespan(list(self.request_times()), self.calls)

    def summary(self) -> dict[str, Any]:
        """Per-variant numbers a user looks at first: outcome, latency, padding waste, memory.

        Percentiles are exact (sorted values), not a streaming sketch: a spooled run keeps 8 bytes per request for
        them, and a sketch would make a long run's summary differ from the same run held in memory."""
        times = list(self.request_times())
        # latency_s and queue_wait_s as RequestRecord defines them, from the same floats
        latencies = sorted(c - s for s, _, c, status in times if s is not None and c is not None and status == "completed")
        waits = sorted(b - s for s, b, _, _ in times if s is not None and b is not None)
        completed = sum(status == "completed" for _, _, _, status in times)
        failed = sum(status == "failed" for _, _, _, status in times)
        busy = sum(c.duration_s for c in self.calls)
        span = _makespan(times, self.calls)
        real = sum(c.real_tokens for c in self.calls)
        useful = sum(c.real_tokens for c in self.calls if c.oom is None and c.error is None)  # tokens/s: trained ones
        slots = sum(c.slots for c in self.calls)
        peaks = [c.peak_bytes for c in self.calls if c.peak_bytes is not None]
        del times

        def pct(q: float, values: list[float] = latencies) -> float | None:
            return nearest_rank(values, q)

        return {
            "requests": len(self.requests),
            "completed": completed,
            "failed": failed,
            "calls": len(self.calls),
            "oom_calls": len(self.oom_calls),
            "makespan_s": span,
            "latency_p50_s": statistics.median(latencies) if latencies else None,
            "latency_p95_s": pct(0.95),
            "latency_max_s": latencies[-1] if latencies else None,
            "queue_wait_p50_s": statistics.median(waits) if waits else None,
            "queue_wait_p95_s": pct(0.95, waits),
            "queue_wait_max_s": waits[-1] if waits else None,
            "queue_wait_mean_s": statistics.fmean(waits) if waits else None,
            "engine_busy_fraction": busy / span if span else 0.0,
            "real_tokens": real,
            "token_slots": slots,
            "padding_waste": 1.0 - real / slots if slots else 0.0,
            "tokens_per_s": useful / span if span else 0.0,
            "peak_bytes_max": max(peaks) if peaks else None,
            "tenancy": tenancy_summary(self),
            **switching_summary(self.calls, busy),
        }

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, requests=[]))  # the requests by themselves: a RecordSpool is read, not copied
        for optional in OPTIONAL_FIELDS:
            if not data[optional]:
                del data[optional]
        data["requests"] = list(request_dicts(self.requests))
        data["summary"] = self.summary()
        return data

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=JSON_OPTIONS)

    def iter_json(self) -> Iterator[bytes]:
        """``to_json()`` in pieces, one call or request record at a time, so writing a long run never holds a second
        copy of it as dicts or as one bytes object. The bytes are exactly ``to_json()``'s (orjson's 2-space indent:
        a record at depth ``d`` is dumped alone and its lines indented by ``2 d`` spaces; JSON strings hold no raw
        newline, so every newline in a dump is structure). orjson writes a dataclass as ``asdict`` would, so records
        are dumped as they are (``asdict``'s deep copy was most of a long run's write time)."""
        summary = self.summary()
        yield b"{"
        kept = [f for f in fields(self) if f.name not in OPTIONAL_FIELDS or getattr(self, f.name)]
        for i, f in enumerate([*kept, None]):
            name = f.name if f is not None else "summary"
            value = getattr(self, name) if f is not None else summary
            yield (b",\n  " if i else b"\n  ") + orjson.dumps(name) + b": "
            if name in ("calls", "requests") and value:
                dicts = getattr(value, "dicts", None)  # a RecordSpool: its lines parsed, late facts merged
                for j, record in enumerate(dicts() if dicts is not None else value):
                    yield (b",\n    " if j else b"[\n    ") + _indented(record, 2)
                yield b"\n  ]"
            else:
                yield _indented(value, 1)
        yield b"\n}"

    def write(self, path: str | Path) -> None:
        """The RunResult JSON, streamed record by record (see ``iter_json``) into a temporary file moved over ``path``
        (``-``: stdout)."""
        write_pieces(path, self.iter_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        data = dict(data)
        data.pop("summary", None)
        calls = []
        for c in data.pop("calls", []):
            c = dict(c)
            oom = c.pop("oom", None)
            calls.append(CallRecord(**c, oom=OomRecord(**oom) if oom else None))
        requests = [RequestRecord(**r) for r in data.pop("requests", [])]
        return cls(**data, calls=calls, requests=requests)

    @classmethod
    def read(cls, path: str | Path) -> RunResult:
        """The one run of a RunResult file (``write_results``' document, or an older file that is the run itself)."""
        runs = read_results(path)
        if len(runs) != 1:
            raise UserError(f"{path}: holds {len(runs)} runs, not one (read them with read_results)")
        return runs[0]


def _makespan(times: list[RequestTimes], calls: Sequence[CallRecord]) -> float:
    """From the first submission to whichever is later: the last result written, or the end of the engine's last
    call (0 when nothing was submitted or nothing ended). The two differ only when clients gave up waiting
    (``workload.result_timeout_s``): their requests fail as the clients see them, but the engine still runs them,
    and the service is busy until it has."""
    ends = [c for _, _, c, _ in times if c is not None]
    if calls:
        ends.append(max(call.end_s for call in calls))
    starts = [s for s, _, _, _ in times if s is not None]
    return max(ends) - min(starts) if ends and starts else 0.0


def request_dicts(requests: Sequence[RequestRecord]) -> Iterator[dict[str, Any]]:
    """Each request record as ``asdict`` gives it, in order; a RecordSpool parses its lines without building records."""
    dicts = getattr(requests, "dicts", None)
    if dicts is not None:
        return dicts()  # type: ignore[no-any-return]
    return (asdict(r) for r in requests)


def _indented(value: Any, depth: int) -> bytes:
    """``value`` as orjson's indented JSON, its lines shifted right by ``depth`` levels (2 spaces each)."""
    return orjson.dumps(value, option=JSON_OPTIONS).replace(b"\n", b"\n" + b"  " * depth)


def write_results(results: list[RunResult], path: str | Path) -> None:
    """The runs as one document shape whatever their number: ``{"schema": SCHEMA, "runs": [...]}``, one run per
    variant (a file with one run used to be the run itself; ``read_results`` still reads that)."""
    if not results:
        write_atomic(path, orjson.dumps({"schema": SCHEMA, "runs": []}, option=JSON_OPTIONS))
        return
    write_pieces(path, iter_results_json(results))


def write_pieces(path: str | Path, pieces: Iterator[bytes]) -> None:
    """JSON made in pieces, written into a temporary file moved over ``path`` as they come (``-``: stdout, whole)."""
    if str(path) == "-":
        write_atomic(path, b"".join(pieces))
        return

    def stream(temp: Path) -> None:
        with open(temp, "wb") as out:
            for piece in pieces:
                out.write(piece)

    write_with(path, stream)


def iter_results_json(results: list[RunResult]) -> Iterator[bytes]:
    """``{"schema", "runs": [...]}`` of several runs as orjson's indented JSON, in pieces: each run's ``iter_json``
    shifted two levels right (every newline in it is structure), so no run is held as dicts."""
    yield b"{\n  " + orjson.dumps("schema") + b": " + orjson.dumps(SCHEMA) + b",\n  " + orjson.dumps("runs") + b": ["
    for i, result in enumerate(results):
        yield b",\n    " if i else b"\n    "
        for piece in result.iter_json():
            yield piece.replace(b"\n", b"\n    ")
    yield b"\n  ]\n}"


STREAM_ABOVE_BYTES = 64 * 2**20
"""A RunResult file larger than this, in the layout the tool writes, is read record by record (``result_stream``)
whatever its size; a smaller one, or one in another layout up to ``MAX_RESULT_BYTES``, is parsed whole."""


def read_results(path: str | Path) -> list[RunResult]:
    """The runs of a RunResult JSON file (one run, or ``{"schema", "runs"}``); a UserError naming the file and the
    problem when it is missing, too large, not JSON, or not a RunResult with the right types. A large file the tool
    wrote is streamed (its requests spooled to a temporary file), so any run the tool wrote can be read back."""
    streamed = _read_streamed(Path(path))
    if streamed is not None:
        return streamed
    try:
        data = orjson.loads(read_bytes(Path(path), MAX_RESULT_BYTES, "the saved RunResult"))
    except ScenarioError as exc:
        if "over the limit" in exc.reason:
            raise UserError(
                f"{exc}; a file this large is read only in the layout skyrl-sim writes (this one is not)"
            ) from None
        raise UserError(str(exc)) from None
    except orjson.JSONDecodeError as exc:
        raise UserError(f"{path}: not a skyrl-sim RunResult: not JSON ({exc})") from None
    try:
        if not isinstance(data, dict):
            raise ValueError(f"the file holds a JSON {type(data).__name__}, not an object")
        items = data.get("runs", [data])
        if not isinstance(items, list) or not items:
            raise ValueError("'runs' must be a non-empty list")
        runs = []
        for position, item in enumerate(items):
            if not isinstance(item, dict) or item.get("schema") != SCHEMA:
                raise ValueError(f"run {position} has no schema '{SCHEMA}'")
            run = RunResult.from_dict(item)
            _check_types(run)
            runs.append(run)
        return runs
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UserError(f"{path}: not a skyrl-sim RunResult: {exc}") from None


def _read_streamed(path: Path) -> list[RunResult] | None:
    """The runs of a large file in the tool's layout, read record by record; None when the file is small, not in
    that layout, or not a regular file (``read_results`` then reads it whole, with its checks and messages)."""
    note_input(path, "the saved RunResult")
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size <= STREAM_ABOVE_BYTES:
            return None
        with open(path, "rb") as handle:
            if not result_stream.written_by_the_tool(handle.read(result_stream.HEAD_BYTES)):
                return None
            handle.seek(0)
            runs = [RunResult(**fields) for fields in result_stream.read_streamed(handle)]
    except OSError:
        return None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # LayoutError, a bad record, a JSON error
        raise UserError(f"{path}: not a skyrl-sim RunResult: {exc}") from None
    return runs  # every record was checked as it was read (check_call, check_request)


def _check_types(run: RunResult) -> None:
    """Every field a report or comparison computes with has the type it needs (a hand-edited file may not)."""
    for call in run.calls:
        check_call(call)
    for request in run.requests:
        check_request(request)


def switch_seconds(call: CallRecord) -> float:
    """The time a call spent switching a shared device between the trainer and vLLM (its ``switches`` steps)."""
    return sum(step["seconds"] for step in call.extra.get("switches", ()))


def switching_summary(calls: list[CallRecord], busy: float) -> dict[str, float]:
    """The engine's time spent switching a shared device, and its share of the engine's busy time; empty when no
    call switched (a run whose trainer never shares its devices summarises as before)."""
    switching = sum(switch_seconds(c) for c in calls)
    if not switching:
        return {}
    return {"switch_s": switching, "switch_share": switching / busy if busy else 0.0}

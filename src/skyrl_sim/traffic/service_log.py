"""Backend calls from a SkyRL Tinker service's log: what ran, how many requests, how long, and (when logged) which.

SkyRL logs one ``(timing) process_batch_requests(KIND, n=K) took Xs`` line per backend call and one
``(timing) process_single_request(TYPE) took Xs`` line per single; the SkyRL-Train backends add
``Padded batch from B to B' (alignment=A)`` and the PR #1874 cap ``forward_backward request batch split N``; the JAX
backend logs ``JIT compiling for MODE seq_len=N``. None of these names the requests. When the service runs with the
test harness's observation shim, ``skyrl-sim-shim: call KIND ids=...`` / ``skyrl-sim-shim: singles ids=...`` lines
precede the calls and give their request ids (the service's ids). Lines are parsed from an offset, so one service log
can serve several runs.

A log is read as a stream of lines, so its size costs no memory (only the calls it holds do): a line longer than
``MAX_LINE_BYTES`` is skipped (no line SkyRL writes comes near it), and a path that is not a regular file
(``/dev/zero``, a pipe) or a file holding NUL bytes (binary) is refused with ``UnreadableServiceLog``.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from skyrl_sim.results.oom_text import attempted_bytes, is_oom_text
from skyrl_sim.results.result import UNRECORDED, CallRecord, OomRecord, RequestRecord
from skyrl_sim.schema.command_files import note_input
from skyrl_sim.schema.requests import PASSES

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - (\w+) - [\w.]+: (.*)$")
BATCH = re.compile(r"\(timing\) process_batch_requests\((\w+), n=(\d+)\) took ([\d.]+)s")
SINGLE = re.compile(r"\(timing\) process_single_request\((\w+)\) took ([\d.]+)s")
SHIM_CALL = re.compile(r"skyrl-sim-shim: call (\w+) ids=([\d,]*)")
SHIM_SINGLES = re.compile(r"skyrl-sim-shim: singles ids=([\d,]*)")
PADDED = re.compile(r"Padded batch from (\d+) to (\d+) \(alignment=(\d+)\)")
SPLIT = re.compile(r"forward_backward request batch split (\d+)")
JIT = re.compile(r"JIT compiling for (\w+) seq_len=(\d+)")
BATCH_ERROR = re.compile(r"Error processing batch: (.*)")
SINGLE_ERROR = re.compile(r"Error processing request (\d+): (.*)")


MAX_LINE_BYTES = 1 << 20
"""A longer line is skipped without being held: SkyRL's timing, padding and shim lines are a few hundred bytes."""


class UnreadableServiceLog(OSError):
    """A log path that is not a regular text file; ``strerror`` says why (an OSError, so callers that report a log
    they cannot open report this the same way)."""

    def __init__(self, reason: str) -> None:
        super().__init__(errno.EINVAL, reason)


@dataclass
class LoggedCall:
    """One backend call as the service logged it. Times are wall-clock epoch seconds; ids are the service's."""

    kind: str
    n: int
    end_epoch: float
    duration_s: float
    ids: list[str] | None = None
    padded_rows: int | None = None
    alignment: int | None = None
    jit_seq_len: int | None = None
    error: str | None = None


@dataclass
class ServiceLog:
    calls: list[LoggedCall] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    has_ids: bool = False


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_size(path: str | Path) -> int:
    """Where a run's lines start: the log's current size (0 when it does not exist yet). The log is an input of the
    run from here on: no output of the command may replace it."""
    note_input(path, "the service log")
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def parse_service_log(text: str) -> ServiceLog:
    """Every backend call in ``text`` in the order the engine ran them."""
    return parse_service_lines(text.splitlines())


def parse_service_lines(lines: Iterable[str]) -> ServiceLog:
    """Every backend call in the log ``lines`` in the order the engine ran them (one pass, nothing held but calls)."""
    out = ServiceLog()
    pending_ids: dict[str, list[str]] = {}
    single_ids: list[str] = []
    padded: tuple[int, int, int] | None = None
    jit: int | None = None
    error: str | None = None
    single_errors: dict[str, str] = {}
    for raw in lines:
        match = STAMP.match(raw.strip())
        if not match:
            continue
        stamp, _level, message = match.groups()
        message = message.strip()
        if m := SHIM_CALL.search(message):
            pending_ids[m.group(1)] = [i for i in m.group(2).split(",") if i]
            out.has_ids = True
        elif m := SHIM_SINGLES.search(message):
            single_ids = [i for i in m.group(1).split(",") if i]
            out.has_ids = True
        elif m := PADDED.search(message):
            padded = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            out.lines.append(message)
        elif m := JIT.search(message):
            jit = int(m.group(2))
        elif m := SPLIT.search(message):
            out.lines.append(message)
        elif m := BATCH_ERROR.search(message):
            error = m.group(1)
        elif m := SINGLE_ERROR.search(message):
            single_errors[m.group(1)] = m.group(2)
        elif m := BATCH.search(message):
            kind, n, took = m.group(1), int(m.group(2)), float(m.group(3))
            call = LoggedCall(kind, n, _epoch(stamp), took, ids=pending_ids.pop(kind, None), jit_seq_len=jit, error=error)
            if padded is not None:
                call.padded_rows, call.alignment = padded[1], padded[2]
            out.calls.append(call)
            out.lines.append(message)
            padded, jit, error = None, None, None
        elif m := SINGLE.search(message):
            ids = [single_ids.pop(0)] if single_ids else None
            call = LoggedCall(m.group(1), 1, _epoch(stamp), float(m.group(2)), ids=ids)
            if ids and ids[0] in single_errors:
                call.error = single_errors.pop(ids[0])
            out.calls.append(call)
            out.lines.append(message)
    return out


def read_service_log(path: str | Path, offset: int = 0) -> ServiceLog:
    """Parse the log from byte ``offset`` (a run's start, see ``log_size``), line by line. Raises OSError when it cannot
    be opened, ``UnreadableServiceLog`` when it is not a regular file or is binary."""
    note_input(path, "the service log")
    with Path(path).open("rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise UnreadableServiceLog("not a regular file (a service log is a text file)")
        handle.seek(offset)
        return parse_service_lines(_text_lines(handle))


def _text_lines(handle: Any) -> Iterator[str]:
    """The handle's lines as text, each read with a bounded buffer; a line over ``MAX_LINE_BYTES`` is skipped."""
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if b"\x00" in line:
            raise UnreadableServiceLog("binary file (it holds NUL bytes), not a text log")
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):  # the rest of the long line, a bounded piece at a time
                line = handle.readline(MAX_LINE_BYTES + 1)
                if b"\x00" in line:
                    raise UnreadableServiceLog("binary file (it holds NUL bytes), not a text log")
            continue
        yield line.decode(errors="replace")


def oom_record(error: str | None) -> OomRecord | None:
    """An OOM record from a logged failure text that says how much it tried to allocate; None for any other text."""
    if not is_oom_text(error):
        return None
    assert error is not None
    attempted = attempted_bytes(error)
    return None if attempted is None else OomRecord(attempted, {}, error)


def logged_call_record(entry: LoggedCall, records: list[RequestRecord], index: int, end_s: float) -> CallRecord:
    """One logged call as a ``CallRecord``, by the rules every reader of a service log shares (the ``tinker``
    backend after a live run, ``replay`` against a database): ``records`` are the call's requests that the reader
    knows, ``end_s`` the call's end on the reader's clock.

    Shapes hold what the log and the requests know: rows (the datums of the named requests), padded rows (SkyRL-
    Train's ``Padded batch`` line, else the rows), and the width where the JAX backend logged a compilation for it.
    What the log does not say (micro-batches; a width without a compilation line; the rows of a call whose requests
    it does not name) is listed in ``extra["unrecorded"]`` and not compared. The model is the requests' one model
    (none for a sample call, which may serve several). A call whose every request failed with one text failed with
    it: SkyRL logs some failures (a single for a model that is not loaded) without an error line, and the requests
    hold the text."""
    unrecorded = ["microbatches"]
    if entry.ids is None:
        unrecorded += ["rows"] + ([] if entry.padded_rows is not None else ["padded_rows"])
    if entry.jit_seq_len is None:
        unrecorded.append("width")
    passes = entry.kind in PASSES
    rows = sum(len(r.datums) for r in records) if passes else 0
    failed = {r.error for r in records if r.status == "failed"}
    all_failed = bool(records) and all(r.status == "failed" for r in records)
    error = entry.error or (failed.pop() if len(failed) == 1 and all_failed else None)
    model_ids = {r.model_id for r in records}
    extra: dict[str, Any] = {"n": entry.n, UNRECORDED: unrecorded}
    if entry.jit_seq_len is not None:
        extra["jit_compiled"] = True
    return CallRecord(
        index=index,
        kind=entry.kind,
        model_id=model_ids.pop() if len(model_ids) == 1 and entry.kind != "sample" else None,
        request_ids=[r.id for r in records],
        rows=rows,
        padded_rows=entry.padded_rows or rows,
        width=entry.jit_seq_len or 0,
        start_s=end_s - entry.duration_s,
        end_s=end_s,
        real_tokens=sum(r.tokens + len(r.datums) for r in records) if passes else 0,
        oom=oom_record(error),
        error=error,
        extra=extra,
    )

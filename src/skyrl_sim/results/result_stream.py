"""Reading a RunResult JSON file record by record, so a run of any size the tool wrote can be read back.

A 2,000,000-request run writes a RunResult of about 2.5 GB; parsing that whole (``orjson.loads``) needs the bytes and
every record as Python objects at once, several times the file. The tool writes RunResults in one layout, orjson's
2-space indentation (``RunResult.iter_json``, ``iter_results_json``): every key of a run on its own line at the run's
indentation plus two, every call and request record starting with ``{`` and ending with ``}`` at the indentation of
the list's items. So the file can be read line by line: each record is parsed alone, request records go straight to
a ``RecordSpool`` (a temporary file and 49 bytes a request), and only the calls and the run's small fields are held.
The RunResult read this way equals the one the whole file parses to (``tests/test_result_stream.py``), and a file
in any other layout (compact or hand-written JSON) is not streamed: ``read_results`` reads it whole, up to its limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

import orjson

from skyrl_sim.results.record_spool import RecordSpool
from skyrl_sim.results.result import (
    SCHEMA,
    CallRecord,
    OomRecord,
    RequestRecord,
    RunResult,
    check_call,
    check_request,
)

RECORD_LISTS = ("calls", "requests")
HEAD_BYTES = 4096


def written_by_the_tool(head: bytes) -> bool:
    """Whether a file's first bytes are the tool's own layout: an envelope ``{"schema", "runs": [...]}`` or a run,
    indented by orjson."""
    envelope = b'{\n  "schema": ' + orjson.dumps(SCHEMA) + b',\n  "runs": [\n    {\n      "'
    return head.startswith(envelope) or head.startswith(b'{\n  "scenario": ')


class LayoutError(ValueError):
    """The file is not in the layout the tool writes (a truncated or hand-edited file)."""


def read_streamed(handle: IO[bytes]) -> list[RunResult]:
    """Every run of a RunResult file in the tool's layout (``written_by_the_tool``), read line by line."""
    lines = iter(handle)
    first = next(lines, b"")
    if first != b"{\n":
        raise LayoutError("it does not start with '{' on a line of its own")
    second = next(lines, b"")
    if second.startswith(b'  "schema": '):
        runs_line = next(lines, b"")
        if runs_line != b'  "runs": [\n':
            raise LayoutError("its 'runs' list is not where the tool writes it")
        runs = []
        while True:
            line = next(lines, b"")
            if line.strip() in (b"{", b"},", b"}"):
                if line.strip() == b"{":
                    runs.append(_run(lines, 4, None))
                continue
            if line.strip() == b"]":
                break
            raise LayoutError(f"unexpected line in 'runs': {line[:80]!r}")
        if not runs:
            raise LayoutError("'runs' must be a non-empty list")
        return runs
    return [_run(lines, 0, second)]


def _run(lines: Iterator[bytes], indent: int, first_key: bytes | None) -> RunResult:
    """One run object whose opening ``{`` (at ``indent`` spaces) was just read; ``first_key`` its first key line when
    that was read already."""
    key_pad = b" " * (indent + 2)
    end = b" " * indent + b"}"
    small: dict[str, Any] = {}
    calls: list[CallRecord] = []
    requests: RecordSpool | list[RequestRecord] = RecordSpool()
    line = first_key if first_key is not None else next(lines, b"")
    while line:
        if line.rstrip(b",\n") == end:
            break
        if not line.startswith(key_pad + b'"'):
            raise LayoutError(f"unexpected line in a run: {line[:80]!r}")
        name_end = line.index(b'": ', len(key_pad))
        name = orjson.loads(line[len(key_pad) : name_end + 1])
        rest = line[name_end + 3 :].rstrip(b",\n")
        if name in RECORD_LISTS and rest == b"[":
            for record in _records(lines, indent + 4):
                if name == "calls":
                    call = call_of(record)
                    check_call(call)
                    calls.append(call)
                else:
                    request = RequestRecord(**record)
                    check_request(request)
                    requests = _add_request(requests, request)
        else:
            small[name] = orjson.loads(b"".join([rest, *_rest_of_value(rest, lines, indent + 2)]))
        line = next(lines, b"")
    else:
        raise LayoutError("the file ends inside a run (truncated?)")
    small.pop("summary", None)
    for name in RECORD_LISTS:
        small.pop(name, None)
    return RunResult(**small, calls=calls, requests=requests)


def _rest_of_value(rest: bytes, lines: Iterator[bytes], indent: int) -> list[bytes]:
    """The lines after a key's first one that complete its value (a multi-line object or list ends at ``indent``)."""
    if rest not in (b"{", b"["):
        return []
    close = b" " * indent + (b"}" if rest == b"{" else b"]")
    out = []
    for line in lines:
        stripped = line.rstrip(b",\n")
        out.append(stripped if stripped == close else line)
        if stripped == close:
            return out
    raise LayoutError("the file ends inside a value (truncated?)")


def _records(lines: Iterator[bytes], indent: int) -> Iterator[dict[str, Any]]:
    """The records of a list whose ``[`` was just read, each parsed alone; the list ends at ``indent - 2``."""
    start = b" " * indent + b"{"
    end = b" " * indent + b"}"
    close = b" " * (indent - 2) + b"]"
    parts: list[bytes] = []
    for line in lines:
        stripped = line.rstrip(b",\n")
        if not parts:
            if stripped == close:
                return
            if stripped != start:
                raise LayoutError(f"unexpected line in a list of records: {line[:80]!r}")
        parts.append(stripped if stripped == end else line)
        if stripped == end:
            yield orjson.loads(b"".join(parts))
            parts = []
    raise LayoutError("the file ends inside a list of records (truncated?)")


def call_of(data: dict[str, Any]) -> CallRecord:
    """A call record from its JSON object (as ``RunResult.from_dict`` reads it)."""
    oom = data.pop("oom", None)
    return CallRecord(**data, oom=OomRecord(**oom) if oom else None)


def _add_request(requests: RecordSpool | list[RequestRecord], record: RequestRecord) -> RecordSpool | list[RequestRecord]:
    """Spool the records while their ids run 1, 2, 3, ... (as every backend numbers them); otherwise keep them in a
    list in file order, as the whole-file reader would."""
    if isinstance(requests, RecordSpool):
        if isinstance(record.id, int) and not isinstance(record.id, bool) and record.id == len(requests) + 1:
            requests.add(record)
            return requests
        held = list(requests)
        requests.close()
        requests = held
    requests.append(record)
    return requests

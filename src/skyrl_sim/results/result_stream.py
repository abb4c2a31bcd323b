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
from skyrl_sim.results.records import SCHEMA, CallRecord, OomRecord, RequestRecord, check_call, check_request

RECORD_LISTS = ("calls", "requests")
HEAD_BYTES = 4096


def written_by_the_tool(head: bytes) -> bool:
    """Whether a file's first bytes are the tool's own layout: an envelope ``{"schema", "runs": [...]}`` or a run,
    indented by orjson."""
    envelope = b'{\n  "schema": ' + orjson.dumps(SCHEMA) + b',\n  "runs": [\n    {\n      "'
    return head.startswith(envelope) or head.startswith(b'{\n  "scenario": ')


class LayoutError(ValueError):
    """The file is not in the layout the tool writes (a truncated or hand-edited file)."""


class _Reader:
    """Lines and spans of a file through one bounded buffer (a megabyte read at a time, plus the span being read)."""

    CHUNK = 1 << 20

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.buffer = b""
        self.pos = 0

    def until(self, marker: bytes) -> bytes:
        """The bytes up to and including ``marker`` (b"" at the end of the file; the rest when it has no marker). A
        span longer than the buffer (a run's log list) is gathered in pieces, each byte copied once."""
        pieces: list[bytes] = []
        while True:
            found = self.buffer.find(marker, self.pos)
            if found >= 0:
                end = found + len(marker)
                pieces.append(self.buffer[self.pos : end])
                self.pos = end
                return b"".join(pieces)
            tail = max(self.pos, len(self.buffer) - len(marker) + 1)  # where a marker cut by the next read may begin
            pieces.append(self.buffer[self.pos : tail])
            chunk = self.handle.read(self.CHUNK)
            if not chunk:
                pieces.append(self.buffer[tail:])
                self.buffer, self.pos = b"", 0
                return b"".join(pieces)
            self.buffer, self.pos = self.buffer[tail:] + chunk, 0

    def line(self) -> bytes:
        return self.until(b"\n")


RunFields = dict[str, Any]
"""A run's fields as ``RunResult(**fields)`` takes them (``result.read_results`` makes the RunResult: this module
sits below it)."""


def read_streamed(handle: IO[bytes]) -> list[RunFields]:
    """The fields of every run of a RunResult file in the tool's layout (``written_by_the_tool``), read record by
    record."""
    reader = _Reader(handle)
    first = reader.line()
    if first != b"{\n":
        raise LayoutError("it does not start with '{' on a line of its own")
    second = reader.line()
    if second.startswith(b'  "schema": '):
        if reader.line() != b'  "runs": [\n':
            raise LayoutError("its 'runs' list is not where the tool writes it")
        runs = []
        while True:
            line = reader.line().strip()
            if line == b"{":
                runs.append(_run(reader, 4, None))
            elif line == b"]":
                break
            else:
                raise LayoutError(f"unexpected line in 'runs': {line[:80]!r}")
        if not runs:
            raise LayoutError("'runs' must be a non-empty list")
        return runs
    return [_run(reader, 0, second)]


def _run(reader: _Reader, indent: int, first_key: bytes | None) -> RunFields:
    """One run object whose opening ``{`` (at ``indent`` spaces) was just read; ``first_key`` its first key line when
    that was read already. The run's closing line (``}`` or ``},``) is read too."""
    key_pad = b" " * (indent + 2)
    end = b" " * indent + b"}"
    small: dict[str, Any] = {}
    calls: list[CallRecord] = []
    requests: RecordSpool | list[RequestRecord] = RecordSpool()
    line = first_key if first_key is not None else reader.line()
    while line:
        if line.rstrip(b",\n") == end:
            break
        if not line.startswith(key_pad + b'"'):
            raise LayoutError(f"unexpected line in a run: {line[:80]!r}")
        name_end = line.index(b'": ', len(key_pad))
        name = orjson.loads(line[len(key_pad) : name_end + 1])
        rest = line[name_end + 3 :].rstrip(b",\n")
        if name in RECORD_LISTS and rest == b"[":
            for record in _records(reader, indent + 4):
                if name == "calls":
                    call = call_of(record)
                    check_call(call)
                    calls.append(call)
                else:
                    request = RequestRecord(**record)
                    check_request(request)
                    requests = _add_request(requests, request)
        elif rest in (b"{", b"["):  # a multi-line value: it closes at the key's own indentation
            close = b"\n" + key_pad + (b"}" if rest == b"{" else b"]")
            body = reader.until(close)
            if not body.endswith(close):
                raise LayoutError("the file ends inside a value (truncated?)")
            small[name] = orjson.loads(rest + b"\n" + body)
            reader.line()  # the rest of the closing line: "," or nothing
        else:
            small[name] = orjson.loads(rest)
        line = reader.line()
    else:
        raise LayoutError("the file ends inside a run (truncated?)")
    small.pop("summary", None)
    for name in RECORD_LISTS:
        small.pop(name, None)
    return {**small, "calls": calls, "requests": requests}


def _records(reader: _Reader, indent: int) -> Iterator[dict[str, Any]]:
    """The records of a list whose ``[`` was just read, each parsed alone: a record starts with ``{`` at ``indent``
    and ends at the first ``}`` at ``indent`` (what it holds is indented deeper); the list ends at ``indent - 2``."""
    start = b" " * indent + b"{\n"
    end = b"\n" + b" " * indent + b"}"
    close = b" " * (indent - 2) + b"]"
    while True:
        line = reader.line()
        if line.rstrip(b",\n") == close:
            return
        if line != start:
            raise LayoutError(f"unexpected line in a list of records: {line[:80]!r}")
        body = reader.until(end)
        if not body.endswith(end):
            raise LayoutError("the file ends inside a list of records (truncated?)")
        yield orjson.loads(b"{\n" + body)
        separator = reader.line()  # ",\n" before the next record, "\n" before the list's end
        if separator not in (b",\n", b"\n"):
            raise LayoutError(f"unexpected text after a record: {separator[:80]!r}")


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

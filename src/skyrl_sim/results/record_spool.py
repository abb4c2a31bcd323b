"""RecordSpool: a long run's finished request records on disk, not in memory, read back in id order.

A 10^6-request simulation held every ``RequestRecord`` until its RunResult was written. The spool writes each record
as one compact JSON array of its field values (in field order: no keys, half the bytes and half the time of an
object) to an anonymous temporary file the moment the request finishes, and keeps only what it needs to find and
summarise it: per request id an offset and a length (16 bytes), the three times, a status code, a retrieval time and
its model's index (37 bytes). Read back, a record is exactly the record written (plus the late facts below), so every
reader of ``RunResult.requests`` (reports, expectations, plots, compare, trace) works unchanged, and the RunResult JSON of a
spooled run is byte-identical to the same run held in memory: orjson reads its floats back bit for bit, and a
record's values zipped with the field names are ``asdict`` of it.

Request ids are dense (1..N, in arrival order), so the index is a few flat arrays indexed by id. Records are written
in the order requests finish and read in id order; reads go a block of ids at a time with one ``pread`` over the span
they occupy (requests finish roughly in id order, so a block's span is short).

Two facts can reach a request after it finished, and the spool keeps them beside the line, merged when it is read:

* ``started_s``: the engine starts a call whose request a client already failed by its result time-out (the engine
  had taken it from the queue before): the start time is written to the finished record, as in memory;
* ``outputs["retrieved_s"]``: when its client saw the result (at its end, for a client that submits at set times);
  the first one wins and becomes the last key of ``outputs``, as ``dict.setdefault`` does in memory.
"""

from __future__ import annotations

import math
import os
import tempfile
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import fields
from operator import attrgetter
from typing import Any, overload

import orjson

from skyrl_sim.results.records import RequestRecord, RequestTimes

STATUS_CODES = {"pending": 0, "completed": 1, "failed": 2}
STATUS_NAMES = {code: name for name, code in STATUS_CODES.items()}
LINE_OPTIONS = orjson.OPT_NON_STR_KEYS  # outputs may have non-string keys: written as the RunResult JSON writes them
FIELDS = tuple(f.name for f in fields(RequestRecord))
STARTED = FIELDS.index("started_s")
OUTPUTS = FIELDS.index("outputs")
values_of = attrgetter(*FIELDS)
GROW = 4096  # ids the columns grow by at once
READ_BLOCK = 4096  # ids read back per pread
MAX_BLOCK_SPAN = 64 * 2**20  # a block whose records lie further apart than this is read record by record
NAN = math.nan
GROW_TEMPLATES = tuple(
    array(code, [value]) * GROW
    for code, value in (("q", -1), ("q", 0), ("d", NAN), ("d", NAN), ("d", NAN), ("d", NAN), ("b", 0), ("i", 0))
)
"""A block of ``GROW`` ids of each column as it starts (offsets -1: not written; times NaN: not set)."""


def _time(value: float | None) -> float:
    """A time as a column holds it (NaN: not set); a NaN time in a record would be read back as None, so it is refused."""
    if value is None:
        return NAN
    if value != value:
        raise ValueError("a request time is NaN")
    return value


def _optional(value: float) -> float | None:
    return None if value != value else value


class RecordSpool(Sequence[RequestRecord]):
    """Finished RequestRecords in a temporary file, as a read-only sequence in id order (position ``i``: id ``i + 1``).

    ``add`` each record once, when it is final; ``started`` and ``retrieved`` record the late facts (module doc).
    ``request_times`` answers the summary from the columns without reading a record. Pickling (sweeps and advise
    send results between processes) materialises the records as a plain list."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="skyrl-sim-records-")  # noqa: SIM115 - lives as long as the spool
        self._fd = self._file.fileno()
        self._end = 0
        self._count = 0
        self._top = 0  # the highest id added
        self._offsets = array("q")  # by id - 1; -1: not written
        self._lengths = array("q")
        self._submitted = array("d")
        self._started = array("d")
        self._completed = array("d")
        self._status = array("b")
        self._retrieved = array("d")
        self._models = array("i")  # by id - 1: the index of the request's model id in _model_names
        self._model_names: dict[str, int] = {}
        self._buffer: list[bytes] = []
        self._buffered = 0

    # -- writing ------------------------------------------------------------------------------------------------------
    def _slot(self, request_id: int) -> int:
        """The array index of ``request_id``, growing every column to hold it."""
        if request_id < 1:
            raise ValueError(f"request id {request_id} is not positive")
        index = request_id - 1
        if index >= len(self._offsets):
            blocks = -(-(index + 1 - len(self._offsets)) // GROW)  # whole blocks, each copied from its template
            for column, template in zip(self._columns(), GROW_TEMPLATES, strict=True):
                column.extend(template * blocks)
        return index

    def _columns(self) -> tuple[array[Any], ...]:
        """The columns by id, in the order of ``GROW_TEMPLATES``."""
        return (
            self._offsets,
            self._lengths,
            self._submitted,
            self._started,
            self._completed,
            self._retrieved,
            self._status,
            self._models,
        )

    def add(self, record: RequestRecord) -> None:
        """Append a final record (each id once). Called once per request of a long run, so the columns are written
        directly: a slot a column grew to is NaN already (a time left None stays so), a NaN time is refused."""
        request_id = record.id
        index = request_id - 1
        offsets = self._offsets
        if not 0 <= index < len(offsets):
            index = self._slot(request_id)
            offsets = self._offsets
        if offsets[index] >= 0:
            raise ValueError(f"request {request_id} is already in the spool")
        line = orjson.dumps(values_of(record), option=LINE_OPTIONS)
        size = len(line)
        if request_id > self._top:
            self._top = request_id
        end = self._end
        offsets[index] = end
        self._lengths[index] = size
        self._end = end + size
        self._count += 1
        submitted, started, completed = record.submitted_s, record.started_s, record.completed_s
        if submitted != submitted or started != started or completed != completed:
            raise ValueError("a request time is NaN")
        if submitted is not None:
            self._submitted[index] = submitted
        if started is not None:
            self._started[index] = started
        if completed is not None:
            self._completed[index] = completed
        self._status[index] = STATUS_CODES[record.status]
        names = self._model_names
        model = names.get(record.model_id)
        if model is None:
            model = names[record.model_id] = len(names)
        self._models[index] = model
        self._buffer.append(line)
        self._buffered += size
        if self._buffered >= 1 << 20:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            os.lseek(self._fd, 0, os.SEEK_END)
            os.write(self._fd, b"".join(self._buffer))
            self._buffer.clear()
            self._buffered = 0

    def holds(self, request_id: int) -> bool:
        """Whether the record of ``request_id`` is in the spool."""
        return 0 < request_id <= self._top and self._offsets[request_id - 1] >= 0

    def started(self, request_id: int, now: float) -> None:
        """A call started with a request that had already finished: its start time, if it had none (as in memory)."""
        index = request_id - 1
        if self._started[index] != self._started[index]:
            self._started[index] = _time(now)

    def retrieved(self, request_id: int, seen_s: float) -> None:
        """When a client saw the result of ``request_id``; the first time wins."""
        index = request_id - 1
        if not 0 <= index < len(self._retrieved):
            index = self._slot(request_id)
        retrieved = self._retrieved
        if retrieved[index] != retrieved[index]:
            retrieved[index] = seen_s

    # -- reading ------------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def _check_dense(self) -> None:
        if self._count != self._top:
            missing = next(i + 1 for i in range(self._top) if self._offsets[i] < 0)
            raise ValueError(f"the spool has no record of request {missing}: ids must be 1..{self._top}")

    def _values(self, index: int, line: bytes) -> list[Any]:
        """The record's field values in field order, late facts merged."""
        values = orjson.loads(line)
        values[STARTED] = _optional(self._started[index])
        seen = self._retrieved[index]
        if seen == seen:
            values[OUTPUTS].setdefault("retrieved_s", seen)
        return values  # type: ignore[no-any-return]

    def _record(self, index: int, line: bytes) -> RequestRecord:
        return RequestRecord(*self._values(index, line))

    def _dict(self, index: int, line: bytes) -> dict[str, Any]:
        """The record's fields as ``asdict`` gives them."""
        return dict(zip(FIELDS, self._values(index, line), strict=True))

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(index, line) of every record in id order, a block of ids per read."""
        self._check_dense()
        self._flush()
        offsets, lengths, fd = self._offsets, self._lengths, self._fd
        for first in range(0, self._top, READ_BLOCK):
            last = min(first + READ_BLOCK, self._top)
            block = offsets[first:last]
            low = min(block)
            high = max(offsets[i] + lengths[i] for i in range(first, last))
            if high - low <= MAX_BLOCK_SPAN:
                chunk = os.pread(fd, high - low, low)
                for i in range(first, last):
                    start = offsets[i] - low
                    yield i, chunk[start : start + lengths[i]]
            else:
                for i in range(first, last):
                    yield i, os.pread(fd, lengths[i], offsets[i])

    def __iter__(self) -> Iterator[RequestRecord]:
        for index, line in self._lines():
            yield self._record(index, line)

    def dicts(self) -> Iterator[dict[str, Any]]:
        """Each record as ``dataclasses.asdict`` would give it, in id order, without building the record."""
        for index, line in self._lines():
            yield self._dict(index, line)

    def by_id(self, request_id: int) -> RequestRecord:
        if not self.holds(request_id):
            raise KeyError(request_id)
        self._flush()
        index = request_id - 1
        return self._record(index, os.pread(self._fd, self._lengths[index], self._offsets[index]))

    @overload
    def __getitem__(self, position: int) -> RequestRecord: ...

    @overload
    def __getitem__(self, position: slice) -> list[RequestRecord]: ...

    def __getitem__(self, position: int | slice) -> RequestRecord | list[RequestRecord]:
        self._check_dense()
        if isinstance(position, slice):
            return [self.by_id(i + 1) for i in range(*position.indices(self._count))]
        if position < 0:
            position += self._count
        if not 0 <= position < self._count:
            raise IndexError("spool index out of range")
        return self.by_id(position + 1)

    def request_times(self) -> Iterator[RequestTimes]:
        """(submitted_s, started_s, completed_s, status) per request in id order, from the columns."""
        self._check_dense()
        top = self._top
        for submitted, started, completed, status in zip(
            self._submitted[:top], self._started[:top], self._completed[:top], self._status[:top], strict=True
        ):
            yield _optional(submitted), _optional(started), _optional(completed), STATUS_NAMES[status]

    def request_models(self) -> Iterator[str]:
        """Each request's model id in id order, from the columns."""
        self._check_dense()
        names = list(self._model_names)
        return (names[index] for index in self._models[: self._top])

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> list[RequestRecord]:
        return list(self)

    def __repr__(self) -> str:
        return f"RecordSpool({self._count} records, {self._end:,} bytes)"

    def close(self) -> None:
        """Remove the file now (it goes anyway when the spool is collected)."""
        self._file.close()

"""A SkyRL database's traffic as a scenario, shared by ``import`` (which writes it) and ``replay`` (which runs it).

Each ``futures`` row becomes one request of the scenario, with what SkyRL recorded in ``request_data``: the datum
token counts of a pass, an optim step's learning rate, a sample's prompt length, ``max_tokens``, ``num_samples`` and
checkpoint, the checkpoint names of saves and loads. There is one client per model (base-model samples, which name
no model, get a client of their own), each submitting ``at_times``: every request at its recorded ``created_at``,
relative to the first imported request. A client's requests are written as a ``trace`` (one list per request type),
so a 100,000-request trace stays a few MB. The models loaded when the trace starts are ``workload.loaded_models``.

Every row is parsed by ``traffic.rows`` with the limits of scenario files; a row that cannot be used (unreadable, an
unknown type, a value past a limit, a ``load_weights`` of a checkpoint no imported save writes) is reported with its
table, id and reason and skipped, or fails the import with ``strict``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import yaml

from skyrl_sim.errors import UserError
from skyrl_sim.reports.progress import tracking
from skyrl_sim.results.oom_text import is_oom_text
from skyrl_sim.schema.limits import MAX_TIME_S
from skyrl_sim.schema.requests import PASSES, RequestType
from skyrl_sim.traffic import rows
from skyrl_sim.traffic.rows import BadRow
from skyrl_sim.traffic.skyrl_db import DatabaseInfo, FutureRow, SkyRLDatabase, sqlite_file

BASE_MODEL_CLIENT = "base-model"  # the client of samples that name no model (SkyRL's base-model sampling)
KNOWN_TYPES: frozenset[str] = frozenset(RequestType.__args__)  # type: ignore[attr-defined]
"""Past this many requests ``import`` suggests ``--out NAME.json``: YAML that long takes seconds per 100k to load."""


@dataclass(frozen=True)
class TraceRequest:
    """One imported request: what it asked, and what SkyRL recorded about it."""

    request_id: int
    type: str
    model_id: str
    created_s: float
    completed_s: float | None
    status: str
    error: str | None
    datums: tuple[int, ...] = ()
    learning_rate: float = 1e-4
    prompt_tokens: int = 0
    max_tokens: int = 0
    num_samples: int = 1
    checkpoint: str = ""

    @property
    def oom(self) -> bool:
        """The recorded failure was an out-of-memory error."""
        return is_oom_text(self.error)


@dataclass
class ImportedTrace:
    """The imported requests in arrival order, what was skipped, and the models loaded at the start."""

    source: str
    info: DatabaseInfo
    requests: list[TraceRequest]
    skipped: list[BadRow] = field(default_factory=list)
    loaded_at_start: list[str] = field(default_factory=list)

    @property
    def start_s(self) -> float:
        """The earliest arrival (request ids follow arrival order on one clock, but a row's time zone may not)."""
        return min(r.created_s for r in self.requests) if self.requests else 0.0

    def clients(self) -> dict[str, list[TraceRequest]]:
        """Requests per model, models in order of first appearance."""
        out: dict[str, list[TraceRequest]] = {}
        for request in self.requests:
            out.setdefault(request.model_id, []).append(request)
        return out


def decode(row: FutureRow, model_id: str) -> TraceRequest:
    """A futures row as a TraceRequest: its ``request_data`` read by its type's shape (``traffic.rows``);
    ``ValueError`` with the key and the reason when it is not what SkyRL writes or passes a limit."""
    return TraceRequest(
        request_id=row.request_id,
        type=row.request_type,
        model_id=model_id,
        created_s=row.created_s,
        completed_s=row.completed_s,
        status=row.status,
        error=row.error,
        **rows.read_request(row.request_type, row.request_data),
    )


def parse_time(text: str | None, flag: str) -> float | None:
    """``--since/--until``: an ISO 8601 time (UTC unless it says otherwise) as epoch seconds."""
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(f"{flag} '{text}': expected an ISO 8601 time such as 2026-11-23T00:00:00") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def read_trace(
    source: str,
    since: float | None = None,
    until: float | None = None,
    models: Sequence[str] | None = None,
    strict: bool = False,
    on_row: Callable[[int], None] | None = None,
) -> ImportedTrace:
    """Every request of the database in id order, filtered by creation time and model.

    The whole table is read once: the models loaded when the window starts follow from the ``create_model`` and
    ``unload_model`` rows before it (a model with no ``create_model`` row at all was created before the database's
    history and counts as loaded). ``on_row`` is told how many rows have been read (the CLI's progress).
    """
    wanted = set(models) if models else None
    requests: list[TraceRequest] = []
    skipped: list[BadRow] = []
    created: set[str] = set()
    before: dict[str, bool] = {}  # model -> loaded when the window starts, from rows before it
    saved: dict[str, set[str]] = {}  # model -> checkpoints its imported saves write

    def skip(bad: BadRow) -> None:
        if strict:
            raise UserError(f"import: {source}: {bad} (without --strict it is skipped)")
        skipped.append(bad)

    with SkyRLDatabase(source) as db:
        info = db.info()
        for bad in db.bad_rows:
            skip(bad)
        for count, row in enumerate(db.futures(), start=1):
            if on_row is not None:
                on_row(count)
            if isinstance(row, BadRow):
                skip(row)
                continue
            model_id = row.model_id or BASE_MODEL_CLIENT
            if row.request_type not in KNOWN_TYPES:
                skip(BadRow("futures", str(row.request_id), f"unknown request type '{row.request_type}'"))
                continue
            if row.request_type == "create_model":
                created.add(model_id)
            if since is not None and row.created_s < since:
                if row.request_type in ("create_model", "unload_model") and row.status == "completed":
                    before[model_id] = row.request_type == "create_model"
                continue
            if until is not None and row.created_s >= until:
                continue
            if wanted is not None and model_id not in wanted:
                continue
            if row.model_id is None and row.request_type != "sample":
                skip(BadRow("futures", str(row.request_id), f"a {row.request_type} request without a model_id"))
                continue
            try:
                request = decode(row, model_id)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                reason = f"unreadable {row.request_type} request_data ({type(exc).__name__}: {exc})"
                skip(BadRow("futures", str(row.request_id), reason))
                continue
            if request.type in ("save_weights", "save_weights_for_sampler"):
                saved.setdefault(model_id, set()).add(request.checkpoint)
            elif request.type == "load_weights" and request.checkpoint not in saved.get(model_id, set()):
                reason = f"load_weights of checkpoint '{request.checkpoint}', which no earlier imported save writes"
                skip(BadRow("futures", str(row.request_id), reason))
                continue
            requests.append(request)
    if not requests:
        raise UserError(f"import: {source}: no request to import (after the --since/--until/--models filters)")
    check_span(source, requests)
    seen = dict.fromkeys(r.model_id for r in requests if r.model_id != BASE_MODEL_CLIENT)
    loaded = [m for m in seen if before.get(m, m not in created)]
    return ImportedTrace(source, info, requests, skipped, loaded)


def check_span(source: str, requests: Sequence[TraceRequest]) -> None:
    """The requests' arrival times must fit a scenario's (``MAX_TIME_S`` after the first); a row whose clock is far
    off (year 9999) is named, with the filters that leave it out."""
    first = min(requests, key=lambda r: r.created_s)
    last = max(requests, key=lambda r: r.created_s)
    span = last.created_s - first.created_s
    if span > MAX_TIME_S:
        raise UserError(
            f"import: {source}: the requests span {span / 86_400:,.1f} days (request {first.request_id} to "
            f"{last.request_id}), over the {MAX_TIME_S / 86_400:g}-day limit of a scenario; import a shorter window "
            "with --since/--until"
        )


def client_trace(requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """A client's requests as ``Trace`` columns."""
    columns: dict[str, Any] = {"types": [r.type for r in requests]}
    sample: dict[str, list[Any]] = {"prompt_tokens": [], "max_tokens": [], "num_samples": [], "checkpoint": []}
    for request in requests:
        kind = request.type
        if kind in PASSES:
            columns.setdefault(kind, []).append(list(request.datums))
        elif kind == "optim_step":
            columns.setdefault(kind, []).append(request.learning_rate)
        elif kind == "sample":
            sample["prompt_tokens"].append(request.prompt_tokens)
            sample["max_tokens"].append(request.max_tokens)
            sample["num_samples"].append(request.num_samples)
            sample["checkpoint"].append(request.checkpoint)
        elif kind in ("save_weights_for_sampler", "save_weights", "load_weights"):
            columns.setdefault(kind, []).append(request.checkpoint)
    if sample["max_tokens"]:
        columns["sample"] = sample
    return columns


def scenario_of(trace: ImportedTrace, endpoint: str, name: str) -> dict[str, Any]:
    """The scenario mapping: one client per model, every request at its recorded time."""
    t0 = trace.start_s
    clients = []
    for model_id, requests in trace.clients().items():
        clients.append(
            {
                "name": model_id,
                "model_id": model_id,
                "submit": {"mode": "at_times", "gap_s": 0, "times_s": [round(r.created_s - t0, 6) for r in requests]},
                "trace": client_trace(requests),
            }
        )
    return {
        "name": name,
        "description": (
            f"{len(trace.requests)} requests imported from {trace.info.url} "
            f"({datetime.fromtimestamp(t0, UTC).isoformat()} onwards)"
        ),
        "endpoint": endpoint,
        "workload": {"loaded_models": list(trace.loaded_at_start), "clients": clients},
    }


def dump_scenario(body: dict[str, Any]) -> str:
    """YAML text of a scenario: small mappings by PyYAML, every list as one JSON flow sequence (valid YAML, and fast
    to write and read at 100,000 entries)."""

    def emit(value: Any, indent: int) -> list[str]:
        pad = " " * indent
        lines: list[str] = []
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, dict):
                    lines.append(f"{pad}{key}:")
                    lines.extend(emit(item, indent + 2))
                elif isinstance(item, list) and item and isinstance(item[0], dict):
                    lines.append(f"{pad}{key}:")
                    for element in item:
                        inner = emit(element, indent + 4)
                        inner[0] = f"{pad}  - {inner[0].lstrip()}"
                        lines.extend(inner)
                else:
                    lines.append(f"{pad}{key}: {scalar(item)}")
        return lines

    def scalar(item: Any) -> str:
        if isinstance(item, list):
            return orjson.dumps(item).decode()
        return yaml.safe_dump(item, default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()

    return "\n".join(emit(body, 0)) + "\n"


def scenario_text(body: dict[str, Any], path: Path) -> str:
    """The scenario as ``path`` should hold it: JSON for a ``.json`` file (it loads about 20x faster than YAML, which
    matters past 100,000 requests), YAML otherwise (``dump_scenario``)."""
    if path.suffix.lower() == ".json":
        return orjson.dumps(body).decode() + "\n"
    return dump_scenario(body)


def summary_lines(trace: ImportedTrace) -> list[str]:
    """What an import found, for the terminal."""
    counts: dict[str, int] = {}
    for request in trace.requests:
        counts[request.type] = counts.get(request.type, 0) + 1
    failed = sum(r.status == "failed" for r in trace.requests)
    span = max(r.created_s for r in trace.requests) - trace.start_s
    revision = trace.info.alembic_revision or "none (skyrl 0.4.0 schema)"
    lines = [
        f"{len(trace.requests)} requests from {len(trace.clients())} models over {span:.1f} s "
        f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); {failed} failed as recorded",
        f"schema: alembic_version {revision}; {len(trace.info.models)} models and {len(trace.info.checkpoints)} "
        f"checkpoints in the database; loaded at the start: {', '.join(trace.loaded_at_start) or 'none'}",
    ]
    if trace.skipped:
        shown = "; ".join(str(bad) for bad in trace.skipped[:10])
        more = f" (and {len(trace.skipped) - 10} more)" if len(trace.skipped) > 10 else ""
        lines.append(f"skipped {len(trace.skipped)} rows: {shown}{more}")
    return lines


def trace_from_args(args: argparse.Namespace) -> ImportedTrace:
    """The trace SOURCE and its filters (``add_source_args``) name, read with progress."""
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models is not None else None
    if models == []:
        raise UserError(f"--models '{args.models}': names no model id (give them comma-separated)")
    since = parse_time(args.since, "--since")
    until = parse_time(args.until, "--until")
    if since is not None and until is not None and until <= since:
        raise UserError(f"--until {args.until} is not after --since {args.since}")
    with tracking(f"reading {args.source}", None, "rows") as rows:
        return read_trace(args.source, since, until, models, args.strict, on_row=rows.update)


def source_inputs(source: str) -> list[tuple[str, str | Path | None]]:
    """The database file SOURCE names, as an input no output may replace."""
    return [("the database", sqlite_file(source))]


def add_source_args(parser: argparse.ArgumentParser) -> None:
    """SOURCE and the filters, shared by ``import`` and ``replay``."""
    parser.add_argument("source", help="SQLAlchemy URL (sqlite:///tinker.db, postgresql://...) or a SQLite file path")
    parser.add_argument("--endpoint", required=True, help="endpoint name (scenarios/endpoints/NAME.yaml) or path")
    parser.add_argument("--since", help="only requests created at or after this ISO time (UTC unless stated)")
    parser.add_argument("--until", help="only requests created before this ISO time")
    parser.add_argument("--models", help="only these model ids (comma-separated)")
    parser.add_argument("--strict", action="store_true", help="fail on the first unreadable or unknown row")

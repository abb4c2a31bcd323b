"""Read a SkyRL Tinker service's database, read-only: every request of its ``futures`` table, as the trace it is.

SkyRL keeps one ``futures`` row per request (``request_id`` is the arrival order, ``request_data`` the full input,
``result_data`` the output or the failure, ``created_at``/``completed_at`` the service's clock); ``models`` and
``checkpoints`` complete it. SOURCE is a SQLAlchemy URL (``sqlite:///tinker.db``, ``postgresql://...``) or a path to a
SQLite file. Nothing is ever written: SQLite is opened with ``mode=ro``, Postgres transactions are ``READ ONLY``, and
only SELECTs are sent.

Every row is parsed by ``traffic.rows`` (strict models with the scenario files' limits) before it is used: a row that
cannot be is a ``BadRow`` (table, id, reason), and a cell over ``MAX_ROW_BYTES`` is not even fetched. A file that is
not a SQLite database, or one that is corrupt or truncated, is one error line; a Postgres server that does not answer
fails the connection after ``CONNECT_TIMEOUT_S``.

The columns read are SkyRL 0.4.0's. A database whose tables lack one of them was written by a SkyRL whose schema has
changed: the error names the table, the column and the database's ``alembic_version`` revision (absent in 0.4.0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from skyrl_sim.errors import UserError
from skyrl_sim.schema.command_files import note_input
from skyrl_sim.schema.limits import MAX_ROW_BYTES
from skyrl_sim.traffic.rows import (
    STATUSES,
    BadRow,
    enum_text,
    failure_text,
    parse_json,
    parse_model_id,
    parse_request_id,
    parse_timestamp,
    row_label,
)

T = TypeVar("T")
CONNECT_TIMEOUT_S = 10
"""A Postgres server has this long to accept the connection (libpq's ``connect_timeout``), unless the URL says."""
KEEPALIVE_S = 30
"""A Postgres connection that stops answering is dropped after about 2x this (TCP keepalives), not waited on forever."""
SQLITE_HEADER = b"SQLite format 3\x00"

REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "futures": (
        "request_id",
        "request_type",
        "model_id",
        "request_data",
        "status",
        "created_at",
        "completed_at",
        "result_data",
    ),
}
OPTIONAL_TABLES: dict[str, tuple[str, ...]] = {
    "models": ("model_id", "base_model", "status", "request_id"),
    "checkpoints": ("model_id", "checkpoint_id", "checkpoint_type", "status"),
}
KNOWN_ALEMBIC_REVISIONS: frozenset[str] = frozenset()  # skyrl 0.4.0 creates its tables without migrations


class SchemaChanged(UserError):
    """The database's tables are not the ones this importer reads."""


@dataclass(frozen=True)
class FutureRow:
    """One ``futures`` row, parsed: times in seconds since the epoch (UTC), JSON decoded (``request_data`` is still
    untyped: the importer reads it through its request type's model), the failure text of a failed row."""

    request_id: int
    request_type: str
    model_id: str | None
    request_data: Any
    status: str
    created_s: float
    completed_s: float | None
    error: str | None = None


@dataclass(frozen=True)
class DatabaseInfo:
    """What the importer found besides the futures: schema revision, models, checkpoints."""

    url: str
    dialect: str
    alembic_revision: str | None
    models: dict[str, dict[str, Any]]
    checkpoints: list[dict[str, Any]]


def database_url(source: str) -> str:
    """A SQLAlchemy URL for SOURCE: a URL as given, a path as a read-only SQLite URL (the file must exist)."""
    if not source.strip():
        raise UserError("import: an empty SOURCE; give a SQLite file or a SQLAlchemy URL such as sqlite:///tinker.db")
    if "://" in source:
        return source
    path = Path(source)
    _check_sqlite_file(source, path)
    return f"sqlite:///{path.resolve()}"


def sqlite_file(source: str) -> Path | None:
    """The SQLite file SOURCE names (a path, or a ``sqlite://`` URL's database), None for other databases."""
    if "://" not in source:
        return Path(source) if source.strip() else None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(source)
    except (ArgumentError, ValueError):
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def _check_sqlite_file(source: str, path: Path) -> None:
    """A regular file that starts with SQLite's header (an empty file is an empty database); one clear line
    otherwise, before SQLite is asked (it reads a FIFO forever and reports a text file only once queried)."""
    import stat

    note_input(path, "the database")
    try:
        info = path.stat()
    except FileNotFoundError:
        raise UserError(
            f"import: {source}: no such SQLite file (or give a SQLAlchemy URL such as sqlite:///tinker.db)"
        ) from None
    except OSError as exc:
        raise UserError(f"import: {source}: cannot read it: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise UserError(f"import: {source}: is a directory, not a SQLite file")
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"import: {source}: is not a regular file (a device or a pipe), not a SQLite file")
    try:
        with path.open("rb") as handle:
            head = handle.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise UserError(f"import: {source}: cannot read it: {exc.strerror}") from None
    if head and head != SQLITE_HEADER:
        raise UserError(f"import: {source}: not a SQLite database (the file does not start with SQLite's header)")


def _read_only_sqlite(url: str) -> str:
    """The SQLite URL opened with ``mode=ro`` (a URI filename), so the driver itself refuses any write."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if not database or database == ":memory:":
        raise UserError(f"import: {url}: names no SQLite file")
    _check_sqlite_file(url, Path(database))
    return f"sqlite:///file:{Path(database).resolve()}?mode=ro&uri=true"


_decode_text = functools.partial(bytes.decode, encoding="utf-8", errors="surrogateescape")
"""SQLite text as str; bytes that are not UTF-8 stay visible as lone surrogates, which ``traffic.rows`` refuses for
that row (Python's default would fail the whole query at that row). A partial of a C method: called for every text
cell, a Python function would cost a second per 100,000 rows."""


def database_errors(source: str) -> Callable[[Callable[[], T]], T]:
    """Run a database step; a driver error (corrupt file, lost server, locked database) becomes one UserError."""

    def run(step: Callable[[], T]) -> T:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            return step()
        except SQLAlchemyError as exc:
            raise UserError(f"import: {source}: cannot read the database: {_driver_reason(exc)}") from None

    return run


def _driver_reason(exc: Exception) -> str:
    """The driver's own message, first line, with what it means for a SQLite file."""
    original = getattr(exc, "orig", None) or exc
    text = str(original).strip().splitlines()[0] if str(original).strip() else type(original).__name__
    lowered = text.lower()
    if "malformed" in lowered or "not a database" in lowered or "disk i/o" in lowered:
        return f"{text} (the file is corrupt or truncated, or not a SQLite database)"
    return text


def _postgres_driver(url: str) -> str:
    """A plain ``postgresql://`` URL names SQLAlchemy's default driver (psycopg2); use psycopg 3 (the ``postgres``
    extra) when only that one is installed. Any other URL is kept as given."""
    import importlib.util

    plain = url.startswith("postgresql://")
    if plain and importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


class SkyRLDatabase:
    """One SkyRL database, opened read-only. Use as a context manager."""

    def __init__(self, source: str) -> None:
        from sqlalchemy import create_engine, event
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError

        self.source = source
        self.url = database_url(source)
        try:
            from sqlalchemy.engine import make_url

            dialect = make_url(self.url).get_backend_name()
        except (ArgumentError, ValueError) as exc:
            raise UserError(f"import: {source}: not a database URL ({exc})") from None
        self.dialect = dialect
        connect_url = _read_only_sqlite(self.url) if dialect == "sqlite" else _postgres_driver(self.url)
        try:
            self.engine = create_engine(connect_url, connect_args=_connect_args(dialect, connect_url))
        except (NoSuchModuleError, ModuleNotFoundError) as exc:
            extra = " (install the postgres extra: pip install 'skyrl-sim[postgres]')" if dialect == "postgresql" else ""
            raise UserError(f"import: {source}: no database driver for '{dialect}'{extra}: {exc}") from None
        except (ArgumentError, ValueError, TypeError) as exc:  # a URL SQLAlchemy or the driver cannot parse
            raise UserError(f"import: {source}: not a usable database URL ({exc})") from None
        if dialect == "sqlite":

            @event.listens_for(self.engine, "connect")
            def _text(dbapi_connection: Any, _record: Any) -> None:
                dbapi_connection.text_factory = _decode_text

        if dialect == "postgresql":

            @event.listens_for(self.engine, "begin")
            def _read_only(conn: Any) -> None:
                conn.exec_driver_sql("SET TRANSACTION READ ONLY")

        try:
            self.connection = self.engine.connect()
        except Exception as exc:  # driver errors differ per database; all mean the same to a user
            self.engine.dispose()
            reason = _driver_reason(exc)
            raise UserError(f"import: {source}: cannot open the database: {type(exc).__name__}: {reason}") from None
        self.guard = database_errors(source)
        self.bad_rows: list[BadRow] = []
        try:
            self.columns = self.guard(self._check_schema)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.connection.close()
        self.engine.dispose()

    def __enter__(self) -> SkyRLDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alembic_revision(self) -> str | None:
        from sqlalchemy import inspect, text

        if "alembic_version" not in inspect(self.connection).get_table_names():
            return None
        row = self.connection.execute(text("SELECT version_num FROM alembic_version")).first()
        if not row or row[0] is None:
            return None
        revision = row[0] if isinstance(row[0], str) else row_label(row[0])
        return revision if revision.isprintable() and len(revision) <= 64 else row_label(revision)

    def _check_schema(self) -> dict[str, set[str]]:
        """Every table and column read must exist; else the schema has changed, named with its alembic revision."""
        from sqlalchemy import inspect

        inspector = inspect(self.connection)
        tables = set(inspector.get_table_names())
        revision = self.alembic_revision()
        named = f"alembic_version {revision}" if revision else "no alembic_version table"
        columns: dict[str, set[str]] = {}
        for table, needed in REQUIRED_COLUMNS.items():
            if table not in tables:
                what = "not a SkyRL database" if not tables & {"models", "sessions"} else "SkyRL's schema has changed"
                raise SchemaChanged(f"import: {self.source}: no table '{table}' ({what}; {named})")
            columns[table] = {c["name"] for c in inspector.get_columns(table)}
            missing = [c for c in needed if c not in columns[table]]
            if missing:
                raise SchemaChanged(
                    f"import: {self.source}: table '{table}' has no column '{missing[0]}': SkyRL's schema has changed "
                    f"({named}; skyrl-sim reads skyrl 0.4.0's tables)"
                )
        for table, wanted in OPTIONAL_TABLES.items():
            if table in tables:
                have = {c["name"] for c in inspector.get_columns(table)}
                if all(c in have for c in wanted):
                    columns[table] = have
        return columns

    def info(self) -> DatabaseInfo:
        return self.guard(self._info)

    def _info(self) -> DatabaseInfo:
        from sqlalchemy import text

        models: dict[str, dict[str, Any]] = {}
        if "models" in self.columns:
            rows = self.connection.execute(text("SELECT model_id, base_model, status, request_id FROM models"))
            for model_id, base_model, status, request_id in rows:
                try:
                    name = parse_model_id(model_id)
                    if name is None:
                        raise ValueError("model_id is empty")
                except ValueError as exc:
                    self.bad_rows.append(BadRow("models", row_label(model_id), str(exc)))
                    continue
                models[name] = {"base_model": _shown(base_model), "status": _shown(status), "request_id": request_id}
        checkpoints: list[dict[str, Any]] = []
        if "checkpoints" in self.columns:
            rows = self.connection.execute(
                text("SELECT model_id, checkpoint_id, checkpoint_type, status FROM checkpoints ORDER BY model_id")
            )
            for model_id, checkpoint_id, checkpoint_type, status in rows:
                checkpoints.append(
                    {
                        "model_id": _shown(model_id),
                        "checkpoint_id": _shown(checkpoint_id),
                        "type": _shown(checkpoint_type),
                        "status": _shown(status),
                    }
                )
        return DatabaseInfo(self.url, self.dialect, self.alembic_revision(), models, checkpoints)

    def futures(self) -> Iterator[FutureRow | BadRow]:
        """Every futures row in request id order: a ``FutureRow``, or a ``BadRow`` saying why it cannot be used. A
        cell larger than ``MAX_ROW_BYTES`` is measured by the database and not fetched; ``result_data`` is fetched
        only for failed rows (a completed row's may be megabytes of logprobs, and nothing of it is used)."""
        from sqlalchemy import text

        # bytes of a cell, as each database counts them (SQLite's length() of text counts characters up to a NUL)
        size = "length(CAST({} AS BLOB))" if self.dialect == "sqlite" else "octet_length(CAST({} AS TEXT))"
        data_size, result_size = size.format("request_data"), size.format("result_data")
        query = text(
            "SELECT request_id, request_type, model_id, "
            f"CASE WHEN {data_size} > :limit THEN NULL ELSE request_data END, {data_size}, "
            "status, created_at, completed_at, "
            f"CASE WHEN lower(CAST(status AS TEXT)) = 'failed' AND {result_size} <= :limit THEN result_data END "
            "FROM futures ORDER BY request_id"
        )
        rows = self.guard(
            lambda: self.connection.execution_options(stream_results=True).execute(query, {"limit": MAX_ROW_BYTES})
        )
        previous: int | None = None
        while True:
            batch = self.guard(lambda: rows.fetchmany(1000))
            if not batch:
                return
            for raw in batch:
                row = parse_future(*raw)
                if isinstance(row, FutureRow):
                    if row.request_id == previous:
                        row = BadRow("futures", str(row.request_id), "request_id appears twice (it is the primary key)")
                    else:
                        previous = row.request_id
                yield row


def _shown(value: Any) -> Any:
    """A value of the informational tables as it may be printed: text that is valid and printable, else its repr."""
    if value is None or isinstance(value, (int, float)):
        return value
    value = getattr(value, "value", value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return row_label(value.encode("utf-8", "surrogateescape"))
        return value if value.isprintable() and len(value) <= 256 else row_label(value)
    return row_label(value)


def parse_future(
    request_id: Any,
    request_type: Any,
    model_id: Any,
    request_data: Any,
    data_size: Any,
    status: Any,
    created: Any,
    completed: Any,
    result_data: Any,
) -> FutureRow | BadRow:
    """One futures row through ``traffic.rows``, or the reason it cannot be used."""
    try:
        rid = parse_request_id(request_id)
    except ValueError as exc:
        return BadRow("futures", row_label(request_id), str(exc))
    try:
        if isinstance(data_size, int) and data_size > MAX_ROW_BYTES:
            raise ValueError(f"request_data is {data_size:,} bytes, over the limit of {MAX_ROW_BYTES:,} for one cell")
        if request_data is None:
            raise ValueError("request_data is empty (NULL)")
        kind = enum_text(request_type, "request_type")
        state = enum_text(status, "status")
        if state not in STATUSES:
            raise ValueError(f"status '{state}' is not one of SkyRL's ({', '.join(STATUSES)})")
        created_s = parse_timestamp(created, "created_at")
        completed_s = None if completed is None else parse_timestamp(completed, "completed_at")
        if completed_s is not None and completed_s < created_s:
            raise ValueError("completed_at is before created_at")
        error = failure_text(_result(result_data)) if state == "failed" else None
        return FutureRow(
            request_id=rid,
            request_type=kind,
            model_id=parse_model_id(model_id),
            request_data=parse_json(request_data, "request_data"),
            status=state,
            created_s=created_s,
            completed_s=completed_s,
            error=error,
        )
    except ValueError as exc:
        return BadRow("futures", str(rid), str(exc))


def _result(result_data: Any) -> Any:
    """A failed row's ``result_data`` (SkyRL's ``ErrorResponse`` as JSON text); text that is no JSON is the message."""
    try:
        return parse_json(result_data, "result_data")
    except ValueError:
        return {"error": result_data} if isinstance(result_data, str) else None


def _connect_args(dialect: str, url: str) -> dict[str, Any]:
    """libpq's connection timeout and keepalives for Postgres, unless the URL sets them; nothing for other drivers."""
    if dialect != "postgresql":
        return {}
    from sqlalchemy.engine import make_url

    given = make_url(url).query
    wanted = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1,
        "keepalives_idle": KEEPALIVE_S,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    return {key: value for key, value in wanted.items() if key not in given}

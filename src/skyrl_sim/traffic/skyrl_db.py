"""Read a SkyRL Tinker service's database, read-only: every request of its ``futures`` table, as the trace it is.

SkyRL keeps one ``futures`` row per request (``request_id`` is the arrival order, ``request_data`` the full input,
``result_data`` the output or the failure, ``created_at``/``completed_at`` the service's clock); ``models`` and
``checkpoints`` complete it. SOURCE is a SQLAlchemy URL (``sqlite:///tinker.db``, ``postgresql://...``) or a path to a
SQLite file. Nothing is ever written: SQLite is opened with ``mode=ro``, Postgres transactions are ``READ ONLY``, and
only SELECTs are sent.

The columns read are SkyRL 0.4.0's. A database whose tables lack one of them was written by a SkyRL whose schema has
changed: the error names the table, the column and the database's ``alembic_version`` revision (absent in 0.4.0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from skyrl_sim.errors import UserError

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
    """One ``futures`` row, decoded: times in seconds since the epoch (UTC), JSON parsed."""

    request_id: int
    request_type: str
    model_id: str | None
    request_data: Any
    status: str
    created_s: float
    completed_s: float | None
    result_data: Any


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
    if "://" in source:
        return source
    path = Path(source)
    if not path.is_file():
        raise UserError(f"import: {source}: no such SQLite file (or give a SQLAlchemy URL such as sqlite:///tinker.db)")
    return f"sqlite:///{path.resolve()}"


def _read_only_sqlite(url: str) -> str:
    """The SQLite URL opened with ``mode=ro`` (a URI filename), so the driver itself refuses any write."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    if not database or database == ":memory:":
        raise UserError(f"import: {url}: names no SQLite file")
    if not Path(database).is_file():
        raise UserError(f"import: {url}: no such SQLite file '{database}'")
    return f"sqlite:///file:{Path(database).resolve()}?mode=ro&uri=true"


def _postgres_driver(url: str) -> str:
    """A plain ``postgresql://`` URL names SQLAlchemy's default driver (psycopg2); use psycopg 3 (the ``postgres``
    extra) when only that one is installed. Any other URL is kept as given."""
    import importlib.util

    plain = url.startswith("postgresql://")
    if plain and importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def to_seconds(value: Any) -> float | None:
    """A timestamp column as epoch seconds: a datetime (Postgres) or SQLite's text; naive times are UTC (SkyRL writes
    ``datetime.now(timezone.utc)``)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        raise ValueError(f"not a timestamp: {value!r}")
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def parse_json(value: Any) -> Any:
    """A JSON column as Python data: text/bytes (SQLite, or SkyRL's text ``result_data``) parsed; data as is."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return orjson.loads(bytes(value) if isinstance(value, memoryview) else value)
    return value


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
        except ArgumentError as exc:
            raise UserError(f"import: {source}: not a database URL ({exc})") from None
        self.dialect = dialect
        connect_url = _read_only_sqlite(self.url) if dialect == "sqlite" else _postgres_driver(self.url)
        try:
            self.engine = create_engine(connect_url)
        except (NoSuchModuleError, ModuleNotFoundError) as exc:
            extra = " (install the postgres extra: pip install 'skyrl-sim[postgres]')" if dialect == "postgresql" else ""
            raise UserError(f"import: {source}: no database driver for '{dialect}'{extra}: {exc}") from None
        if dialect == "postgresql":

            @event.listens_for(self.engine, "begin")
            def _read_only(conn: Any) -> None:
                conn.exec_driver_sql("SET TRANSACTION READ ONLY")

        try:
            self.connection = self.engine.connect()
        except Exception as exc:  # driver errors differ per database; all mean the same to a user
            self.engine.dispose()
            raise UserError(f"import: {source}: cannot open the database: {type(exc).__name__}: {exc}") from None
        self.columns = self._check_schema()

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
        return str(row[0]) if row else None

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
        from sqlalchemy import text

        models: dict[str, dict[str, Any]] = {}
        if "models" in self.columns:
            rows = self.connection.execute(text("SELECT model_id, base_model, status, request_id FROM models"))
            for model_id, base_model, status, request_id in rows:
                models[str(model_id)] = {"base_model": base_model, "status": status, "request_id": request_id}
        checkpoints: list[dict[str, Any]] = []
        if "checkpoints" in self.columns:
            rows = self.connection.execute(
                text("SELECT model_id, checkpoint_id, checkpoint_type, status FROM checkpoints ORDER BY model_id")
            )
            for model_id, checkpoint_id, checkpoint_type, status in rows:
                checkpoints.append(
                    {"model_id": model_id, "checkpoint_id": checkpoint_id, "type": checkpoint_type, "status": status}
                )
        return DatabaseInfo(self.url, self.dialect, self.alembic_revision(), models, checkpoints)

    def futures(self) -> Iterator[FutureRow | tuple[int, str]]:
        """Every futures row in request id order: a ``FutureRow``, or ``(request_id, reason)`` for a row that cannot
        be decoded (bad JSON, a bad timestamp)."""
        from sqlalchemy import text

        query = text(
            "SELECT request_id, request_type, model_id, request_data, status, created_at, completed_at, result_data "
            "FROM futures ORDER BY request_id"
        )
        result = self.connection.execution_options(stream_results=True).execute(query)
        for rid, rtype, model_id, data, status, created, completed, result_data in result:
            try:
                created_s = to_seconds(created)
                if created_s is None:
                    raise ValueError("created_at is empty")
                yield FutureRow(
                    request_id=int(rid),
                    request_type=str(getattr(rtype, "value", rtype)).lower(),
                    model_id=None if model_id is None else str(model_id),
                    request_data=parse_json(data),
                    status=str(getattr(status, "value", status)).lower(),
                    created_s=created_s,
                    completed_s=to_seconds(completed),
                    result_data=parse_json(result_data),
                )
            except (ValueError, TypeError, orjson.JSONDecodeError) as exc:
                yield (int(rid), f"{type(exc).__name__}: {exc}")

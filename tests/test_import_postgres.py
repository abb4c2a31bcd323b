"""``skyrl-sim import`` of a Postgres database (SkyRL's production store), on a throwaway Debian-packaged server.

The test starts its own server (``initdb`` + ``pg_ctl`` in a temporary directory, on 127.0.0.1 and a free port) when the
PostgreSQL binaries and the psycopg driver (``pip install 'skyrl-sim[postgres]'``) are there, and skips with the
reason otherwise: CI does not depend on it. The same generated traffic goes into Postgres and into SQLite; both
imports must give the same trace, and a write through the importer's connection must be refused.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from skyrl_sim.commands.trace_import import read_trace
from skyrl_sim.traffic.skyrl_db import SkyRLDatabase
from skyrl_sim.traffic.synthetic_db import write_synthetic_db
from skyrl_sim_plugins.megatron_vllm.local_ports import free_port


def pg_bin() -> Path | None:
    """The directory of ``initdb``/``pg_ctl``: Debian's /usr/lib/postgresql/N/bin, or on the PATH."""
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    return None


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    binaries = pg_bin()
    if binaries is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql to run this test")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("no psycopg driver: pip install 'skyrl-sim[postgres]' to run this test")
    prefix: list[str] = []
    data = Path(tempfile.mkdtemp(prefix="skyrl-sim-pg-"))  # not under pytest's root-only tmp: the server user reads it
    if os.geteuid() == 0:  # initdb refuses root: run the server as the packaged 'postgres' user
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        if shutil.which("runuser") is None:
            pytest.skip("running as root and no runuser to start the server as 'postgres'")
        os.chown(data, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    run = lambda *args: subprocess.run([*prefix, *args], check=True, capture_output=True, timeout=120)  # noqa: E731
    run(str(binaries / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "skyrl")
    options = f"-h 127.0.0.1 -p {port} -k {data}"
    run(str(binaries / "pg_ctl"), "-D", str(data / "db"), "-o", options, "-l", str(data / "log"), "-w", "start")
    try:
        yield f"postgresql://skyrl@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, str(binaries / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(data, ignore_errors=True)


def test_postgres_import_equals_sqlite_import(postgres_url: str, tmp_path: Path) -> None:
    write_synthetic_db(postgres_url.replace("postgresql://", "postgresql+psycopg://"), 120, tenants=2, oom_every=5)
    sqlite = write_synthetic_db(tmp_path / "tinker.db", 120, tenants=2, oom_every=5)
    from_pg = read_trace(postgres_url)
    from_sqlite = read_trace(str(sqlite))
    assert from_pg.info.dialect == "postgresql"
    assert from_pg.requests == from_sqlite.requests
    assert from_pg.loaded_at_start == from_sqlite.loaded_at_start


def test_postgres_connection_is_read_only(postgres_url: str) -> None:
    with SkyRLDatabase(postgres_url) as db, pytest.raises(Exception, match="read-only transaction"):
        db.connection.exec_driver_sql("CREATE TABLE intruder (a INTEGER)")

"""Hostile and damaged SkyRL databases: every row goes through ``traffic.rows`` before it is used.

A bad row is reported with its table, id and reason and skipped (or fails the import with ``--strict``); a file that
is no SQLite database is one line; what ``import`` writes always loads; the source database is never an output.
A property test feeds random rows of hostile values and holds every outcome to exit 0 or 2.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scenario_text import run_cli as cli
from skyrl_sim.cli import main
from skyrl_sim.schema.limits import MAX_TOKENS
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.traffic import skyrl_db

ROOT = Path(__file__).resolve().parents[1]
ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "tiny-cpu-tp1.yaml")
RECORDED_DB = ROOT / "tests" / "data" / "skyrl-0.4.0-recorded" / "tinker.db"
COLUMNS = ("request_id", "request_type", "model_id", "seq_id", "request_data", "result_data", "status", "created_at",
           "completed_at")  # fmt: skip
T0, T1 = "2026-11-30 13:00:00.000000", "2026-11-30 13:00:01.000000"


def pass_data(*lengths: int) -> str:
    datums = [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [7] * n}]}} for n in lengths]
    return json.dumps({"data": datums, "loss_fn": "cross_entropy"})


def sample_data(**params: Any) -> str:
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"temperature": 1.0, "max_tokens": 8, "seed": 0}, "num_samples": 1, "checkpoint_id": ""}
    for key, value in params.items():
        (body["sampling_params"] if key == "max_tokens" else body)[key] = value
    return json.dumps(body)  # fmt: skip


def row(rid: Any = 3, kind: Any = "FORWARD_BACKWARD", model: Any = "m1", data: Any = None, status: Any = "COMPLETED",
        created: Any = T1, completed: Any = T1, result: Any = "{}") -> tuple[Any, ...]:  # fmt: skip
    return (rid, kind, model, None, pass_data(5) if data is None else data, result, status, created, completed)


def loose_db(path: Path, rows: list[tuple[Any, ...]]) -> Path:
    """A futures table without column types (SQLite stores whatever it is given) after two good rows."""
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE futures ({', '.join(COLUMNS)})")
        good = [row(1, "CREATE_MODEL", data='{"lora_config": {"rank": 8}}', created=T0, completed=T0), row(2)]
        conn.executemany("INSERT INTO futures VALUES (?,?,?,?,?,?,?,?,?)", good + rows)
    conn.close()
    return path


def import_db(db: Path, out: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    """``import`` exit code and output, line wrapping undone."""
    code, text = cli(["import", str(db), "--endpoint", ENDPOINT, "--out", str(out), *flags], capsys)
    return code, " ".join(text.split())


BAD_ROWS = [
    (row(rid="abc"), "'abc'", "request_id 'abc' is not an integer"),
    (row(rid=None), "None", "request_id None is not an integer"),
    (row(rid=1.5), "1.5", "not an integer"),
    (row(rid="1" + "0" * 30), "'1000", "not an integer"),
    (row(rid=-5), "-5", "outside 0..2^63-1"),
    (row(rid=2), "2", "appears twice"),
    (row(data='{"data": [{"model_input": {"chunks": [{"type": "image", "expected_tokens": ' + "9" * 30 + "}]}}]}"),
     "3", "expected_tokens"),
    (row(data='{"data": [{"model_input": {"chunks": [{"type": "image", "expected_tokens": true}]}}]}'), "3",
     "expected_tokens"),
    (row(data=json.dumps({"data": [{"model_input": {"chunks": [{"tokens": "x" * 100}]}}]})), "3", "tokens"),
    (row(data=pass_data(0)), "3", "a datum without tokens"),
    (row(data='{"data": [{"model_input": {"chunks": [{"type": "image", "expected_tokens": 11000000}]}}]}'), "3",
     "less than or equal to 10000000"),
    (row(data=json.dumps({"data": []})), "3", "at least 1 item"),
    (row(data="[1, 2]"), "3", "not a JSON object"),
    (row(data="{not json"), "3", "not valid JSON"),
    (row(data="[" * 5000 + "]" * 5000), "3", "not valid JSON"),
    (row()[:4] + (None,) + row()[5:], "3", "request_data is empty"),
    (row(data=b'{"a": "\xff"}'), "3", "not valid JSON"),
    (row(kind="SAMPLE", data=sample_data(max_tokens=10**30)), "3", "max_tokens"),
    (row(kind="SAMPLE", data=sample_data(max_tokens=-5)), "3", "max_tokens"),
    (row(kind="SAMPLE", data=sample_data(max_tokens="16")), "3", "max_tokens"),
    (row(kind="SAMPLE", data=sample_data(max_tokens=MAX_TOKENS + 1)), "3", "max_tokens"),
    (row(kind="SAMPLE", data=sample_data(num_samples=-1)), "3", "num_samples"),
    (row(kind="OPTIM_STEP", data='{"adam_params": {"learning_rate": NaN}}'), "3", "not valid JSON"),
    (row(kind="OPTIM_STEP", data='{"adam_params": {"learning_rate": "NaN"}}'), "3", "learning_rate"),
    (row(kind="OPTIM_STEP", data='{"adam_params": {"learning_rate": -1}}'), "3", "learning_rate"),
    (row(kind="OPTIM_STEP", data='{"adam_params": {"learning_rate": 1e300}}'), "3", "learning_rate"),
    (row(kind="LOAD_WEIGHTS", data='{"checkpoint_id": null}'), "3", "checkpoint_id"),
    (row(kind="LOAD_WEIGHTS", data='{"checkpoint_id": "never-saved"}'), "3", "which no earlier imported save writes"),
    (row(created="yesterday"), "3", "created_at 'yesterday' is not an ISO 8601 time"),
    (row(created=None), "3", "created_at None is not a timestamp"),
    (row(created=0), "3", "created_at 0 is not a timestamp"),
    (row(completed="2000-01-01 00:00:00"), "3", "completed_at is before created_at"),
    (row(kind=None), "3", "request_type None is not text"),
    (row(kind="EXTERNAL"), "3", "unknown request type 'external'"),
    (row(status="EXPLODED"), "3", "status 'exploded' is not one of SkyRL's"),
    (row(model="m" * 5000), "3", "over the limit of 4,096"),
    (row(model="\x1b[31mred"), "3", "control characters"),
    (row(model=b"\xff\xfe"), "3", "is not text"),
    (row(model=42), "3", "model_id 42 is not text"),
]


@pytest.mark.parametrize(("bad", "row_id", "reason"), BAD_ROWS, ids=[r for _, _, r in BAD_ROWS])
def test_a_bad_row_is_named_and_skipped_or_fatal_with_strict(tmp_path, capsys, bad, row_id, reason):
    db = loose_db(tmp_path / "t.db", [bad])
    out = tmp_path / "s.yaml"
    code, text = import_db(db, out, capsys, "--strict")
    assert code == 2 and f"futures row {row_id}" in text and reason in text and not out.exists(), text
    code, text = import_db(db, out, capsys)
    assert code == 0 and "skipped 1 rows" in text and reason in text, text
    assert load_scenario(out).resolve("default").request_count() == 2  # what import writes loads


def test_text_that_is_not_utf8_is_one_bad_row(tmp_path, capsys):
    db = loose_db(tmp_path / "t.db", [])
    with sqlite3.connect(db) as conn:  # TEXT bytes that are not UTF-8 (Python's default would fail the whole query)
        conn.execute("INSERT INTO futures VALUES (3, 'FORWARD', CAST(x'fffe' AS TEXT), NULL, ?, '{}', 'COMPLETED', ?, ?)",
                     (pass_data(4), T1, T1))  # fmt: skip
    conn.close()
    code, text = cli(["import", str(db), "--endpoint", ENDPOINT, "--out", str(tmp_path / "s.yaml")], capsys)
    assert code == 0 and "futures row 3: model_id" in text and "not valid UTF-8" in text, text


def test_a_cell_over_the_limit_is_measured_not_fetched(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(skyrl_db, "MAX_ROW_BYTES", 4096)
    db = loose_db(tmp_path / "t.db", [row(data=pass_data(2000))])
    code, text = cli(["import", str(db), "--endpoint", ENDPOINT, "--out", str(tmp_path / "s.yaml"), "--strict"], capsys)
    assert code == 2 and "futures row 3: request_data is" in text and "over the limit of 4,096" in text, text


def test_a_clock_far_off_is_named_with_the_filters_that_leave_it_out(tmp_path, capsys):
    db = loose_db(tmp_path / "t.db", [row(created="9999-12-31 23:59:59", completed="9999-12-31 23:59:59")])
    code, text = cli(["import", str(db), "--endpoint", ENDPOINT, "--out", str(tmp_path / "s.yaml")], capsys)
    assert code == 2 and "request 1 to 3" in text and "31-day limit" in text and "--since/--until" in text, text


def test_a_row_earlier_than_the_first_id_starts_the_clock(tmp_path, capsys):
    """Ids follow arrival order, but a time written with another zone can come before the first row's."""
    db = loose_db(tmp_path / "t.db", [row(created="2026-11-30T13:00:05+14:00", completed="2026-11-30T13:00:06+14:00")])
    out = tmp_path / "s.yaml"
    code, text = import_db(db, out, capsys, "--strict")
    assert code == 0, text
    times = [t for c in load_scenario(out).resolve("default").workload.clients for t in c.submit.times_s or []]
    assert min(times) == 0.0 and max(times) == pytest.approx(14 * 3600 - 5 + 1, abs=1e-6)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"this is not a database\n" * 10, "not a SQLite database"),
        (b"", "no table 'futures'"),
        ("truncated", "corrupt or truncated"),
        ("header", "corrupt or truncated"),
    ],
)
def test_a_file_that_is_no_sqlite_database_is_one_line(tmp_path, capsys, content, needle):
    db = tmp_path / "t.db"
    data = RECORDED_DB.read_bytes()
    db.write_bytes({"truncated": data[: len(data) // 2], "header": data[:100]}.get(content, content))  # type: ignore[call-overload]
    for command in (["import", str(db), "--out", str(tmp_path / "s.yaml")], ["replay", str(db)]):
        code, text = cli([*command, "--endpoint", ENDPOINT], capsys)
        assert code == 2 and needle in text and "Traceback" not in text and len(text.strip().splitlines()) == 1, text


def test_pipes_directories_and_empty_urls_are_refused_before_sqlite_opens_them(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo.db")  # SQLite would wait on it forever
    for source, needle in (
        (str(tmp_path / "fifo.db"), "not a regular file"),
        (str(tmp_path), "is a directory"),
        ("", "an empty SOURCE"),
        ("sqlite:///:memory:", "names no SQLite file"),
        ("postgresql://u@[::1/x", "not a database URL"),
    ):
        code, text = cli(["import", source, "--endpoint", ENDPOINT, "--out", str(tmp_path / "s.yaml")], capsys)
        assert code == 2 and needle in text and "Traceback" not in text, (source, text)


def test_a_closed_postgres_port_is_one_line(capsys):
    pytest.importorskip("psycopg")
    code, text = cli(["import", "postgresql://u@127.0.0.1:1/x", "--endpoint", ENDPOINT, "--out", "/tmp/x.yaml"], capsys)
    assert code == 2 and "127.0.0.1" in text and "cannot open the database" in text and "Traceback" not in text


def test_the_postgres_connection_is_bounded_in_time():
    args = skyrl_db._connect_args("postgresql", "postgresql://u@h/x")
    assert args["connect_timeout"] == skyrl_db.CONNECT_TIMEOUT_S and args["keepalives"] == 1
    assert "connect_timeout" not in skyrl_db._connect_args("postgresql", "postgresql://u@h/x?connect_timeout=3")
    assert skyrl_db._connect_args("sqlite", "sqlite:///x.db") == {}


def test_the_source_database_is_never_an_output(tmp_path, capsys):
    db = tmp_path / "src.db"
    db.write_bytes(RECORDED_DB.read_bytes())
    before = db.read_bytes()
    link = tmp_path / "link.yaml"
    link.symlink_to(db)
    for source, out in ((str(db), db), (f"sqlite:///{db}", db), (str(db), link)):
        code, text = cli(["import", source, "--endpoint", ENDPOINT, "--out", str(out)], capsys)
        assert code == 2 and "is the database the command reads" in text, text
    code, text = cli(["replay", str(db), "--endpoint", ENDPOINT, "--scenario-out", str(db)], capsys)
    assert code == 2 and "is the database the command reads" in text
    assert db.read_bytes() == before


# ------------------------------------------------------------------------------------------ property test

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
)
CELL = NUMBERS.map(lambda v: str(v) if isinstance(v, int) and not -(2**63) <= v < 2**63 else v)
"""A value SQLite can store in a cell (an integer past 64 bits goes in as its text, as a hand-made database would)."""
JSON_LEAF = st.one_of(NUMBERS, st.lists(st.integers(-3, 3), max_size=5), st.just([7] * 20))
TIMES = st.one_of(
    st.datetimes(timezones=st.none()).map(lambda t: t.isoformat(sep=" ")),
    st.sampled_from([T0, T1, "2026-11-30T13:00:05+14:00", "yesterday", ""]),
    st.integers(-5, 10**12),
    st.none(),
)


@st.composite
def request_data(draw: st.DrawFn) -> Any:
    """SkyRL-shaped request_data with hostile leaves, or junk text."""
    shape = draw(st.sampled_from(["pass", "optim", "sample", "load", "save", "junk", "nested"]))
    leaf = draw(JSON_LEAF)
    if shape == "pass":
        chunk = draw(st.sampled_from([{"tokens": leaf}, {"expected_tokens": leaf}]))
        body: Any = {"data": [{"model_input": {"chunks": [chunk]}}]}
    elif shape == "optim":
        body = {"adam_params": {"learning_rate": leaf}}
    elif shape == "sample":
        prompt = {"chunks": [{"tokens": [1, 2]}]}
        body = {"prompt": prompt, "sampling_params": {"max_tokens": leaf}, "num_samples": draw(NUMBERS)}
    elif shape == "load":
        body = {"checkpoint_id": leaf}
    elif shape == "save":
        body = {"path": leaf}
    elif shape == "nested":
        body = "[" * draw(st.integers(1, 3000)) + "]" * draw(st.integers(0, 3000))
        return body
    else:
        return draw(st.one_of(st.text(max_size=30), st.binary(max_size=30), st.none(), CELL))
    return json.dumps(body, allow_nan=True)


HOSTILE_ROW = st.tuples(
    st.one_of(st.integers(-3, 12), st.text(max_size=5), st.none(), st.floats(allow_nan=False)),
    st.sampled_from(["FORWARD_BACKWARD", "FORWARD", "OPTIM_STEP", "SAMPLE", "LOAD_WEIGHTS", "SAVE_WEIGHTS",
                     "SAVE_WEIGHTS_FOR_SAMPLER", "CREATE_MODEL", "UNLOAD_MODEL", "EXTERNAL", "junk", ""]) | CELL,
    st.one_of(st.sampled_from(["m1", "m2", "", "[/red]"]), st.text(max_size=6), st.none(), st.binary(max_size=4)),
    st.none(),
    request_data(),
    st.one_of(st.none(), st.just('{"error": "CUDA out of memory"}'), st.text(max_size=10)),
    st.sampled_from(["COMPLETED", "FAILED", "PENDING", "weird"]) | CELL,
    TIMES,
    TIMES,
)  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(HOSTILE_ROW, min_size=1, max_size=6), strict=st.booleans())
def test_hostile_rows_end_in_exit_0_or_2_and_what_is_written_loads(tmp_path_factory, rows, strict):
    folder = tmp_path_factory.mktemp("rows")
    db = loose_db(folder / "t.db", rows)
    out = folder / "s.json"
    args = ["import", str(db), "--endpoint", ENDPOINT, "--out", str(out)] + (["--strict"] if strict else [])
    code = main(args)
    assert code in (0, 2)
    if code == 0:
        assert load_scenario(out).resolve("default").request_count() >= 1

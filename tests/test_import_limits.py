"""What ``import`` writes loads and runs: a row past the scenario schema's limits (a 20M-token datum, a NaN or huge
learning rate, a negative sample count) is reported with its id and skipped (``--strict``: the import fails), and a
window longer than the workload's time limit is refused before anything is written."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import orjson
import pytest

from scenario_text import run_cli, write
from skyrl_sim.schema.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
JAX_ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml")
RECORDED = ROOT / "tests" / "data" / "skyrl-0.4.0-recorded" / "tinker.db"


def edited(tmp_path: Path, request_id: int, edit) -> Path:
    """A copy of the recorded database with one row's request_data changed by ``edit``."""
    db = tmp_path / "tinker.db"
    if not db.exists():
        shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as conn:
        (data,) = conn.execute("SELECT request_data FROM futures WHERE request_id = ?", (request_id,)).fetchone()
        body = orjson.loads(data)
        edit(body)
        conn.execute("UPDATE futures SET request_data = ? WHERE request_id = ?", (orjson.dumps(body), request_id))
    return db


def huge_datum(body: dict) -> None:
    body["data"][0]["model_input"]["chunks"] = [{"type": "image", "expected_tokens": 20_000_000}]


def nan_rate(body: dict) -> None:
    body["adam_params"]["learning_rate"] = "nan"


def negative_samples(body: dict) -> None:
    body["num_samples"] = -3


def huge_rate(body: dict) -> None:
    body["adam_params"]["learning_rate"] = 1e9


BAD_ROWS = [  # (row, edit, what the database boundary's message names: the field and the limit it misses)
    (2, huge_datum, "less than or equal to 10000000"),
    (25, nan_rate, "learning_rate: Input should be a valid number"),
    (27, negative_samples, "num_samples: Input should be greater than or equal to 1"),
    (26, huge_rate, "learning_rate: Input should be less than or equal to 1000"),
]


def test_rows_out_of_range_are_reported_and_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for request_id, edit, _ in BAD_ROWS:
        db = edited(tmp_path, request_id, edit)
    out = tmp_path / "week.yaml"
    code, text = run_cli(["import", str(db), "--endpoint", JAX_ENDPOINT, "--out", str(out)], capsys)
    assert code == 0
    assert f"skipped {len(BAD_ROWS)} rows" in text
    flat = " ".join(text.split())  # the console wraps long lines
    for request_id, _, shown in BAD_ROWS:
        assert f"futures row {request_id}: " in flat and shown in flat
    scenario = load_scenario(out)  # what import wrote loads ...
    assert scenario.resolve("default").request_count() == 34 - len(BAD_ROWS)
    code, text = run_cli(["check", str(out)], capsys)  # ... and runs
    assert code in (0, 1) and "error" not in text.lower().split("\n")[0]


@pytest.mark.parametrize(("request_id", "edit", "shown"), BAD_ROWS)
def test_strict_fails_on_a_row_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture[str], request_id, edit, shown):
    db = edited(tmp_path, request_id, edit)
    out = tmp_path / "week.yaml"
    code, text = run_cli(["import", str(db), "--endpoint", JAX_ENDPOINT, "--out", str(out), "--strict"], capsys)
    assert code == 2 and f"futures row {request_id}" in text and shown in text and "Traceback" not in text
    assert not out.exists()


def test_a_window_longer_than_the_time_limit_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "tinker.db"
    shutil.copy(RECORDED, db)
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE futures SET created_at = '2027-01-30 00:00:00.000000', completed_at = '2027-01-30 00:00:01.000000' "
            "WHERE request_id = 34"
        )
    out = tmp_path / "week.yaml"
    code, text = run_cli(["import", str(db), "--endpoint", JAX_ENDPOINT, "--out", str(out)], capsys)
    assert code == 2 and "31-day limit" in text and "--since/--until" in text
    assert not out.exists()


@pytest.mark.parametrize(
    ("column", "value", "key"),
    [
        ("forward_backward: [[20000000]]", "", "trace.forward_backward.0.0"),
        ("optim_step: [1.0e+9]", "", "trace.optim_step.0"),
    ],
)
def test_a_hand_written_trace_is_held_to_the_same_limits(tmp_path, capsys, column, value, key) -> None:
    kind = column.split(":")[0]
    text = f"""
name: t
endpoint: {JAX_ENDPOINT}
workload:
  clients:
    - model_id: m
      trace: {{types: [{kind}], {column}}}
"""
    code, out = run_cli(["check", str(write(tmp_path, text))], capsys)
    assert code == 2 and key in out and "Traceback" not in out

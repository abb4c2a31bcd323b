"""``--json`` has one document shape whatever the number of variants: ``{"schema", "runs": [...]}``; files of the
older shape (one run as the document) are still read."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from project_paths import SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.results.result import SCHEMA, RunResult, read_results

SEED = str(SCENARIOS / "queue_drain_17.yaml")


@pytest.mark.parametrize(
    "selection", [["--variant", "cap-aware"], ["--all-variants"], ["--variant", "no-cap", "--variant", "cap-aware"]]
)
@pytest.mark.parametrize("command", ["run", "check"])
def test_one_shape_for_any_number_of_variants(tmp_path: Path, command: str, selection: list[str]) -> None:
    out = tmp_path / "r.json"
    main(
        [command, SEED, *selection, "--json", str(out), "--quiet"]
        if command == "check"
        else [command, SEED, *selection, "--json", str(out)]
    )
    body = orjson.loads(out.read_bytes())
    assert set(body) == {"schema", "runs"} and body["schema"] == SCHEMA
    names = [run["variant"] for run in body["runs"]]
    expected = [v for v in selection if not v.startswith("--")] or ["no-cap", "cap-only", "cap-aware"]
    assert names == expected
    assert [r.variant for r in read_results(out)] == expected


def test_stdout_has_the_same_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", SEED, "--variant", "cap-aware", "--json", "-"]) == 0
    body = orjson.loads(capsys.readouterr().out)
    assert set(body) == {"schema", "runs"} and len(body["runs"]) == 1


def test_a_file_of_the_older_one_run_shape_is_still_read(tmp_path: Path, run_sim) -> None:
    run = run_sim("queue_drain_17.yaml", "cap-aware")
    old = tmp_path / "old.json"
    run.write(old)  # the run itself as the document, as --json wrote one run before
    assert set(orjson.loads(old.read_bytes())) >= {"calls", "requests", "summary"}
    assert read_results(old)[0].to_json() == run.to_json()
    assert RunResult.read(old).to_json() == run.to_json()


def test_compare_and_calibrate_read_what_run_writes(tmp_path: Path) -> None:
    saved = tmp_path / "saved.json"
    assert main(["run", SEED, "--variant", "cap-aware", "--json", str(saved)]) == 0
    assert main(["compare", SEED, "--backends", "sim", "--against", str(saved), "--quiet"]) == 0
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", str(saved), "--profile", "fitted", "--out", str(out)]) in (0, 1)
    assert out.exists()

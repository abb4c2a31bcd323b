"""Any RunResult the tool wrote can be read back, however large: a file in the tool's own layout is read record by
record (requests spooled), and reads back to the same RunResult as the whole file parsed at once."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from project_paths import SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.results import result as result_module
from skyrl_sim.results.record_spool import RecordSpool
from skyrl_sim.results.result import RunResult, read_results, write_results
from skyrl_sim.results.result_stream import read_streamed, written_by_the_tool

SEED = str(SCENARIOS / "queue_drain_17.yaml")


@pytest.fixture(scope="module")
def seed_runs(host) -> list[RunResult]:
    from skyrl_sim.schema.scenario import load_scenario

    scenario = load_scenario(SEED)
    return [host.run(scenario.resolve(name), "sim") for name in scenario.variant_names]


@pytest.fixture
def stream_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(result_module, "STREAM_ABOVE_BYTES", 0)


@pytest.mark.parametrize("count", [1, 3])
def test_a_streamed_read_equals_the_whole_read(tmp_path: Path, seed_runs, stream_everything, count: int) -> None:
    path = tmp_path / "runs.json"
    write_results(seed_runs[:count], path)
    assert written_by_the_tool(path.read_bytes()[:4096])
    whole = [RunResult.from_dict(item) for item in orjson.loads(path.read_bytes())["runs"]]
    streamed = read_results(path)
    assert all(isinstance(run.requests, RecordSpool) for run in streamed)
    assert [run.to_json() for run in streamed] == [run.to_json() for run in whole]
    assert any(call.oom is not None and call.memory for run in streamed for call in run.calls)  # nested records too


def test_a_file_of_one_run_as_the_document_streams_too(tmp_path: Path, seed_runs, stream_everything) -> None:
    path = tmp_path / "one.json"
    seed_runs[0].write(path)
    with path.open("rb") as handle:
        (fields,) = read_streamed(handle)
    assert RunResult(**fields).to_json() == seed_runs[0].to_json()


def test_a_large_file_the_tool_wrote_is_read_past_the_whole_file_limit(tmp_path, seed_runs, monkeypatch) -> None:
    path = tmp_path / "big.json"
    write_results(seed_runs, path)
    size = path.stat().st_size
    monkeypatch.setattr(result_module, "MAX_RESULT_BYTES", size // 4)  # as if it were 4x the limit
    monkeypatch.setattr(result_module, "STREAM_ABOVE_BYTES", size // 8)
    assert [r.to_json() for r in read_results(path)] == [r.to_json() for r in seed_runs]
    compact = tmp_path / "compact.json"  # the same runs in a layout the tool does not write: refused over the limit
    compact.write_bytes(orjson.dumps(orjson.loads(path.read_bytes())))
    with pytest.raises(Exception, match="over the limit.*layout skyrl-sim writes"):
        read_results(compact)


def test_compare_and_calibrate_read_a_streamed_file(tmp_path: Path, stream_everything) -> None:
    saved = tmp_path / "saved.json"
    assert main(["run", SEED, "--variant", "cap-aware", "--json", str(saved)]) == 0
    assert main(["compare", SEED, "--backends", "sim", "--against", str(saved), "--quiet"]) == 0
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", str(saved), "--profile", "fitted", "--out", str(out)]) in (0, 1)
    assert out.exists()


def test_a_truncated_file_is_one_clear_error(tmp_path: Path, seed_runs, stream_everything, capsys) -> None:
    path = tmp_path / "cut.json"
    write_results(seed_runs, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert main(["compare", SEED, "--backends", "sim", "--against", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a skyrl-sim RunResult" in err and "Traceback" not in err


def test_requests_out_of_id_order_are_kept_in_file_order(tmp_path: Path, seed_runs, stream_everything) -> None:
    run = seed_runs[2]
    shuffled = RunResult(**{**run.__dict__, "requests": list(reversed(list(run.requests)))})
    path = tmp_path / "shuffled.json"
    write_results([shuffled], path)
    (back,) = read_results(path)
    assert [r.id for r in back.requests] == [r.id for r in shuffled.requests]
    assert back.to_json() == shuffled.to_json()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_records_cut_across_reads_are_read_whole(tmp_path, seed_runs, stream_everything, monkeypatch, chunk) -> None:
    from skyrl_sim.results import result_stream

    monkeypatch.setattr(result_stream._Reader, "CHUNK", chunk)  # every marker and record split between reads
    path = tmp_path / "runs.json"
    write_results(seed_runs[2:], path)
    assert [r.to_json() for r in read_results(path)] == [r.to_json() for r in seed_runs[2:]]

"""``replay --log``: the calls a SkyRL service logged, read with their durations and the shapes the log records,
aligned with the simulated calls by their requests, one OOM agreement, tolerances, and a log that is no text file."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from pathlib import Path

import orjson
import pytest

from skyrl_sim.cli import main
from skyrl_sim.commands.call_alignment import align_calls
from skyrl_sim.results.result import CallRecord, read_results
from skyrl_sim.traffic.service_log import MAX_LINE_BYTES, read_service_log

ROOT = Path(__file__).resolve().parents[1]
JAX_ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "skyrl-jax-cpu.yaml")
RECORDED = ROOT / "tests" / "data" / "skyrl-0.4.0-recorded"
DB = str(RECORDED / "tinker.db")
LOG = RECORDED / "service.log"


def replay(tmp_path: Path, log: Path, *extra: str) -> tuple[int, dict, list[CallRecord], list[CallRecord]]:
    out = tmp_path / "replay.json"
    runs = tmp_path / "runs"
    code = main(
        ["replay", DB, "--endpoint", JAX_ENDPOINT, "--log", str(log), "--json", str(out), "--save-runs", str(runs)]
        + ["--quiet", *extra]
    )
    simulated = read_results(runs / "replay.sim.json")[0].calls
    recorded = read_results(runs / "replay.recorded.json")[0].calls
    return code, orjson.loads(out.read_bytes()), simulated, recorded


@pytest.fixture(scope="module")
def recorded_replay(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, list[CallRecord], list[CallRecord]]:
    return replay(tmp_path_factory.mktemp("replay"), LOG)


def test_logged_durations_are_kept(recorded_replay: tuple) -> None:
    _, body, _, recorded = recorded_replay
    logged = [c.duration_s for c in read_service_log(LOG).calls]
    assert [round(c.duration_s, 6) for c in recorded] == [round(d, 6) for d in logged]
    diffs = body["variants"][0]["calls"]
    compared = [d for d in diffs if d["duration_error"] is not None]
    assert compared and all(d["duration_b"] > 0 for d in compared)
    assert body["summary"]["duration_error_max"] is not None  # finite (JSON writes an infinite error as null)
    # on the record's clock: each call ends before its requests complete (singles' results are written together,
    # after the last single of the iteration), and a batch call's results within a second of its end
    from skyrl_sim.commands.trace_import import read_trace

    trace = read_trace(DB)
    completed = {i: r.completed_s - trace.start_s for i, r in enumerate(trace.requests, start=1) if r.completed_s}
    for call in recorded:
        assert call.start_s >= 0
        for request_id in call.request_ids:
            assert call.end_s <= completed[request_id]
            if call.kind in ("forward_backward", "forward", "sample"):
                assert completed[request_id] - call.end_s < 1.0


def test_recorded_shapes_hold_only_what_the_log_records(recorded_replay: tuple) -> None:
    _, body, _, recorded = recorded_replay
    for diff in body["variants"][0]["calls"]:
        for shape in (diff["shape_a"], diff["shape_b"]):
            assert shape is None or shape.get("width", 1) > 0  # a width the log does not give is not compared as 0
            assert shape is None or "microbatches" not in shape or diff["kind_b"] is None
    jit = [c for c in recorded if c.extra.get("jit_compiled")]
    assert jit and all(c.width in (32, 48) for c in jit)  # the JAX backend's compiled seq_len


def test_calls_are_aligned_by_their_requests(recorded_replay: tuple) -> None:
    _, body, simulated, recorded = recorded_replay
    diffs = body["variants"][0]["calls"]
    for diff in diffs:
        if diff["kind_a"] is not None and diff["kind_b"] is not None:
            assert diff["kind_a"] == diff["kind_b"]
            assert set(diff["request_ids_a"]) & set(diff["request_ids_b"])
    # the burst SkyRL took as one call of 14 is four calls in the simulator: the first pairs, three stand alone, and
    # every call after the burst pairs with its twin again
    burst = next(d for d in diffs if d["request_ids_b"] and len(d["request_ids_b"]) == 14)
    after = diffs[diffs.index(burst) + 1 :]
    assert [d["kind_b"] for d in after[:3]] == [None, None, None]
    assert all(d["batch_equal"] for d in after[3:])
    assert sum(d["kind_a"] is not None for d in diffs) == len(simulated)
    assert sum(d["kind_b"] is not None for d in diffs) == len(recorded)


def test_one_oom_agreement(recorded_replay: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    code, body, _, _ = recorded_replay
    assert code == 0
    assert body["summary"]["oom_agreement"] == body["replay"]["oom_agreement"]
    assert body["variants"][0]["summary"]["oom_agreement"] == body["replay"]["oom_agreement"]


def test_replay_printout_shows_one_oom_agreement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    replay(tmp_path, LOG)
    out = capsys.readouterr().out
    assert len(re.findall(r"OOM agreement", out)) == 1
    assert "inf" not in out.split()


def test_a_tolerance_the_replay_misses_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, body, _, _ = replay(tmp_path, LOG, "--tolerance", "duration_error_max=0.5")
    assert code == 1 and body["violations"]
    assert "FAIL" in capsys.readouterr().out
    code, body, _, _ = replay(tmp_path, LOG, "--tolerance", "status_agreement=1", "--tolerance", "oom_agreement=1")
    assert code == 0 and body["violations"] == []


def test_a_log_in_another_time_zone_reads_the_same(tmp_path: Path, recorded_replay: tuple) -> None:
    """A log's stamps are the service machine's local time; the database's are UTC."""
    stamp = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", re.M)

    def shift(match: re.Match[str]) -> str:
        moved = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S") + timedelta(hours=5, minutes=30)
        return f"{moved:%Y-%m-%d %H:%M:%S},{match.group(2)}"

    shifted = tmp_path / "service.log"
    shifted.write_text(stamp.sub(shift, LOG.read_text()))
    _, _, _, moved = replay(tmp_path, shifted)
    _, _, _, original = recorded_replay
    assert [c.start_s for c in moved] == pytest.approx([c.start_s for c in original])
    assert [c.end_s for c in moved] == pytest.approx([c.end_s for c in original])


def test_align_calls_pairs_a_split_burst_with_its_first_call() -> None:
    def call(kind: str, *ids: int) -> CallRecord:
        return CallRecord(index=0, kind=kind, model_id="m", request_ids=list(ids))

    a = [call("fb", 1), call("fb", 2, 3), call("fb", 4, 5), call("optim_step", 6), call("fb", 7)]
    b = [call("fb", 1), call("fb", 2, 3, 4, 5), call("create_model", 9), call("optim_step", 6), call("fb", 7)]
    pairs = align_calls(a, b)
    assert pairs == [(a[0], b[0]), (a[1], b[1]), (a[2], None), (None, b[2]), (a[3], b[3]), (a[4], b[4])]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda tmp: Path("/dev/zero"), "not a regular file"),
        (lambda tmp: _write(tmp / "binary.log", b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 64), "binary"),
        (lambda tmp: tmp, "directory"),
        (lambda tmp: tmp / "missing.log", "No such file"),
    ],
)
def test_a_log_that_is_not_a_text_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make, reason: str
) -> None:
    log = make(tmp_path)
    code = main(["replay", DB, "--endpoint", JAX_ENDPOINT, "--log", str(log), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--log" in err and reason in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_log_line_longer_than_the_limit_is_skipped_without_being_held(tmp_path: Path) -> None:
    lines = LOG.read_bytes().splitlines(keepends=True)
    long = tmp_path / "long.log"
    with long.open("wb") as out:
        out.writelines(lines[:20])
        out.write(b"x" * (3 * MAX_LINE_BYTES + 17) + b"\n")  # three reads of the limit, then the rest of the line
        out.writelines(lines[20:])
    assert [c.kind for c in read_service_log(long).calls] == [c.kind for c in read_service_log(LOG).calls]


def test_a_logged_call_record_follows_one_set_of_rules() -> None:
    """``logged_call_record``: shapes from the log and the requests, unknown fields marked, the requests' one model,
    a shared failure text taken as the call's, and an OOM text read into an OOM record."""
    from skyrl_sim.results.result import UNRECORDED, RequestRecord
    from skyrl_sim.traffic.service_log import LoggedCall, logged_call_record

    oom = "CUDA out of memory. Tried to allocate 9.08 GiB. GPU 0 has a total capacity of 139.81 GiB"
    a = RequestRecord(1, "forward_backward", "m1", 30, status="failed", error=oom, datums=[10, 20])
    b = RequestRecord(2, "forward_backward", "m1", 5, status="failed", error=oom, datums=[5])
    entry = LoggedCall("forward_backward", 2, end_epoch=100.0, duration_s=4.0, ids=["x", "y"], padded_rows=4)
    call = logged_call_record(entry, [a, b], 3, end_s=10.0)
    assert (call.index, call.rows, call.padded_rows, call.width, call.start_s) == (3, 3, 4, 0, 6.0)
    assert call.model_id == "m1" and call.request_ids == [1, 2] and call.real_tokens == 30 + 2 + 5 + 1
    assert call.extra[UNRECORDED] == ["microbatches", "width"]
    assert call.error == oom and call.oom is not None and call.oom.attempted_bytes == int(9.08 * 2**30)
    c = RequestRecord(3, "forward_backward", "m2", 5, status="completed", datums=[5])
    mixed = logged_call_record(LoggedCall("forward_backward", 2, 100.0, 1.0, ids=None), [a, c], 0, end_s=1.0)
    assert mixed.model_id is None and mixed.error is None and mixed.oom is None
    assert mixed.extra[UNRECORDED] == ["microbatches", "rows", "padded_rows", "width"]

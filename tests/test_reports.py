"""Reports as views of RunResults: the timeline numbers, the Perfetto trace, the PNG plots, the CLI flags."""

from __future__ import annotations

import json
import struct
from collections import defaultdict

import pytest
from PIL import Image

from project_paths import SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.reports.plots import DPI, FIGSIZE, plot_latency_cdf, plot_memory, write_plots
from skyrl_sim.reports.trace import memory_points, trace_document, write_trace
from skyrl_sim.results.result import CallRecord, OomRecord, RequestRecord, RunResult
from skyrl_sim.schema.scenario import load_scenario

WIDTH, HEIGHT = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)


@pytest.fixture(scope="module")
def runs17(host) -> list[RunResult]:
    scenario = load_scenario(SCENARIOS / "queue_drain_17.yaml")
    return [host.run(scenario.resolve(name), "sim") for name in scenario.variant_names]


def handmade() -> RunResult:
    """Three requests, two calls; every number below is worked out by hand."""
    result = RunResult(scenario="hand", variant="v", backend="sim", endpoint="e", capacity_bytes=10 * 2**30)
    result.requests = [
        RequestRecord(1, "forward_backward", "m", 10, submitted_s=0.0, started_s=1.0, completed_s=3.0, status="completed"),
        RequestRecord(2, "forward_backward", "m", 10, submitted_s=0.5, started_s=3.0, completed_s=5.0, status="completed"),
        RequestRecord(3, "forward_backward", "m", 10, submitted_s=1.0, started_s=3.0, completed_s=5.0, status="failed"),
    ]
    result.calls = [
        CallRecord(0, "forward_backward", "m", [1], start_s=1.0, end_s=3.0, real_tokens=10, slots=40, peak_bytes=2**30),
        CallRecord(
            1,
            "forward_backward",
            "m",
            [2, 3],
            start_s=3.0,
            end_s=5.0,
            real_tokens=20,
            slots=40,
            peak_bytes=None,
            oom=OomRecord(3 * 2**30, {"phase": "backward", "op": "fc1"}, "CUDA out of memory", allocated_bytes=8 * 2**30),
            error="CUDA out of memory",
        ),
    ]
    return result


def test_summary_timeline_numbers_by_hand():
    s = handmade().summary()
    # Queue waits 1.0, 2.5, 2.0: median 2.0, max 2.5, mean 5.5 / 3.
    assert s["queue_wait_p50_s"] == 2.0
    assert s["queue_wait_max_s"] == 2.5
    assert s["queue_wait_mean_s"] == pytest.approx(5.5 / 3)
    # Latencies of completed requests only: 3.0 and 4.5.
    assert s["latency_p50_s"] == pytest.approx(3.75)
    assert s["latency_max_s"] == 4.5
    assert s["makespan_s"] == 5.0
    assert s["engine_busy_fraction"] == pytest.approx(4.0 / 5.0)
    assert s["padding_waste"] == pytest.approx(1 - 30 / 80)
    # Tokens per second count trained tokens only: the OOM call's 20 tokens are not.
    assert s["tokens_per_s"] == pytest.approx(10 / 5.0)


def test_seed_scenarios_report_latency_queue_wait_and_padding_per_variant(runs17):
    by_name = {r.variant: r.summary() for r in runs17}
    for summary in by_name.values():
        assert summary["latency_p50_s"] is not None and summary["latency_p95_s"] >= summary["latency_p50_s"]
        assert summary["queue_wait_p95_s"] is not None and summary["queue_wait_p95_s"] >= 0
        assert summary["engine_busy_fraction"] <= 1.0 + 1e-9
    # One-row calls with cap-aware padding waste only the rounding of each row to a multiple of TP;
    # 16-row padding of short rows wastes most slots.
    assert by_name["cap-aware"]["padding_waste"] < 1e-3
    assert by_name["cap-only"]["padding_waste"] > 0.8
    # Sixteen sequential calls take longer than one big call would, and every request waits in the queue for its turn.
    aware = next(r for r in runs17 if r.variant == "cap-aware")
    waits = [r.queue_wait_s for r in aware.requests]
    assert all(w is not None and w >= 0 for w in waits)
    assert waits[-1] > waits[1]


def check_trace(doc: dict) -> dict[str, list[dict]]:
    """What Perfetto's JSON importer needs: a traceEvents list of events with ph/ts/pid/tid, matched async pairs."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    by_phase: dict[str, list[dict]] = defaultdict(list)
    open_slices: dict[tuple, list[float]] = defaultdict(list)
    for event in doc["traceEvents"]:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(event), event
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        by_phase[event["ph"]].append(event)
        if event["ph"] == "X":
            assert event["dur"] >= 0
        elif event["ph"] in ("b", "e"):
            key = (event["pid"], event["cat"], event["id"], event["name"])
            if event["ph"] == "b":
                open_slices[key].append(event["ts"])
            else:
                assert open_slices[key], f"'e' without 'b': {event}"
                assert event["ts"] >= open_slices[key].pop()
        elif event["ph"] == "C":
            assert event["args"] and all(isinstance(v, (int, float)) for v in event["args"].values())
        elif event["ph"] == "i":
            assert event["s"] in ("g", "p", "t")
        else:
            assert event["ph"] == "M" and event["name"] in ("process_name", "process_sort_index", "thread_name")
    assert not any(open_slices.values()), "async slices left open"
    return by_phase


def test_trace_structure_of_the_seed_runs(runs17, tmp_path):
    path = write_trace(runs17, tmp_path / "sub" / "trace.json")
    doc = json.loads(path.read_text())  # plain JSON, as the Perfetto UI reads it
    phases = check_trace(doc)
    assert len(phases["X"]) == sum(len(r.calls) for r in runs17)
    finished = sum(1 for r in runs17 for q in r.requests if q.completed_s is not None)
    assert len([e for e in phases["b"] if e["name"] != "queued"]) == finished
    assert {e["pid"] for e in phases["X"]} == {1, 2, 3}  # one process per variant
    oom_calls = sum(len(r.oom_calls) for r in runs17)
    assert len(phases["i"]) == oom_calls
    assert phases["C"], "a memory counter track"
    names = {e["args"]["name"] for e in phases["M"] if e["name"] == "thread_name"}
    assert names == {"engine", "requests", "memory"}


def test_trace_and_memory_points_without_a_timeline():
    result = handmade()
    doc = trace_document([result])
    phases = check_trace(doc)
    # Call 0 has a peak and no timeline: the counter steps to the peak and back; call 1 has neither.
    assert memory_points(result.calls[0]) == [(1.0, 2**30), (3.0, 0)]
    assert memory_points(result.calls[1]) == []
    assert [e["args"]["GiB"] for e in phases["C"]] == [1.0, 0.0]
    assert phases["i"][0]["name"].startswith("OOM: tried to allocate 3.00 GiB")


def check_png(path, width: int = WIDTH, height: int = HEIGHT) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (width, height)
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000)
    assert colours is not None and len(colours) > 20, "an image with content, not a blank canvas"


def test_plots_of_the_seed_runs_are_images_of_the_expected_size(runs17, tmp_path):
    paths = write_plots(runs17, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == sorted(
        [f"{kind}_{v}.png" for kind in ("memory", "gantt") for v in ("no-cap", "cap-only", "cap-aware")]
        + ["latency_cdf.png"]
    )
    for path in paths:
        check_png(path)


def test_plots_work_without_memory_data(tmp_path):
    result = handmade()
    for call in result.calls:
        call.memory = None
    check_png(plot_memory(result, tmp_path / "m.png"))
    empty = RunResult(scenario="s", variant="v", backend="sim", endpoint="e")
    check_png(plot_memory(empty, tmp_path / "empty.png"))
    check_png(plot_latency_cdf([empty, result], tmp_path / "cdf.png"))


def test_cli_run_writes_trace_and_plots(tmp_path, capsys):
    trace = tmp_path / "t.json"
    plots = tmp_path / "p"
    code = main(
        [
            "run",
            str(SCENARIOS / "queue_drain_17.yaml"),
            "--variant",
            "cap-aware",
            "--trace",
            str(trace),
            "--plots",
            str(plots),
        ]
    )
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the captured console's width
    assert code == 0
    assert "latency p50" in out and "padding waste" in out
    check_trace(json.loads(trace.read_text()))
    assert sorted(p.name for p in plots.iterdir()) == ["gantt_cap-aware.png", "latency_cdf.png", "memory_cap-aware.png"]


def test_the_streamed_run_json_equals_to_json_for_every_seed_variant_and_an_empty_run(tmp_path):
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.schema.scenario import load_scenario

    scenario = load_scenario(SCENARIOS / "queue_drain_17.yaml")
    results = [PluginHost().run(scenario.resolve(name), "sim") for name in scenario.variant_names]
    assert any(r.oom_calls for r in results)
    results.append(RunResult("empty", "v", "sim", "e"))
    for index, result in enumerate(results):
        path = tmp_path / f"{index}.json"
        result.write(path)
        assert path.read_bytes() == result.to_json()
        assert RunResult.read(path).to_json() == result.to_json()

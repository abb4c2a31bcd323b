"""compare: sim against sim (same and different settings), hand-made RunResults for OOM and memory cases, tolerance
exit codes and the JSON schema."""

from __future__ import annotations

import copy
import math

import orjson
import pytest
import yaml

from cost_fakes import FixedCallTime, FlatMemory
from project_paths import SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.errors import ScenarioError
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.results.comparison import (
    SCHEMA,
    Comparison,
    check_tolerances,
    compare_runs,
    error_stats,
    relative_error,
    tolerance_metrics,
    validate_tolerances,
)
from skyrl_sim.results.result import OomRecord, RunResult, read_results
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.backend import SimBackend

ENDPOINT = SCENARIOS / "endpoints" / "qwen3.6-27b-h200-tp4.yaml"


def sim_run(host, variant: str, seconds: float = 1.0, name: str = "queue_drain_17.yaml") -> RunResult:
    scenario = load_scenario(SCENARIOS / name)
    backend = SimBackend(memory=FlatMemory(), time=FixedCallTime(seconds))
    return backend.run(scenario.resolve(variant), RunContext(host=host, options={}))


def with_peaks(run: RunResult, peak: int) -> RunResult:
    run = copy.deepcopy(run)
    for call in run.calls:
        call.peak_bytes = peak
    return run


def test_sim_against_itself_is_identical(host):
    comparison = compare_runs(sim_run(host, "cap-only"), sim_run(host, "cap-only"))
    s = comparison.summary
    assert s["calls_identical"] and s["batches_identical"] and s["shapes_identical"]
    assert s["calls_a"] == s["calls_b"] == 17
    assert s["oom_agreement"] == 1.0
    assert s["duration_error_max"] == 0.0
    assert s["latency_error_max"] == 0.0


def test_different_time_model_gives_the_duration_error(host):
    comparison = compare_runs(sim_run(host, "cap-aware", seconds=1.5), sim_run(host, "cap-aware", seconds=1.0))
    s = comparison.summary
    assert s["calls_identical"]  # time does not change what the calls are
    assert s["duration_error_median"] == pytest.approx(0.5)
    assert all(d.duration_error == pytest.approx(0.5) for d in comparison.calls)
    assert s["latency_error_median"] > 0.2  # later calls wait for slower earlier ones


def test_different_padding_changes_shapes_not_batches(host):
    comparison = compare_runs(sim_run(host, "cap-aware"), sim_run(host, "cap-only"))
    s = comparison.summary
    assert s["batches_identical"]
    assert not s["shapes_identical"] and not s["calls_identical"]
    first = comparison.calls[0]
    assert first.shape_a["padded_rows"] == 1 and first.shape_b["padded_rows"] == 16


def test_different_call_counts_are_unpaired(host):
    comparison = compare_runs(sim_run(host, "no-cap"), sim_run(host, "cap-only"))
    s = comparison.summary
    assert s["calls_a"] == 2 and s["calls_b"] == 17
    assert not s["batches_identical"]
    assert comparison.calls[1].request_ids_a == list(range(2, 18))
    assert comparison.calls[5].kind_a is None
    assert s["oom_agreement"] == pytest.approx(2 / 17)  # only the two paired calls can agree


def test_oom_agreement_and_attempted_size_error(host):
    a = with_peaks(sim_run(host, "cap-only"), 1000)
    b = copy.deepcopy(a)
    a.calls[8].oom = OomRecord(attempted_bytes=1_000_000, where={}, message="OOM")
    b.calls[8].oom = OomRecord(attempted_bytes=980_000, where={}, message="OOM")
    b.calls[3].oom = OomRecord(attempted_bytes=5, where={}, message="OOM")
    comparison = compare_runs(a, b)
    s = comparison.summary
    assert s["oom_calls_a"] == 1 and s["oom_calls_b"] == 2
    assert s["oom_agreement"] == pytest.approx(16 / 17)
    assert s["oom_attempted_error_max"] == pytest.approx(20_000 / 980_000)
    assert comparison.calls[8].peak_error is None  # an OOM call's peak is not compared
    assert comparison.calls[3].duration_error is None  # nor the duration of calls whose verdicts disagree
    assert s["peak_memory_compared"] == 15


def test_peak_memory_errors_are_fractions_of_the_reference(host):
    a = with_peaks(sim_run(host, "cap-aware"), 1030)
    b = with_peaks(sim_run(host, "cap-aware"), 1000)
    b.calls[0].peak_bytes = 1100
    s = compare_runs(a, b).summary
    assert s["peak_memory_error_median"] == pytest.approx(0.03)
    assert s["peak_memory_error_max"] == pytest.approx(70 / 1100)


def test_relative_error_against_zero_is_infinite():
    assert relative_error(1.0, 0.0) == math.inf
    assert relative_error(0.0, 0.0) == 0.0
    assert relative_error(None, 1.0) is None
    assert error_stats([0.1, -0.3, math.inf])["max"] == math.inf
    assert error_stats([]) == {"median": None, "p95": None, "max": None}


def test_tolerances_directions():
    summary = {"duration_error_median": 0.12, "oom_agreement": 0.9, "calls_identical": False, "peak_memory_error_max": None}
    problems = check_tolerances(
        summary, {"duration_error_median": 0.1, "oom_agreement": 1.0, "calls_identical": 1, "peak_memory_error_max": 0.03}
    )
    assert len(problems) == 3  # nothing to compare for peak memory is not a failure
    assert check_tolerances(summary, {"duration_error_median": 0.2, "oom_agreement": 0.9, "calls_identical": 0}) == []
    assert check_tolerances({"peak_memory_error_max": math.inf}, {"peak_memory_error_max": 0.5})


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [("peak_error", 0.1, "unknown metric"), ("oom_agreement", 2.0, "at most 1"), ("duration_error_max", -1, "non-negative")],
)
def test_bad_tolerances_name_file_and_key(key, value, reason):
    with pytest.raises(ScenarioError, match=rf"s\.yaml, key 'tolerances\.{key}': .*{reason}"):
        validate_tolerances({key: value}, "s.yaml")


def test_every_tolerance_metric_is_in_the_summary(host):
    summary = compare_runs(sim_run(host, "no-cap"), sim_run(host, "no-cap")).summary
    assert set(tolerance_metrics()) <= set(summary)


def test_json_schema_and_infinite_errors_as_null(host):
    a = with_peaks(sim_run(host, "no-cap"), 10)
    b = with_peaks(sim_run(host, "no-cap"), 0)
    body = orjson.loads(Comparison("queue_drain_17", [compare_runs(a, b)], {"peak_memory_error_max": 0.03}).to_json())
    assert body["schema"] == SCHEMA
    for key in ("calls_identical", "oom_agreement", "peak_memory_error_max", "duration_error_median"):
        assert key in body["summary"]
    assert body["summary"]["peak_memory_error_max"] is None  # infinite: JSON has no infinity
    assert body["violations"]  # ... and it fails the tolerance
    variant = body["variants"][0]
    assert variant["variant"] == "no-cap" and variant["a"] == "sim"
    assert {"batch_equal", "shape_equal", "peak_error", "attempted_error", "duration_error"} <= set(variant["calls"][0])
    assert {"id", "status_a", "status_b", "latency_error"} <= set(variant["requests"][0])


# ---------------------------------------------------------------- the command


@pytest.fixture
def scenario_file(tmp_path):
    """A small scenario with tolerances, on the seed endpoint."""

    def write(tolerances: dict) -> str:
        doc = {
            "name": "compare_small",
            "endpoint": str(ENDPOINT),
            "workload": {
                "clients": [
                    {
                        "model_id": "m",
                        "submit": {"mode": "back_to_back", "warmup": 1},
                        "requests": [{"type": "forward_backward", "lengths": [100, 200, 5000, 300]}],
                    }
                ]
            },
            "variants": {"default": {}, "cap": {"set": {"engine.forward_backward_max_request_count": 1}}},
            "tolerances": tolerances,
        }
        path = tmp_path / "small.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return str(path)

    return write


def test_cli_sim_vs_sim_passes_and_writes_json_and_plots(scenario_file, tmp_path):
    path = scenario_file({"calls_identical": 1, "duration_error_median": 0.0, "oom_agreement": 1.0})
    out = tmp_path / "cmp.json"
    plots = tmp_path / "plots"
    code = main(["compare", path, "--backends", "sim,sim", "--all-variants", "--json", str(out), "--plots", str(plots)])
    assert code == 0
    body = orjson.loads(out.read_bytes())
    assert body["schema"] == SCHEMA
    assert [v["variant"] for v in body["variants"]] == ["default", "cap"]
    assert body["summary"]["calls_identical"] is True
    pngs = sorted(plots.glob("*.png"))
    assert len(pngs) == 2 and all(p.stat().st_size > 5000 for p in pngs)


def test_cli_against_saved_run_exit_codes(scenario_file, tmp_path):
    saved = tmp_path / "saved.json"
    path = scenario_file({"duration_error_median": 0.1})
    assert main(["run", path, "--variant", "cap", "--json", str(saved)]) == 0
    runs = read_results(saved)
    for call in runs[0].calls:
        call.end_s = call.start_s + call.duration_s * 1.25  # the "measured" calls took 25% longer
    runs[0].write(saved)
    # sim is 20% faster than the saved run: beyond 10%, exit 1 ...
    assert main(["compare", path, "--backends", "sim", "--against", str(saved), "--json", str(tmp_path / "c.json")]) == 1
    body = orjson.loads((tmp_path / "c.json").read_bytes())
    assert body["summary"]["duration_error_median"] == pytest.approx(0.2)
    assert body["violations"] == ["duration_error_median 20.0% exceeds the tolerance 10.0%"]
    # ... within a looser command-line tolerance, exit 0.
    args = ["compare", path, "--backends", "sim", "--against", str(saved), "--tolerance", "duration_error_median=0.25"]
    assert main(args) == 0


def test_cli_input_errors_exit_2(scenario_file, tmp_path, capsys):
    bad = scenario_file({"peak_err": 0.1})
    assert main(["compare", bad, "--backends", "sim,sim"]) == 2
    assert "tolerances.peak_err" in capsys.readouterr().err
    path = scenario_file({})
    assert main(["compare", path, "--backends", "sim"]) == 2
    assert "name two backends" in capsys.readouterr().err
    assert main(["compare", path, "--backends", "sim,nope"]) == 2
    assert "no backend named 'nope'" in capsys.readouterr().err
    other = tmp_path / "other.json"
    assert main(["run", str(SCENARIOS / "queue_drain_17.yaml"), "--variant", "no-cap", "--json", str(other)]) == 0
    assert main(["compare", path, "--backends", "sim", "--against", str(other)]) == 2
    assert "not 'compare_small'" in capsys.readouterr().err
    assert main(["compare", path, "--backends", "sim", "--against", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_crashed_call_is_compared_for_neither_memory_nor_time(host):
    a = sim_run(host, "cap-aware")
    b = copy.deepcopy(a)
    b.calls[8].error = "RuntimeError: worker crashed"
    b.calls[8].end_s += 5.0
    comparison = compare_runs(a, b)
    crashed = comparison.calls[8]
    assert crashed.error_b and not crashed.oom_b
    assert crashed.peak_error is None and crashed.duration_error is None
    assert comparison.summary["duration_error_max"] == 0.0
    assert comparison.summary["oom_agreement"] == 1.0  # neither side ran out of memory


def _validate_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("validate_script", SCENARIOS.parent / "scripts" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validation_artifacts_and_accuracy_table(tmp_path):
    validate = _validate_script()
    out = tmp_path / "validation"
    summary = validate.validate_endpoint(
        "tiny-cpu-tp1", [validate.Measured(SCENARIOS / "queue_drain_17_tiny.yaml")], out / "tiny-cpu-tp1", "sim", 0.3
    )
    assert summary["calls_identical"] and summary["duration_error_median"] < 1e-9  # sim against itself
    folder = out / "tiny-cpu-tp1"
    for name in ("summary.md", "summary.json", "compare.json", "calibration.json", "profile.yaml"):
        assert (folder / name).stat().st_size > 0
    assert len(list((folder / "plots").glob("*.png"))) == 3
    md = (folder / "summary.md").read_text()
    assert "| calls and shapes identical | yes | 100% |" in md and "torch" in md
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nintro\n<!-- accuracy:start -->\nold text\n<!-- accuracy:end -->\n\n## after\nkept\n")
    validate.write_accuracy_section(readme, validate.accuracy_section(out, readme))
    text = readme.read_text()
    assert text.startswith("# title\n\nintro\n<!-- accuracy:start -->\n")
    assert "old text" not in text and text.endswith("<!-- accuracy:end -->\n\n## after\nkept\n")
    assert "[tiny-cpu-tp1](validation/tiny-cpu-tp1/summary.md) | CPU | yes | 100.0%" in text
    assert "| seed-scale-h200-tp1 | GPU | not yet measured |" in text  # a GPU endpoint without artifacts
    readme.write_text("no markers here\n")
    with pytest.raises(SystemExit, match="needs exactly one"):
        validate.write_accuracy_section(readme, "x")
    page = tmp_path / "docs" / "accuracy.md"  # a manual page one folder down links up to the artifacts
    assert "[tiny-cpu-tp1](../validation/tiny-cpu-tp1/summary.md)" in validate.accuracy_section(out, page)
    sampling = out / "tiny-cpu-tp1-sampling"  # a sampling validation's summary has no call columns: not in this table
    sampling.mkdir()
    (sampling / "summary.json").write_text('{"endpoint": "tiny-cpu-tp1", "targets": {}, "runs": []}')
    assert "tiny-cpu-tp1-sampling" not in validate.accuracy_section(out, page)


def test_oom_sites_agree_by_phase_stage_layer_module_and_dtype():
    from skyrl_sim.results.comparison import same_oom_site

    walk = {"phase": "backward", "stage": "recompute", "layer": 1, "op": "mlp.linear_fc1.lora_scale", "dtype": "fp32"}
    real = {"phase": "backward", "stage": "recompute", "layer": 1, "module": "decoder.layers.1.mlp.linear_fc1"}
    assert same_oom_site(walk, {**real, "dtype": "float32"})
    assert same_oom_site(real, walk)  # either side may be the walk
    assert not same_oom_site(walk, {**real, "stage": "forward", "phase": "forward"})  # the forward, not the recompute
    assert not same_oom_site(walk, {**real, "layer": 0, "module": "decoder.layers.0.mlp.linear_fc1"})
    assert not same_oom_site(walk, {**real, "module": "decoder.layers.1.self_attention.core_attention"})
    assert not same_oom_site(walk, {**real, "dtype": "bfloat16"})
    scores = {"phase": "forward", "stage": "forward", "layer": 0, "op": "self_attention.core_attention.softmax"}
    softmax = {"phase": "forward", "layer": 0, "module": "decoder.layers.0.self_attention.core_attention.scale_mask_softmax"}
    assert same_oom_site(scores, softmax)
    head = {"phase": "forward", "stage": "forward", "layer": "lm_head", "op": "chunk_0.vocab_parallel_cross_entropy"}
    assert same_oom_site(head, {"phase": "forward", "stage": "forward", "layer": None, "module": None})
    assert not same_oom_site(head, {"phase": "forward", "layer": 1, "module": "decoder.layers.1.mlp"})
    assert same_oom_site({"phase": "forward"}, {"phase": "forward", "op": "attention:forward"})  # nothing else to compare
    # pipeline stages: the same allocation on another stage is another site
    assert same_oom_site({**walk, "pp_stage": 0}, {**real, "pp_stage": 0})
    assert not same_oom_site({**walk, "pp_stage": 0}, {**real, "pp_stage": 1})


def test_pipeline_stage_peaks_are_compared_stage_by_stage():
    """Both calls report each stage's peak (``memory.stage_peaks``): one error per stage, summarised apart from the
    call's peak; runs without stages have no such metric."""
    from skyrl_sim.results.comparison import CallDiff, summarize
    from skyrl_sim.results.result import CallRecord

    def call(peaks: list[int] | None) -> CallRecord:
        record = CallRecord(index=0, kind="forward_backward", model_id="m", request_ids=[1], rows=1, padded_rows=1,
                            width=8, microbatches=1, start_s=0.0, end_s=1.0, peak_bytes=max(peaks or [100]))
        record.memory = {"stage_peaks": peaks} if peaks is not None else None
        return record

    diff = CallDiff.of(0, call([110, 90]), call([100, 100]))
    assert diff.stage_peak_errors == pytest.approx([0.10, -0.10])
    assert summarize([diff], [])["stage_peak_memory_error_max"] == pytest.approx(0.10)
    plain = CallDiff.of(0, call(None), call(None))
    assert plain.stage_peak_errors is None and "stage_peak_memory_error_max" not in summarize([plain], [])

"""Hostile input, crash-safe outputs and exit codes: every case of the hardening pass, each pinned here.

Bad input is exit 2 with one message naming the file, the key and the reason; a failed check is 1; a crash is 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scenario_text import GOOD, write
from scenario_text import run_cli as cli
from skyrl_sim import __version__
from skyrl_sim.cli import main
from skyrl_sim.engine.r3_codec import decode_routes
from skyrl_sim.results.outputs import safe_name, write_atomic


def refused(tmp_path: Path, text: str, capsys, *needles: str, args: tuple[str, ...] = ()) -> str:
    """Run ``check`` on ``text``: it must exit 2, print no traceback, and name every needle."""
    path = write(tmp_path, text)
    code, out = cli(["check", str(path), *args], capsys)
    assert code == 2, out
    assert "Traceback" not in out
    for needle in needles:
        assert needle in out, (needle, out)
    return out


# ----------------------------------------------------------------------------------------------- files themselves


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xff\xfe" + GOOD.encode("utf-16-le"), "UTF-16"),
        (b"name: \x00\x01\x02", "binary"),
        (b"name: caf\xe9\n", "not UTF-8"),
    ],
)
def test_encodings_are_refused(tmp_path, capsys, raw, reason):
    path = tmp_path / "s.yaml"
    path.write_bytes(raw)
    code, out = cli(["check", str(path)], capsys)
    assert code == 2 and reason in out and str(path) in out


@pytest.mark.parametrize("depth", [100, 5000])
def test_deep_nesting_is_refused(tmp_path, capsys, depth):
    refused(tmp_path, GOOD + "description: " + "[" * depth + "]" * depth + "\n", capsys, "nested deeper than")
    refused(tmp_path, GOOD, capsys, "nested deeper than", args=("--set", "lora.targets=" + "[" * depth + "]" * depth))


def test_duplicate_keys_are_refused(tmp_path, capsys):
    refused(tmp_path, GOOD + "name: again\n", capsys, "duplicate key 'name'", "line")


def test_large_and_special_files_are_refused(tmp_path, capsys):
    from skyrl_sim.schema.limits import MAX_SCENARIO_BYTES

    big = tmp_path / "big.yaml"
    big.write_text(GOOD)
    with big.open("r+b") as handle:  # sparse: the size is refused before anything is read
        handle.truncate(MAX_SCENARIO_BYTES + 1)
    code, out = cli(["check", str(big)], capsys)
    assert code == 2 and "over the limit" in out and f"{MAX_SCENARIO_BYTES:,}" in out
    endpoint = tmp_path / "big-endpoint.yaml"
    endpoint.write_text("name: x\n" + "#" * (5 * 2**20))  # endpoints, profiles and HF configs keep 4 MiB
    code, out = cli(["check", str(write(tmp_path, GOOD)), "--endpoint", str(endpoint)], capsys)
    assert code == 2 and "over the limit" in out and str(endpoint) in out
    if Path("/dev/zero").exists():
        code, out = cli(["check", "/dev/zero"], capsys)
        assert code == 2 and "not a regular file" in out
    code, out = cli(["check", str(tmp_path)], capsys)
    assert code == 2 and "directory" in out


# ----------------------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("- requests:", "- submit: {gap_s: .inf}\n      requests:", "gap_s"),
        ("- requests:", "- submit: {gap_s: 1.0e+300}\n      requests:", "gap_s"),
        ("- requests:", "- start_s: .inf\n      requests:", "start_s"),
        ("- requests:", "- blocker: {lead_s: .inf}\n      requests:", "lead_s"),
        ("- requests:", "- submit: {mode: at_times, times_s: [0, .nan]}\n      requests:", "times_s"),
        ("- requests:", "- submit: {mode: at_times, times_s: [0, .inf]}\n      requests:", "times_s"),
        ("device_memory_gib: 8", "device_memory_gib: .inf", "device_memory_gib"),
        ("reserve_gib: 0", "reserve_gib: .inf", "reserve_gib"),
        ("reserve_gib: 0", "reserve_gib: 9", "reserve_gib"),
        ("  hardware:", "  engine: {iteration_sleep_s: .inf}\n  hardware:", "iteration_sleep_s"),
        ("  hardware:", "  engine: {iteration_sleep_s: 0}\n  hardware:", "iteration_sleep_s"),
        ("  hardware:", "  engine: {forward_backward_max_request_count: true}\n  hardware:", "max_request_count"),
        ("lengths: [10, 20]", "lengths: [10, 4611686018427387904]", "lengths"),
        ("lengths: [10, 20]", "lengths: [10, 20], count: 3000000", "count"),
        ("  hardware:", "  trainer: {micro_train_batch_size_per_gpu: 1000000000}\n  hardware:", "micro_train_batch_size"),
        ("model: tiny-dense", "model: {preset: tiny-dense, num_layers: 100000000}", "num_layers"),
        ("model: tiny-dense", "model: {preset: tiny-dense, hidden_size: '128'}", "hidden_size"),
        ("model: tiny-dense", "model: {preset: tiny-dense, num_attention_heads: 0}", "num_attention_heads"),
        ("workload:\n", "workload:\n  result_timeout_s: .nan\n", "result_timeout_s"),
    ],
)
def test_non_finite_absurd_and_wrongly_typed_values(tmp_path, capsys, old, new, key):
    assert old in GOOD
    refused(tmp_path, GOOD.replace(old, new), capsys, key, "s.yaml")


def test_tp_must_divide_the_heads(tmp_path, capsys):
    text = GOOD.replace("devices: 1,", "devices: 3,").replace("  hardware:", "  parallelism: {tp: 3}\n  hardware:")
    refused(tmp_path, text, capsys, "parallelism.tp", "does not divide")


def test_hf_config_problems(tmp_path, capsys):
    config = tmp_path / "config.json"
    zero_heads = json.dumps({"hidden_size": 8, "num_attention_heads": 0, "num_hidden_layers": 1, "vocab_size": 8})
    for body, needle in (("[1, 2]", "JSON object"), (zero_heads, "num_attention_heads")):
        config.write_text(body)
        refused(tmp_path, GOOD.replace("model: tiny-dense", f"model: {{config: {config}}}"), capsys, needle)


# ----------------------------------------------------------------------------------------------- silent acceptance


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (GOOD + "variants: {}\n", ("variants",)),
        (GOOD.replace("- requests:\n        - {type: forward_backward, lengths: [10, 20]}", "- requests: []"),
         ("requests",)),
        (GOOD.replace("lengths: [10, 20]}", "lengths: [10, 20]}\n        - {type: load_weights, checkpoint: nope}"),
         ("load_weights", "nope")),
        (GOOD + "expect: {completed: -5}\n", ("completed",)),
        (GOOD + "expect: {completed: 5}\n", ("more than the workload's 2 requests",)),
        (GOOD + "expect: {makespan_s: {min: 5, max: 1}}\n", ("min 5.0 is larger than max 1.0",)),
        (GOOD + "expect: {request_metrics: {99: {'num_tokens:sum': 1}}}\n", ("request 99 does not exist",)),
        (GOOD + "expect: {calls: 1, oom_calls: 2}\n", ("oom_calls", "more than calls 1")),
        (GOOD + "expect: {all_completed: true, failed: 1}\n", ("all_completed", "contradicts")),
    ],
)
def test_input_that_was_silently_accepted(tmp_path, capsys, text, needles):
    refused(tmp_path, text, capsys, *needles)


def test_invalid_base_endpoint_is_reported_even_when_every_variant_overrides_it(tmp_path, capsys):
    text = GOOD.replace("  hardware:", "  trainer: {micro_train_batch_size_per_gpu: 0}\n  hardware:")
    text += "variants:\n  a: {set: {trainer.micro_train_batch_size_per_gpu: 2}}\n"
    refused(tmp_path, text, capsys, "micro_train_batch_size_per_gpu")


# ----------------------------------------------------------------------------------------------- messages


def test_unknown_key_from_a_variant_or_set_names_its_origin(tmp_path, capsys):
    text = GOOD + "variants:\n  a: {set: {engine.no_such_knob: 1}}\n"
    out = refused(tmp_path, text, capsys, "variant a", "engine.no_such_knob", "unknown key")
    assert "(variant a, set)" in out
    out = refused(tmp_path, GOOD, capsys, "--set", "engine.no_such_knob", args=("--set", "engine.no_such_knob=1"))
    assert out.count("s.yaml") == 0


def test_overrides_leave_the_scenario_as_it_was_and_refuse_descending_into_a_value(tmp_path, capsys):
    """Overrides copy only what they change (a long workload is not copied per variant or sweep point): resolving
    one variant cannot leak into the next, and a key that descends into a list's value is an error, not a crash."""
    import copy

    from skyrl_sim.errors import ScenarioError
    from skyrl_sim.schema.scenario import load_scenario

    scenario = load_scenario("scenarios/queue_drain_17.yaml")
    raw, endpoint = copy.deepcopy(scenario.raw), copy.deepcopy(scenario.endpoint_raw)
    sets = {"workload.clients.0.name": "renamed", "lora.targets": ["linear_qkv"], "engine.cap_aware_padding": True}
    changed = scenario.resolve(scenario.variant_names[0], sets)
    assert changed.workload.clients[0].name == "renamed" and changed.endpoint.engine.cap_aware_padding
    assert scenario.raw == raw and scenario.endpoint_raw == endpoint
    again = scenario.resolve(scenario.variant_names[0])
    assert again.workload.clients[0].name != "renamed" and not again.endpoint.engine.cap_aware_padding
    with pytest.raises(ScenarioError, match="'lora.targets' is a value"):  # was a TypeError traceback (all-linear)
        scenario.resolve(scenario.variant_names[0], {"lora.targets.0.x": 1})
    key = "workload.clients.0.requests.0.type.x"
    refused(tmp_path, GOOD, capsys, "clients.0.requests.0.type", "is a value", args=("--set", f"{key}=1"))


def test_set_without_key_and_profile_errors_name_the_key(tmp_path, capsys):
    refused(tmp_path, GOOD, capsys, "no key before '='", args=("--set", "=1"))
    refused(tmp_path, GOOD.replace("profile: cpu", "profile: nope"), capsys, "hardware.profile", "s.yaml")
    text = GOOD.replace("  hardware:", "  trainer: {strategy: nope}\n  hardware:")
    refused(tmp_path, text, capsys, "trainer.strategy", "s.yaml")


def test_tolerance_and_against_errors(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    code, out = cli(["compare", str(path), "--backends", "sim,sim", "--tolerance", "x=abc"], capsys)
    assert code == 2 and "not a number" in out
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    code, out = cli(["compare", str(path), "--backends", "sim", "--against", str(bad)], capsys)
    assert code == 2 and "not a skyrl-sim RunResult" in out
    run = tmp_path / "run.json"
    assert main(["run", str(path), "--json", str(run)]) == 0
    data = json.loads(run.read_text())
    data["runs"][0]["calls"][0]["end_s"] = "x"
    run.write_text(json.dumps(data))
    code, out = cli(["compare", str(path), "--backends", "sim", "--against", str(run)], capsys)
    assert code == 2 and "end_s" in out


# ----------------------------------------------------------------------------------------------- outputs


def test_output_paths_are_checked_before_the_run(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    for target, needle in (("", "empty path"), (str(tmp_path), "is a directory"),
                           (str(tmp_path / "missing" / "r.json"), "does not exist")):
        code, out = cli(["run", str(path), "--json", target], capsys)
        assert code == 2 and needle in out, out
        assert "completed" not in out  # refused before running
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, out = cli(["run", str(path), "--json", str(locked / "r.json")], capsys)
        assert code == 2 and "not writable" in out


def test_json_dash_writes_stdout_only_json(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["run", str(path), "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["schema"] == "skyrl-sim/run/1"
    assert "completed" in captured.err  # the table went to stderr


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "out.json"
    write_atomic(target, b"old")
    with pytest.raises(TypeError):
        write_atomic(target, 12345)  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"


def test_writers_replace_files_atomically(tmp_path, monkeypatch):
    """Every writer goes through os.replace of a temporary file in the same directory."""
    replaced: list[tuple[str, str]] = []
    real = os.replace

    def spy(src, dst):
        replaced.append((str(src), str(dst)))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    path = write(tmp_path, GOOD)
    out = tmp_path / "out"
    assert main(["run", str(path), "--json", str(tmp_path / "r.json"), "--trace", str(tmp_path / "t.json"),
                 "--plots", str(out)]) == 0
    targets = {Path(dst).name for _, dst in replaced}
    assert {"r.json", "t.json"} <= targets and any(t.endswith(".png") for t in targets)
    assert all(Path(src).parent == Path(dst).parent for src, dst in replaced)


@pytest.mark.parametrize(("name", "expected"), [("../../etc/x", "etc_x"), ("..", "run"), ("a/b", "a_b"), ("", "run")])
def test_safe_name(name, expected):
    assert safe_name(name) == expected
    assert "/" not in safe_name(name) and safe_name(name) not in (".", "..")


def test_compare_save_runs_stays_in_its_directory(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("name: tiny", "name: ../../escaped"))
    runs = tmp_path / "a" / "b" / "runs"
    code, out = cli(["compare", str(path), "--backends", "sim,sim", "--save-runs", str(runs)], capsys)
    assert code in (0, 1), out
    assert [p.parent for p in runs.iterdir()] == [runs]
    assert not (tmp_path / "escaped.sim.json").exists() and not (tmp_path / "a" / "escaped.sim.json").exists()


# ----------------------------------------------------------------------------------------------- CLI


def test_version_module_and_internal_error_exit_3(tmp_path, monkeypatch, capsys):
    proc = subprocess.run([sys.executable, "-m", "skyrl_sim", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and __version__ in proc.stdout
    import skyrl_sim.cli as cli_module

    def crash(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(cli_module, "load_scenario", crash)
    code, out = cli(["run", str(write(tmp_path, GOOD))], capsys)
    assert code == 3 and "internal error" in out and "Traceback" in out


def test_run_result_is_stamped_with_versions(tmp_path):
    path = write(tmp_path, GOOD)
    assert main(["run", str(path), "--json", str(tmp_path / "r.json")]) == 0
    versions = json.loads((tmp_path / "r.json").read_text())["runs"][0]["versions"]
    assert versions["skyrl-sim"] == __version__ and versions["python"] and "sim" in versions["plugin"]


def test_grid_over_the_point_limit_needs_force(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    values = ",".join(str(v) for v in range(1, 102))
    code, out = cli(["sweep", str(path), "--grid", f"lora.rank={values}", "--grid", f"lora.alpha={values}"], capsys)
    assert code == 2 and "--force" in out


def test_result_timeout_is_honoured_by_the_simulator(tmp_path, capsys):
    text = GOOD.replace("workload:\n", "workload:\n  result_timeout_s: 0.01\n")
    run = tmp_path / "r.json"
    assert main(["run", str(write(tmp_path, text)), "--json", str(run)]) == 0
    requests = json.loads(run.read_text())["runs"][0]["requests"]
    assert all(r["status"] == "failed" and "timed out" in r["error"] for r in requests)


def test_an_exponent_without_a_dot_is_a_number_in_files_and_in_set(tmp_path):
    """YAML 1.1 reads ``1e-2`` as a string; a user (and YAML 1.2, and JSON) means a number."""
    text = GOOD.replace("workload:\n", "workload:\n  result_timeout_s: 1e-2\n")
    for scenario, sets in ((text, []), (GOOD, ["--set", "workload.result_timeout_s=1E-2"])):
        run = tmp_path / "r.json"
        assert main(["run", str(write(tmp_path, scenario)), *sets, "--json", str(run)]) == 0
        requests = json.loads(run.read_text())["runs"][0]["requests"]
        assert all(r["status"] == "failed" and "no result within 0.01 s" in r["error"] for r in requests)


def test_verdict_lines_are_not_wrapped(tmp_path):
    text = GOOD.replace("name: tiny", "name: " + "x" * 150)
    proc = subprocess.run([sys.executable, "-m", "skyrl_sim", "check", str(write(tmp_path, text)), "--quiet"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "PASS" in line]
    assert len(lines) == 1 and "GiB" in lines[0]


# ----------------------------------------------------------------------------------------------- r3 codec


def test_r3_decoder_refuses_non_canonical_base64_and_extra_keys():
    with pytest.raises(ValueError, match="canonical base64"):
        decode_routes({"data": "AB==", "shape": [1, 1, 1], "dtype": "uint8"})
    with pytest.raises(ValueError, match="unknown keys"):
        decode_routes({"data": "AA==", "shape": [1, 1, 1], "dtype": "uint8", "more": 1})
    assert decode_routes({"data": "AA==", "shape": [1, 1, 1], "dtype": "uint8"}).tolist() == [[[0]]]


# ----------------------------------------------------------------------------------------------- plots


def _figures(monkeypatch) -> list:
    import skyrl_sim.reports.plots as plots

    saved: list = []

    def keep(fig, path):
        saved.append(fig)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    return saved


def test_plots_show_every_run_every_call_and_layer_names(monkeypatch):
    import skyrl_sim.reports.plots as plots
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.schema.scenario import load_scenario

    scenario = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "queue_drain_17.yaml")
    host = PluginHost()
    results = [host.run(scenario.resolve(name), "sim") for name in ("no-cap", "cap-only")]
    saved = _figures(monkeypatch)
    plots.plot_latency_cdf(results, "x.png")
    no_cap = saved[-1].axes[0].lines[0]
    assert len(no_cap.get_xdata()) >= 3 and max(no_cap.get_xdata()) > 0  # one completion is still a visible line
    plots.plot_gantt(results[1], "x.png")
    bars = saved[-1].axes[0].patches
    assert len(bars) == len(results[1].calls) and all(bar.get_linewidth() > 0 for bar in bars)  # calls stay apart
    plots.plot_memory(results[0], "x.png")
    labels = [tick.get_text() for tick in saved[-1].axes[0].get_xticklabels()]
    assert any("L" in label and "forward" in label for label in labels)
    annotation = next(child for child in saved[-1].axes[0].texts if "tried to allocate" in child.get_text())
    assert annotation.get_bbox_patch() is not None  # boxed, beside the OOM point


# ----------------------------------------------------------------------------------------------- more faults


def test_a_sweep_point_with_an_unbounded_time_is_refused_up_front(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("- requests:", "- submit: {gap_s: 0.01}\n      requests:"))
    code, out = cli(["sweep", str(path), "--grid", "workload.clients.0.submit.gap_s=0.01,.inf", "--jobs", "1"], capsys)
    assert code == 2 and "--grid, key 'workload.clients.0.submit.gap_s'" in out and "finite" in out


def test_simulated_time_is_capped_with_a_clear_error(tmp_path, capsys, monkeypatch):
    import skyrl_sim_plugins.sim.backend as sim_backend

    monkeypatch.setattr(sim_backend, "MAX_SIM_TIME_S", 5.0)
    code, out = cli(["run", str(write(tmp_path, GOOD.replace("- requests:", "- start_s: 60\n      requests:")))], capsys)
    assert code == 2 and "simulated-time cap" in out


def test_a_backend_without_its_extra_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_sim_plugins.megatron_vllm.backend", None)  # as if torch were missing
    code, out = cli(["run", str(write(tmp_path, GOOD)), "--backend", "megatron"], capsys)
    assert code == 2 and "skyrl-sim[real]" in out and "Traceback" not in out


def test_report_lines_match_what_they_count(capsys):
    from rich.console import Console

    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.reports.report import moe_line, print_run
    from skyrl_sim.schema.scenario import load_scenario

    root = Path(__file__).resolve().parents[1] / "scenarios"
    result = PluginHost().run(load_scenario(root / "queue_drain_193.yaml").resolve("no-cap"), "sim")
    print_run(Console(width=400), result, show_calls=False)
    out = capsys.readouterr().out
    assert f"of {len(result.requests)} submitted" in out and f"/{len(result.requests)} completed" in out
    moe = PluginHost().run(load_scenario(root / "moe_r3.yaml").resolve("int32-all-layers"), "sim")
    lines = [line for line in map(moe_line, moe.calls) if line and "R3 int32-all-layers" in line]
    # both layouts hold int32 ids; the line names the wire dtype they were converted from
    assert lines and all("(int32 from uint8, all 40 MoE layers" in line for line in lines)


def test_compare_and_calibrate_check_their_outputs_first(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    code, out = cli(["compare", str(path), "--backends", "sim,sim", "--json", str(tmp_path / "no" / "c.json")], capsys)
    assert code == 2 and "does not exist" in out and "PASS" not in out
    run = tmp_path / "r.json"
    assert main(["run", str(path), "--json", str(run)]) == 0
    code, out = cli(["calibrate", str(run), "--profile", "p", "--out", "-"], capsys)
    assert code == 2 and "cannot go to stdout" in out


def test_kill_9_while_writing_never_leaves_a_truncated_file(tmp_path):
    """A writer killed with SIGKILL mid-write leaves the previous complete file (or none), never a torn one."""
    import signal
    import time

    target = tmp_path / "out.json"
    script = (
        "import orjson, sys\n"
        "from skyrl_sim.results.outputs import write_atomic\n"
        "body = orjson.dumps({'rows': list(range(400_000))})\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
        f"while True: write_atomic({str(target)!r}, body)\n"
    )
    for delay in (0.05, 0.2, 0.5):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if target.exists():
            assert len(json.loads(target.read_bytes())["rows"]) == 400_000

"""One verdict (``results.verdict``): check, sweep and the JSON agree; each variant is judged with its own band; the
JUnit XML of ``check --junit-xml``."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from project_paths import ROOT
from skyrl_sim.cli import main
from skyrl_sim.commands.sweep import Axis, run_sweep
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.band import band_for, held_bytes
from skyrl_sim.results.result import read_results
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.units import GIB

TINY = str(ROOT / "scenarios" / "queue_drain_17_tiny.yaml")
LIMIT = "memory_limit_gib"


def limits() -> dict[str, float]:
    """Memory limits that put the tiny cap-aware run inside its band, just outside it, and under its peak."""
    scenario = load_scenario(TINY)
    variant = scenario.resolve("cap-aware")
    calls = PluginHost().run(variant, "sim").calls
    peak = max(c.peak_bytes for c in calls if c.peak_bytes)
    held = max(h for c in calls if (h := held_bytes(c)))
    band = band_for(variant.endpoint, TINY).bytes_at(peak)
    return {"AT RISK": (held + 0.5 * band) / GIB, "PASS": (held + 2 * band) / GIB, "FAIL": 0.5 * peak / GIB}


@pytest.fixture(scope="module")
def tiny_limits() -> dict[str, float]:
    return limits()


def checked(tmp_path: Path, *argv: str) -> tuple[int, list[dict]]:
    out = tmp_path / "check.json"
    code = main(["check", *argv, "--quiet", "--json", str(out)])
    verdicts = [run["verdict"] for run in json.loads(out.read_text())["runs"]]
    assert [run.verdict for run in read_results(out)] == verdicts  # a RunResult read back keeps its verdict
    return code, verdicts


@pytest.mark.parametrize("require", ["expectations", "completed"])
def test_a_sweep_point_reads_what_check_says(tmp_path, tiny_limits, require):
    """At each limit, check's verdict (exit code and JSON) is the sweep point's, with either --require."""
    sweep = run_sweep(TINY, [Axis(LIMIT, tuple(tiny_limits.values()))], variant="cap-aware", require=require, workers=1)
    by_limit = {p.settings[LIMIT]: p for p in sweep.points}
    for status, limit in tiny_limits.items():
        code, (verdict,) = checked(tmp_path, TINY, "--variant", "cap-aware", "--set", f"{LIMIT}={limit!r}")
        point = by_limit[limit]
        assert verdict["status"] == status == point.verdict
        assert (code == 0) is point.passed is (status == "PASS")
        if status == "AT RISK":
            assert point.risks == verdict["risks"] and "AT RISK" in point.risks[0]


def test_sweep_margin_and_table_show_at_risk(capsys, tiny_limits):
    """A margin larger than the headroom makes the roomy point AT RISK in sweep, as it does in check."""
    limit = tiny_limits["PASS"]
    argv = ["--variant", "cap-aware", "--margin", "50%"]
    assert main(["check", TINY, *argv, "--quiet", "--set", f"{LIMIT}={limit!r}"]) == 1
    assert "AT RISK cap-aware" in capsys.readouterr().out
    assert main(["sweep", TINY, *argv, "--grid", f"{LIMIT}={limit!r}", "--jobs", "1"]) == 0
    assert "AT RISK" in capsys.readouterr().out


def two_tp_scenario(tmp_path: Path) -> Path:
    """The tiny queue drain with a second variant on two tensor-parallel ranks."""
    data = yaml.safe_load(Path(TINY).read_text())
    data["variants"] = {
        "tp1": {"set": {"engine.forward_backward_max_request_count": 1, "engine.cap_aware_padding": True}},
        "tp2": {
            "set": {
                "engine.forward_backward_max_request_count": 1,
                "engine.cap_aware_padding": True,
                "parallelism.tp": 2,
                "hardware.devices": 2,
            }
        },
    }
    data.pop("expect", None)
    path = tmp_path / "two_tp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_variants_with_different_tp_get_their_own_band(tmp_path, capsys):
    """tp1 is the validated tiny-cpu-tp1; tp2 keeps that name but is judged with a validated TP 2 endpoint's band."""
    code, verdicts = checked(tmp_path, str(two_tp_scenario(tmp_path)))
    assert code == 0
    bands = [v["margin"]["band"] for v in verdicts]
    assert (bands[0]["kind"], bands[0]["source"]) == ("validated", "tiny-cpu-tp1")
    assert bands[1]["kind"] == "nearest" and bands[1]["source"].startswith("tiny-cpu-tp2")  # a TP 2 validation
    assert bands[0]["fraction"] != bands[1]["fraction"]
    out = capsys.readouterr().out
    assert "tp1: memory band" in out and "tp2: memory band" in out  # one band line per variant when they differ


def junit(tmp_path: Path, *argv: str) -> tuple[int, ET.Element, str]:
    path = tmp_path / "check.xml"
    code = main(["check", *argv, "--junit-xml", str(path)])
    return code, ET.parse(path).getroot(), path.read_text()


def test_junit_has_one_case_per_variant_and_passes_quietly(tmp_path, capsys):
    code, root, _ = junit(tmp_path, TINY, "--quiet")
    cases = root.findall("./testsuite/testcase")
    assert code == 0 and [c.get("name") for c in cases] == load_scenario(TINY).variant_names
    assert {c.get("classname") for c in cases} == {"queue_drain_17_tiny"}
    assert not root.findall(".//failure")
    out = capsys.readouterr().out
    for case in cases:  # PASS: the line check printed, as the case's output
        assert case.find("system-out").text in out


@pytest.mark.parametrize("status", ["AT RISK", "FAIL"])
def test_junit_failure_carries_the_failing_call(tmp_path, capsys, tiny_limits, status):
    """FAIL and AT RISK are failures whose message is what check printed after the variant's name; FAIL's names the
    call that ran out of memory."""
    code, root, _ = junit(tmp_path, TINY, "--variant", "cap-aware", "--quiet", "--set", f"{LIMIT}={tiny_limits[status]!r}")
    assert code == 1
    (case,) = root.findall("./testsuite/testcase")
    failure = case.find("failure")
    assert failure is not None and failure.get("type") == status
    assert root.find("testsuite").get("failures") == "1"
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{status} cap-aware: "))
    assert printed == f"{status} cap-aware: {failure.get('message')}"
    assert failure.text.splitlines()[0] == printed
    expected_call = "OOM: tried to allocate" if status == "FAIL" else "AT RISK: peak"
    assert "call #" in failure.get("message") and expected_call in failure.get("message")


@pytest.mark.parametrize("target", ["{tmp}/missing/dir/check.xml", "{tmp}", "-"])
def test_a_bad_junit_path_is_one_line_before_anything_runs(tmp_path, capsys, target):
    path = target.format(tmp=tmp_path)
    assert main(["check", TINY, "--junit-xml", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--junit-xml" in lines[0]


def test_a_variant_named_twice_runs_once(tmp_path, capsys):
    """``--variant cap-aware --variant cap-aware`` is one run: one verdict line, one JSON run, one JUnit case."""
    junit = tmp_path / "c.xml"
    argv = ["check", TINY, "--variant", "cap-aware", "--variant", "cap-aware", "--quiet", "--junit-xml", str(junit)]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0 and out.count("PASS cap-aware") == 1
    assert junit.read_text().count("<testcase") == 1


def test_a_start_vllm_refuses_is_not_reported_as_an_allocation(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own start-up checks refuse before they allocate: the FAIL line says which check and what it needed
    (request_memory: the budget), never "tried to allocate 0.00 GiB" for a budget with no room for the KV cache."""
    scenario = str(ROOT / "scenarios" / "colocated_vllm_start.yaml")
    assert main(["check", scenario, "--variant", "util-0.99", "--variant", "util-0.40"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL ")]
    high, low = (next(line for line in lines if line.startswith(f"FAIL {v}:")) for v in ("util-0.99", "util-0.40"))
    assert "call #0 save_weights_for_sampler OOM: refused by vLLM's start-up check request_memory, needs 138.40 GiB" in high
    assert "refused by vLLM's start-up check kv_cache_memory: its budget leaves no memory for the KV cache" in low
    assert "tried to allocate 0.00 GiB" not in low

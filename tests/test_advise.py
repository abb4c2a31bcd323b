"""The memory band (where it comes from), AT RISK verdicts in check, and ``skyrl-sim advise``'s search."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from project_paths import ROOT
from skyrl_sim.cli import main
from skyrl_sim.commands.advise_evaluation import Candidate
from skyrl_sim.commands.advise_report import Advice
from skyrl_sim.commands.advise_search import advise, best, bisect_cap, bisection, pareto_front, run_tasks
from skyrl_sim.commands.advise_space import CAP, cap_ladder
from skyrl_sim.errors import UserError
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.band import (
    DEFAULT_FRACTION,
    GIB,
    MemoryBand,
    Validated,
    band_for,
    held_bytes,
    parse_margin,
    read_validated,
    validated_endpoints,
)
from skyrl_sim.schema.scenario import load_scenario

SEED = str(ROOT / "scenarios" / "queue_drain_17.yaml")
TINY = str(ROOT / "scenarios" / "queue_drain_17_tiny.yaml")


def write_validation(root: Path, name: str, errors: list[float | None], summary: dict[str, Any] | None = None) -> Path:
    folder = root / "validation" / name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_bytes(orjson.dumps({"endpoint": name, "calls": len(errors), **(summary or {})}))
    calls = [{"index": i, "peak_error": e, "attempted_error": None} for i, e in enumerate(errors)]
    (folder / "compare.json").write_bytes(orjson.dumps({"variants": [{"calls": calls}]}))
    return folder


def endpoint_of(path: str, **sets: Any) -> Any:
    return load_scenario(path).resolve(load_scenario(path).variant_names[0], sets).endpoint


def test_band_is_the_largest_measured_per_call_error(tmp_path):
    endpoints = tmp_path / "scenarios" / "endpoints"
    endpoints.mkdir(parents=True)
    (endpoints / "lab.yaml").write_text(yaml.safe_dump({"trainer": {"layer_spec": "local", "params_dtype": "bf16"}}))
    item = read_validated(write_validation(tmp_path, "lab", [0.01, -0.04, None, 0.02]))
    assert item is not None
    assert item.fraction == pytest.approx(0.04)  # |-4%| is the largest, None is skipped
    assert (item.layer_spec, item.params_dtype, item.calls) == ("local", "bf16", 3)


def test_band_validated_nearest_or_default():
    local_fp32 = Validated("v-fp32", "local", "fp32", "cpu", 1, 0.02, 10, "x")
    local_bf16 = Validated("v-bf16", "local", "bf16", "h200", 1, 0.03, 10, "y")
    tiny = endpoint_of(TINY)  # tiny-cpu-tp1: local, fp32
    own = band_for(tiny, known=[local_bf16, Validated("tiny-cpu-tp1", "local", "fp32", "cpu", 1, 0.011, 4, "z")])
    assert (own.kind, own.fraction, own.source) == ("validated", 0.011, "tiny-cpu-tp1")
    nearest = band_for(endpoint_of(TINY, name="other"), known=[local_bf16, local_fp32])
    assert (nearest.kind, nearest.source, nearest.fraction) == ("nearest", "v-fp32", 0.02)
    assert "v-fp32" in nearest.describe()
    default = band_for(endpoint_of(SEED), known=[local_bf16, local_fp32])  # transformer_engine, bf16: no match
    assert (default.kind, default.fraction) == ("default", DEFAULT_FRACTION)
    assert "default" in default.describe()


def test_a_new_validation_folder_is_picked_up_without_code(tmp_path):
    """A summary that states its kind needs no endpoint file; the seed endpoint then borrows its band."""
    write_validation(tmp_path, "big-gpu", [0.012, -0.027], {"layer_spec": "transformer_engine", "params_dtype": "bf16"})
    (tmp_path / "scenarios").mkdir()
    found = {v.name: v for v in validated_endpoints(tmp_path / "scenarios" / "x.yaml")}
    assert found["big-gpu"].fraction == pytest.approx(0.027)
    band = band_for(endpoint_of(SEED), known=list(found.values()))
    assert (band.kind, band.source) == ("nearest", "big-gpu")


def test_the_committed_tiny_validation_gives_the_tiny_endpoints_their_band():
    for name in ("tiny-cpu-tp1", "tiny-cpu-tp2"):
        scenario = load_scenario(TINY, name)
        band = band_for(scenario.resolve(scenario.variant_names[0]).endpoint, TINY)
        assert band.kind == "validated" and band.source == name
        assert 0 < band.fraction < 0.03  # the validation target: peak memory within 3% per call


def test_a_validated_name_on_another_kind_borrows_instead():
    """The tp1 endpoint renamed tiny-cpu-tp2 is still a tp1 endpoint: it borrows tiny-cpu-tp1's band (the nearest of
    its kind), not tiny-cpu-tp2's; set to tp 2 it borrows a validated TP 2 endpoint's."""
    renamed = band_for(endpoint_of(TINY, name="tiny-cpu-tp2"), TINY)
    assert (renamed.kind, renamed.source) == ("nearest", "tiny-cpu-tp1")
    at_tp2_endpoint = endpoint_of(TINY, **{"parallelism.tp": 2, "hardware.devices": 2})
    at_tp2 = band_for(at_tp2_endpoint, TINY)
    assert (at_tp2.kind, at_tp2.source) == ("nearest", widest_tp2_band(at_tp2_endpoint))


def widest_tp2_band(endpoint) -> str:
    """The validated TP 2 endpoint of this layer spec and dtype with the widest band: the one a TP 2 variant borrows
    (among equally near ones the band errs wide)."""
    from skyrl_sim.results.band import validated_endpoints

    tp2 = [
        v
        for v in validated_endpoints(TINY)
        if (v.tp or 1) == 2
        and v.layer_spec == endpoint.trainer.layer_spec
        and v.params_dtype == endpoint.trainer.params_dtype
        and v.profile in (None, endpoint.hardware.profile)
    ]
    assert tp2, "no validated TP 2 endpoint"
    return max(tp2, key=lambda v: v.fraction).name


@pytest.mark.parametrize(
    ("text", "gib", "fraction"), [("2.5", 2.5, None), ("2.5GiB", 2.5, None), ("3%", None, 0.03), (None, None, None)]
)
def test_parse_margin(text, gib, fraction):
    band = MemoryBand(0.05, "default", "default")
    margin = parse_margin(text, band)
    assert (margin.gib, margin.fraction) == (gib, fraction)
    expected = {None: 0.05 * GIB, "2.5": 2.5 * GIB, "2.5GiB": 2.5 * GIB, "3%": 0.03 * GIB}[text]
    assert margin.bytes_at(GIB) == pytest.approx(expected, abs=1)


@pytest.mark.parametrize("text", ["abc", "-1", "5 MiB", "-2%"])
def test_parse_margin_rejects(text):
    with pytest.raises(UserError, match="--margin"):
        parse_margin(text, MemoryBand(0.05, "default", "default"))


def tiny_cap_aware_highest() -> tuple[int, int]:
    """The cap-aware run's highest tensor peak and the most any call held (allocator pages included)."""
    calls = PluginHost().run(load_scenario(TINY).resolve("cap-aware"), "sim").calls
    return max(c.peak_bytes for c in calls if c.peak_bytes), max(h for c in calls if (h := held_bytes(c)))


def test_check_reports_at_risk_inside_the_band_and_passes_outside(capsys):
    """Capacity just above the peak (inside the validated band) is AT RISK, exit 1; twice the band above, PASS."""
    peak, held = tiny_cap_aware_highest()
    assert held >= peak
    band = band_for(endpoint_of(TINY), TINY)
    inside = (held + 0.5 * band.bytes_at(peak)) / GIB
    outside = (held + 2 * band.bytes_at(peak)) / GIB
    argv = ["check", TINY, "--variant", "cap-aware", "--quiet"]
    assert main([*argv, "--set", f"memory_limit_gib={inside!r}"]) == 1
    out = capsys.readouterr().out
    assert "AT RISK cap-aware" in out and "AT RISK:" in out and "±" in out
    assert main([*argv, "--set", f"memory_limit_gib={outside!r}"]) == 0
    assert "PASS cap-aware" in capsys.readouterr().out


def test_check_margin_overrides_the_band(capsys):
    """The seed's cap-aware variant peaks at 21.3 of 138 GiB: a 120 GiB margin puts it at risk, 100 GiB does not."""
    argv = ["check", SEED, "--variant", "cap-aware", "--quiet"]
    assert main([*argv, "--margin", "120"]) == 1
    assert "AT RISK cap-aware" in capsys.readouterr().out
    assert main([*argv, "--margin", "100GiB"]) == 0
    assert main([*argv, "--margin", "lots"]) == 2
    assert "--margin 'lots'" in capsys.readouterr().err


def test_run_reports_peak_with_band(capsys):
    assert main(["run", SEED, "--variant", "cap-aware"]) == 0
    out = capsys.readouterr().out
    assert "23.00 ± 1.15 of 138.00 GiB" in out  # 5% default band on the seed endpoint
    assert "memory band ±5.0%" in out


def fake(settings: dict[str, Any], peak_gib: float, oom: int = 0, makespan: float = 1.0) -> Candidate:
    summary = {
        "held_bytes_max": int(peak_gib * GIB) if not oom else None,
        "requests": 4,
        "completed": 4 - oom,
        "failed": oom,
        "oom_calls": oom,
        "makespan_s": makespan,
        "latency_p95_s": makespan,
        "padding_waste": 0.0,
        "peak_bytes_max": int(peak_gib * GIB),
    }
    margin = int(0.05 * peak_gib * GIB)
    verdict = "FAIL" if oom else "AT RISK" if 100 * GIB - int(peak_gib * GIB) < margin else "PASS"
    return Candidate(settings, summary, 100 * GIB, margin, margin, verdict)


@pytest.mark.parametrize("limit", [1, 2, 5, 37, 95, 192])
def test_bisect_cap_finds_the_largest_safe_cap_in_few_runs(limit):
    n = 193
    seen: list[Any] = []

    def evaluate(settings: dict[str, Any]) -> Candidate:
        cap = settings[CAP] if settings[CAP] is not None else n
        seen.append(cap)
        return fake(settings, 50 if cap <= limit else 120, oom=0 if cap <= limit else 1)

    frontier = bisect_cap(evaluate, {}, n)
    assert frontier.max_safe_cap == limit
    assert len(seen) <= 2 + math.ceil(math.log2(len(cap_ladder(n)))) + 6  # not a scan of 193 caps


def test_bisect_cap_short_cuts():
    calls: list[Any] = []

    def fits(settings: dict[str, Any]) -> Candidate:
        calls.append(settings[CAP])
        return fake(settings, 10)

    assert bisect_cap(fits, {}, 50).max_safe_cap is None and calls == [None]
    calls.clear()

    def never(settings: dict[str, Any]) -> Candidate:
        calls.append(settings[CAP])
        return fake(settings, 10, oom=1)

    assert bisect_cap(never, {}, 50).max_safe_cap == "none" and calls == [None, 1]


def test_tasks_that_run_together_ask_in_one_batch():
    """Two bisections advance step by step: each step's configurations go to the evaluator as one batch, and each
    bisection gets its own answers."""
    batches: list[list[Any]] = []

    def evaluate(batch: list[dict[str, Any]]) -> list[Candidate]:
        batches.append([settings[CAP] for settings in batch])
        return [fake(s, 50 if (s[CAP] or 193) <= s["limit"] else 120, oom=int((s[CAP] or 193) > s["limit"])) for s in batch]

    low, high = run_tasks(evaluate, [bisection({"limit": 5}, 193), bisection({"limit": 40}, 193)])
    assert (low.max_safe_cap, high.max_safe_cap) == (5, 40)
    assert batches[0] == [None, None] and batches[1] == [1, 1]  # unlimited first, then cap 1, side by side
    assert all(len(batch) <= 2 for batch in batches)


def test_the_search_is_the_same_on_one_or_two_workers():
    """The search's order depends on the scenario only: the same configurations, in the same order, with the same
    numbers, whatever the number of worker processes."""
    one = advise(TINY, variant="no-cap", workers=1, rounds=1)
    two = advise(TINY, variant="no-cap", workers=2, rounds=1)
    assert [(c.settings, c.summary) for c in one.candidates] == [(c.settings, c.summary) for c in two.candidates]
    assert one.recommended is not None and two.recommended is not None
    assert one.recommended.settings == two.recommended.settings


def test_at_risk_is_not_safe_and_pareto_keeps_only_undominated():
    fast_tight = fake({"a": 1}, 96, makespan=1.0)  # headroom 4 GiB < 4.8 GiB band
    assert fast_tight.at_risk and not fast_tight.safe and fast_tight.verdict == "AT RISK"
    slow_roomy = fake({"a": 2}, 20, makespan=3.0)
    dominated = fake({"a": 3}, 30, makespan=4.0)
    oom = fake({"a": 4}, 10, oom=1, makespan=0.5)
    front = pareto_front([fast_tight, slow_roomy, dominated, oom], "makespan")
    assert front == [fast_tight, slow_roomy]
    assert best([fast_tight, slow_roomy, dominated, oom], "makespan", {}) is slow_roomy


@pytest.fixture(scope="module")
def seed_advice() -> Advice:
    return advise(SEED, variant="no-cap", workers=1)


def test_advise_on_the_seed_beats_cap_one_with_the_band(seed_advice):
    """Done when: zero OOM, headroom at least the band, makespan no worse than cap-aware with cap 1."""
    r = seed_advice.recommended
    assert r is not None and r.oom_calls == 0 and r.completes
    assert r.headroom_bytes is not None and r.peak_bytes is not None
    assert r.headroom_bytes >= seed_advice.margin.band.bytes_at(r.peak_bytes)
    ref = seed_advice.reference
    assert ref is not None and ref.settings[CAP] == 1 and ref.settings["engine.cap_aware_padding"] is True
    assert r.summary["makespan_s"] <= ref.summary["makespan_s"]
    assert seed_advice.baseline.oom_calls == 1  # the starting point (no-cap) runs out of memory


def test_advise_recommendation_reproduces_through_set(seed_advice):
    """The printed --set overrides, applied to the starting variant, give the same run the search saw."""
    variant = load_scenario(SEED).resolve("no-cap", seed_advice.overrides())
    result = PluginHost().run(variant, "sim")
    assert not result.oom_calls and not result.failed
    assert result.makespan_s == pytest.approx(seed_advice.recommended.summary["makespan_s"])
    patch = yaml.safe_load(seed_advice.endpoint_patch())
    for dotted, value in seed_advice.overrides().items():
        node = patch
        for part in dotted.split("."):
            node = node[part]
        assert node == value


def test_advise_prunes_instead_of_a_grid(seed_advice):
    grid = len(cap_ladder(17))
    for axis in seed_advice.axes:
        grid *= len(axis.values)
    assert len(seed_advice.candidates) < grid / 5
    assert all(c.verdict in ("PASS", "AT RISK", "FAIL") for c in seed_advice.candidates)


def test_advise_json_and_plot(tmp_path, capsys):
    out = tmp_path / "advice.json"
    assert main(["advise", TINY, "--jobs", "1", "--json", str(out), "--plots", str(tmp_path)]) == 0
    body = orjson.loads(out.read_bytes())
    assert body["schema"] == "skyrl-sim/advise/1"
    assert body["recommended"]["verdict"] == "PASS" and body["recommended"]["oom_calls"] == 0
    assert body["band"]["kind"] == "validated" and body["band"]["source"] == "tiny-cpu-tp1"
    assert body["evaluated"] == len(body["candidates"]) > 1
    assert all(flag.startswith("--set ") for flag in body["set"])
    assert (tmp_path / "pareto.png").stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "recommended" in text and "endpoint-file patch" in text


def test_advise_fix_and_set_keep_a_setting():
    advice = advise(TINY, workers=1, fixed=[CAP], sets={"trainer.micro_train_batch_size_per_gpu": 4}, rounds=1)
    assert all("trainer.micro_train_batch_size_per_gpu" not in c.settings for c in advice.candidates)
    assert all(CAP not in c.settings for c in advice.candidates)
    assert "trainer.micro_train_batch_size_per_gpu" in advice.fixed


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--fix", "trainer.nope"], "--fix trainer.nope"),
        (["--fix", "engine.bogus"], "--fix engine.bogus"),
        (["--margin", "x"], "--margin 'x'"),
        (["--variant", "nope"], "no variant 'nope'"),
        (["--jobs", "0"], "--jobs 0"),
    ],
)
def test_advise_bad_input_exits_2(argv, needle, capsys):
    assert main(["advise", TINY, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_a_search_that_finds_nothing_says_what_it_did_not_vary(tmp_path, capsys):
    """LoRA slots for 64 adapters that do not fit beside Qwen3.6-27B at vLLM TP 1 fail every configuration advise
    tries, while vLLM at TP 4 fits on the same 8 GPUs: advise says that its search found nothing, not that nothing
    fits, and names what it did not vary."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        "name: s\nendpoint:\n  name: e\n  skyrl_version: '0.4.0'\n  model: qwen3.6-27b\n"
        "  hardware: {profile: h100, devices: 8}\n  parallelism: {tp: 4, dp: 2}\n  trainer: {strategy: megatron}\n"
        "  lora: {rank: 32, alpha: 32, merge_lora: false}\n"
        "  inference: {tensor_parallel_size: 1, num_engines: 8, max_loras: 64}\n"
        "workload:\n  clients:\n    - name: c\n      requests:\n        - {type: save_weights_for_sampler}\n"
        "        - {type: sample, prompt_tokens: 64, max_tokens: 64}\n"
    )
    assert main(["advise", str(scenario), "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "configurations searched on at most 8 GPUs" in out and "no configuration on at most" not in out
    assert "advise varies only:" in out and "tensor_parallel_size" in out


def test_known_bounds_skip_runs():
    """Caps known to fit (from a structure using more memory) and known to fail (less memory) are not run again."""
    seen: list[Any] = []

    def evaluate(settings: dict[str, Any]) -> Candidate:
        seen.append(settings[CAP])
        return fake(settings, 50 if (settings[CAP] or 193) <= 15 else 120, oom=0 if (settings[CAP] or 193) <= 15 else 1)

    assert bisect_cap(evaluate, {}, 193, known_safe=10, known_unsafe=20).max_safe_cap == 15
    assert None not in seen and min(seen) > 10 and max(seen) < 20


def test_heatmap_failing_cells_are_never_coloured():
    """An OOM point that finished soonest must not look like the best cell: no colour, its verdict as text."""
    from skyrl_sim.commands.sweep import Axis, Point, Sweep
    from skyrl_sim.reports.plots import heatmap_cells

    def point(cap: int, makespan: float, passed: bool, oom: int) -> Point:
        return Point({CAP: cap}, passed, [], {"makespan_s": makespan, "oom_calls": oom})

    sweep = Sweep(
        SEED,
        "no-cap",
        [Axis(CAP, (1, 2, 16))],
        "completed",
        [point(1, 13.0, True, 0), point(2, 16.6, True, 0), point(16, 5.0, False, 1)],
    )
    cells = heatmap_cells(sweep, "makespan_s", {})
    assert cells.values[0, 0] == 13.0 and cells.values[0, 1] == 16.6
    assert math.isnan(cells.values[0, 2]) and cells.failed[0][2]
    assert cells.labels[0][2] == "OOM\n5"


@pytest.mark.parametrize(("objective", "key"), [("p95", "latency_p95_s"), ("waste", "padding_waste")])
def test_advise_other_objectives_beat_the_reference_on_their_own_number(objective, key):
    advice = advise(TINY, variant="no-cap", objective=objective, workers=1, rounds=1)
    r, ref = advice.recommended, advice.reference
    assert r is not None and ref is not None and r.safe
    assert r.summary[key] <= ref.summary[key]  # never worse than cap 1 with cap-aware padding
    assert advice.to_dict()["objective_key"] == key


def test_an_unknown_headroom_is_said_to_be_unknown():
    """A configuration whose calls report no peak (samples only) has no headroom to hold against the margin: the
    recommendation line says so rather than "headroom - GiB >= margin"."""
    from skyrl_sim.commands.advise_report import headroom_text

    known = fake({"a": 1}, 20)
    unknown = Candidate({"a": 2}, {**known.summary, "held_bytes_max": None}, 100 * GIB, 0, 0, "PASS")
    assert headroom_text(known).startswith("headroom 80.00 GiB >= margin")
    assert unknown.headroom_bytes is None
    assert headroom_text(unknown) == "headroom unknown (no call reports its peak)"

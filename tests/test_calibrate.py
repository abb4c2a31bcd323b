"""Calibration recovers a known hardware profile from calls whose durations a known profile produced, and reports
errors before and after on calls it did not fit."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import yaml

from project_paths import SCENARIOS
from skyrl_sim.cli import main
from skyrl_sim.commands.calibrate import (
    collect,
    feature_terms,
    fit_coefficients,
    nnls,
    run_calibration,
    split_holdout,
)
from skyrl_sim.errors import UserError
from skyrl_sim.plugin_host.costs import MemoryReport
from skyrl_sim.plugin_host.hookspecs import RunContext, hookimpl
from skyrl_sim.results.result import write_results
from skyrl_sim.schema.hardware import load_profile
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.testing import host_with
from skyrl_sim_plugins.sim.backend import SimBackend
from skyrl_sim_plugins.sim.bound.timing import default_time_model

TRUE = {"matmul_s": 2.0, "attention_s": 0.7, "memory_s": 1.5, "fixed_s": 3.0}
MEMORY_FIXED = 12_345_678


class SlotMemory:
    """Peak grows with the call's token slots, plus a fixed amount the model may or may not know about."""

    def __init__(self, fixed: int) -> None:
        self.fixed = fixed

    def bind(self, endpoint, model) -> SlotMemory:
        return self

    def evaluate(self, shape, carried=None, device=None) -> MemoryReport:
        return MemoryReport(peak_bytes=1000 * shape.slots + self.fixed)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, host):
    """A tiny scenario run with a 'true' profile (the stand-in for real hardware); its scenario uses the base one."""
    root = tmp_path_factory.mktemp("calib")
    true_profile = root / "true.yaml"
    true_profile.write_text(
        yaml.safe_dump({"schema": "skyrl-sim/profile/1", "name": "true", "base": "cpu", "time_coefficients": TRUE})
    )
    lengths = [40, 90, 300, 55, 120, 700, 64, 33, 210, 480, 75, 150]
    doc = {
        "name": "calib_tiny",
        "endpoint": str(SCENARIOS / "endpoints" / "tiny-cpu-tp1.yaml"),
        "workload": {
            "clients": [
                {
                    "model_id": "m",
                    "submit": {"mode": "back_to_back", "warmup": 1},
                    "requests": [{"type": "forward_backward", "lengths": lengths}],
                }
            ]
        },
        "variants": {
            "no-cap": {},
            "cap-aware": {"set": {"engine.forward_backward_max_request_count": 1, "engine.cap_aware_padding": True}},
            "cap-3": {"set": {"engine.forward_backward_max_request_count": 3, "engine.cap_aware_padding": True}},
        },
    }
    scenario_path = root / "calib_tiny.yaml"
    scenario_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    scenario = load_scenario(scenario_path)
    backend = SimBackend(memory=SlotMemory(MEMORY_FIXED))
    sets = {"hardware.profile": str(true_profile)}
    paths = {}
    for name in scenario.variant_names:
        run = backend.run(scenario.resolve(name, sets), RunContext(host=host, options={}))
        paths[name] = root / f"{name}.json"
        write_results([run], paths[name])
    return root, paths


def test_features_add_up_to_the_time_model(measured, host):
    root, paths = measured
    samples = collect([("m", r) for r in _runs(paths["cap-3"])], [root], host.padding_rule).samples
    model = default_time_model()
    terms = feature_terms(model)
    for s in samples:
        parts = terms(s.shape, s.endpoint, s.model)
        assert sum(parts.values()) == pytest.approx(model.call_seconds(s.shape, s.endpoint, s.model), rel=1e-9)
        assert parts["matmul_s"] > 0 and parts["fixed_s"] > 0


def test_time_model_without_features_is_a_clear_error():
    with pytest.raises(UserError, match="exposes no features"):
        feature_terms(object())


def _runs(path):
    from skyrl_sim.results.result import read_results

    return read_results(path)


def test_recovers_the_true_profile_on_held_out_calls(measured):
    root, paths = measured
    calibration = run_calibration(
        [paths["no-cap"], paths["cap-aware"]], "fitted", holdout_from=[paths["cap-3"]], scenario_dirs=[root]
    )
    report = calibration.report
    assert report["fit_calls"] >= 12 and report["holdout_calls"] >= 4
    assert report["duration_error_before_holdout"]["median"] > 0.3  # the base profile is far from the truth
    assert report["duration_error_after_holdout"]["max"] < 0.01
    # The terms these calls tell apart come back as the truth's coefficients. (On this tiny model matmul_s and
    # memory_s grow in almost a fixed ratio, so only their weighted sum is determined: the held-out error checks it.)
    for name in ("attention_s", "fixed_s"):
        assert calibration.coefficients[name] == pytest.approx(TRUE[name], rel=1e-3)
    assert "comm_s" not in calibration.coefficients  # TP 1 has no collectives: nothing to fit


class SlotCostModels:
    """A plugin whose cost models answer before the simulator's (the last registered answers a firstresult hook)."""

    @hookimpl
    def skyrl_sim_cost_models(self):
        return default_time_model(), SlotMemory(0)


def test_memory_fixed_term_is_reported(measured):
    root, paths = measured
    host = host_with(SlotCostModels())
    calibration = run_calibration([paths["cap-aware"]], "fitted", holdout=0.3, scenario_dirs=[root], host=host)
    assert calibration.memory_fixed_bytes == MEMORY_FIXED
    report = calibration.report
    assert report["peak_memory_error_before_holdout"]["median"] > 0
    assert report["peak_memory_error_after_holdout"]["max"] < 1e-9


def test_written_profile_is_loaded_by_the_simulator(measured, tmp_path, capsys):
    root, paths = measured
    out = tmp_path / "fitted.yaml"
    report = tmp_path / "report.json"
    args = ["calibrate", str(paths["no-cap"]), str(paths["cap-aware"]), "--holdout-from", str(paths["cap-3"])]
    args += ["--profile", "cpu-fitted", "--out", str(out), "--scenarios", str(root), "--json", str(report)]
    assert main(args) == 0
    assert "holdout" in capsys.readouterr().out
    profile = load_profile(str(out))
    assert profile.name == "cpu-fitted"
    assert profile.time_coefficients["fixed_s"] == pytest.approx(TRUE["fixed_s"], rel=1e-3)
    body = orjson.loads(report.read_bytes())
    assert body["duration_error_after_holdout"]["median"] < 0.01
    # The simulator with the fitted profile reproduces the 'measured' durations of the held-out variant.
    rerun = tmp_path / "rerun.json"
    args = ["run", str(root / "calib_tiny.yaml"), "--variant", "cap-3", "--set", f"hardware.profile={out}"]
    assert main([*args, "--json", str(rerun)]) == 0
    got = [c.duration_s for c in _runs(rerun)[0].calls if c.kind == "forward_backward"]
    want = [c.duration_s for c in _runs(paths["cap-3"])[0].calls if c.kind == "forward_backward"]
    assert got == pytest.approx(want, rel=1e-3)


def test_fit_coefficients_recovers_a_linear_model():
    rng = np.random.default_rng(1)
    features = [{"a": float(x), "b": float(x * x), "c": 1.0, "zero": 0.0} for x in rng.uniform(1, 100, 30)]
    measured = [3.0 * f["a"] + 0.01 * f["b"] + 0.5 for f in features]
    coefficients = fit_coefficients(features, measured)
    assert coefficients == pytest.approx({"a": 3.0, "b": 0.01, "c": 0.5}, rel=1e-3)  # the ridge biases a little
    assert "zero" not in coefficients  # no information about a term that never occurs


def test_noisy_durations_fit_within_noise():
    rng = np.random.default_rng(0)
    xs = rng.uniform(1, 100, 40)
    features = [{"a": float(x), "c": 1.0} for x in xs]
    measured = [(2.0 * x + 5.0) * (1 + rng.uniform(-0.03, 0.03)) for x in xs]
    coefficients = fit_coefficients(features, measured)
    assert coefficients["a"] == pytest.approx(2.0, rel=0.05)


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # the unconstrained slope would be -1
    x = nnls(a, b)
    assert (x >= 0).all() and x[1] == 0.0
    assert x[0] == pytest.approx(2.0)


def test_too_few_calls_is_a_user_error():
    with pytest.raises(UserError, match="cannot fix 3 coefficients"):
        fit_coefficients([{"a": 1.0, "b": 2.0, "c": 1.0}], [1.0])


def test_holdout_split_is_disjoint_and_seeded(measured, host):
    root, paths = measured
    samples = collect([("m", r) for r in _runs(paths["cap-aware"])], [root], host.padding_rule).samples
    fit_part, held = split_holdout(samples, 0.25, seed=1)
    assert len(held) == 3 and len(fit_part) == len(samples) - 3
    assert not {s.key for s in held} & {s.key for s in fit_part}
    assert [s.key for s in split_holdout(samples, 0.25, seed=1)[1]] == [s.key for s in held]
    with pytest.raises(UserError, match="strictly between 0 and 1"):
        split_holdout(samples, 1.5)


def test_failed_and_mismatched_calls_are_skipped(measured, host):
    root, paths = measured
    runs = _runs(paths["cap-aware"])
    runs[0].calls[3].error = "boom"
    runs[0].calls[5].padded_rows = 16  # as if run with different settings
    out = collect([("m", runs[0])], [root], host.padding_rule)
    assert len(out.samples) == len(runs[0].calls) - 2
    assert sum(out.skipped.values()) == 2 and "failed call (OOM or error)" in out.skipped


def test_cli_errors_exit_2(measured, tmp_path, capsys):
    root, paths = measured
    assert main(["calibrate", str(tmp_path / "nope.json"), "--profile", "p", "--out", str(tmp_path / "o.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    args = ["calibrate", str(paths["cap-3"]), "--profile", "p", "--out", str(tmp_path / "o.yaml")]
    assert main([*args, "--scenarios", str(tmp_path)]) == 2
    assert "no scenario named 'calib_tiny'" in capsys.readouterr().err
    assert main([*args, "--scenarios", str(root), "--holdout", "0.5", "--holdout-from", str(paths["no-cap"])]) == 2
    assert "not both" in capsys.readouterr().err


def test_collinear_terms_keep_the_prior_split():
    # Two terms in a fixed ratio on every call: the data fixes only their sum; the base profile's split is kept.
    features = [{"matmul_s": x, "memory_s": 2 * x, "fixed_s": 1.0} for x in (0.1, 0.2, 0.5, 1.0, 2.0)]
    measured = [f["matmul_s"] + f["memory_s"] + f["fixed_s"] for f in features]
    assert fit_coefficients(features, measured) == pytest.approx({"matmul_s": 1.0, "memory_s": 1.0, "fixed_s": 1.0})
    doubled = [2 * y for y in measured]
    fitted = fit_coefficients(features, doubled, prior={"matmul_s": 1.0, "memory_s": 1.0, "fixed_s": 1.0})
    assert fitted["fixed_s"] == pytest.approx(2.0, rel=1e-3)
    assert fitted["matmul_s"] + 2 * fitted["memory_s"] == pytest.approx(6.0, rel=1e-3)

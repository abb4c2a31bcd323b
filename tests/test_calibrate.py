"""Calibration recovers known coefficients from calls whose durations were made by a known linear time model, and
reports errors before and after on calls it did not fit."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from conftest import SCENARIOS
from skyrl_sim_plugins.sim.backend import SimBackend

from skyrl_sim.calibrate import (
    CalibratedProfile,
    CalibratedTimeModel,
    Sample,
    calibrate,
    collect,
    fit,
    nnls,
    split_holdout,
)
from skyrl_sim.cli import main
from skyrl_sim.costs import MemoryReport
from skyrl_sim.errors import UserError
from skyrl_sim.hookspecs import RunContext
from skyrl_sim.result import write_results
from skyrl_sim.scenario import load_scenario

TRUE = {"slots": 2.0e-5, "attention": 3.0e-11, "fixed": 0.4}
MEMORY_FIXED = 123_456_789


class LinearTime:
    """A time model that is exactly linear in three features of a call's shape."""

    def __init__(self, coefficients: dict[str, float]) -> None:
        self.coefficients = coefficients

    def features(self, shape, endpoint, model) -> dict[str, float]:
        return {
            "slots": float(shape.slots),
            "attention": float(sum(mb.rows * mb.width**2 for mb in shape.microbatches)),
            "fixed": 1.0,
        }

    def call_seconds(self, shape, endpoint, model) -> float:
        return sum(self.coefficients[k] * v for k, v in self.features(shape, endpoint, model).items())

    def sample_seconds(self, requests, endpoint, model) -> float:
        return 0.5

    def single_seconds(self, request, endpoint, model) -> float:
        return 0.01


class SlotMemory:
    """Peak grows with the call's token slots, plus a fixed amount the model may or may not know about."""

    def __init__(self, fixed: int) -> None:
        self.fixed = fixed

    def evaluate(self, shape, endpoint, model) -> MemoryReport:
        return MemoryReport(peak_bytes=1000 * shape.slots + self.fixed)


def measured_runs(host, variants: list[str]) -> list:
    """Runs whose durations and peaks come from the 'true' models: the stand-in for a real backend."""
    scenario = load_scenario(SCENARIOS / "queue_drain_17.yaml")
    backend = SimBackend(memory=SlotMemory(MEMORY_FIXED), time=LinearTime(TRUE))
    return [backend.run(scenario.resolve(v), RunContext(host=host, options={})) for v in variants]


def collected(host, variants: list[str], guess: dict[str, float]):
    runs = [("measured.json", r) for r in measured_runs(host, variants)]
    return collect(runs, [SCENARIOS], LinearTime(guess), SlotMemory(0), host.padding_rule)


def test_recovers_known_coefficients_and_memory_term(host):
    guess = {"slots": 1.0e-6, "attention": 1.0e-12, "fixed": 2.0}
    samples = collected(host, ["cap-aware", "cap-only"], guess).samples
    assert len(samples) == 17 + 17  # every pass call of both variants completed and is fitted
    result = fit(samples)
    for name, value in TRUE.items():
        assert result.coefficients[name] == pytest.approx(value, rel=1e-6)
    assert result.memory_fixed_bytes == MEMORY_FIXED


def test_failed_calls_are_skipped_not_fitted(host):
    runs = measured_runs(host, ["cap-aware"])
    runs[0].calls[3].error = "boom"
    out = collect([("m.json", runs[0])], [SCENARIOS], LinearTime(TRUE), None, host.padding_rule)
    assert len(out.samples) == 16
    assert out.skipped == {"failed call (OOM or error)": 1}


def test_call_whose_recorded_shape_differs_is_skipped(host):
    runs = measured_runs(host, ["cap-aware"])
    runs[0].calls[0].padded_rows = 16  # as if run with different settings
    out = collect([("m.json", runs[0])], [SCENARIOS], LinearTime(TRUE), None, host.padding_rule)
    assert len(out.samples) == 16
    assert sum(out.skipped.values()) == 1


def test_holdout_error_before_and_after(host):
    guess = {"slots": 1.0e-6, "attention": 1.0e-12, "fixed": 2.0}
    samples = collected(host, ["cap-aware"], guess).samples
    fit_part, held = split_holdout(samples, 0.25, seed=1)
    assert len(held) == 4 and len(fit_part) == 13
    assert not {s.key for s in held} & {s.key for s in fit_part}
    report = calibrate(fit_part, held, "cpu-test", "h200").report()
    assert report["holdout_calls"] == 4
    assert report["duration_error_before_holdout"]["median"] > 0.3  # the guess is far off
    assert report["duration_error_after_holdout"]["max"] < 1e-6
    assert report["peak_memory_error_before_holdout"]["median"] > 0
    assert report["peak_memory_error_after_holdout"]["max"] < 1e-9


def test_noisy_durations_fit_within_noise(host):
    rng = np.random.default_rng(0)
    samples = collected(host, ["cap-aware", "cap-only"], TRUE).samples
    noisy = [
        Sample(s.source, s.call, s.features, s.measured_s * (1 + rng.uniform(-0.03, 0.03)), s.predicted_s, None, None)
        for s in samples
    ]
    fit_part, held = split_holdout(noisy, 0.3)
    report = calibrate(fit_part, held, "p", "h200").report()
    assert report["duration_error_after_holdout"]["median"] < 0.05


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # unconstrained slope would be -1
    x = nnls(a, b)
    assert (x >= 0).all()
    assert x[1] == 0.0
    assert x[0] == pytest.approx(2.0)


def test_too_few_calls_is_a_user_error(host):
    samples = collected(host, ["cap-aware"], TRUE).samples[:2]
    with pytest.raises(UserError, match="cannot fix 3 coefficients"):
        fit(samples)


def test_holdout_fraction_must_be_a_fraction():
    with pytest.raises(UserError, match="strictly between 0 and 1"):
        split_holdout([], 1.5)


def test_profile_round_trip_and_calibrated_model(host, tmp_path):
    guess = {"slots": 1.0e-6, "attention": 1.0e-12, "fixed": 2.0}
    samples = collected(host, ["cap-aware"], guess).samples
    calibration = calibrate(samples, [], "cpu-fitted", "h200", sources=["measured.json"])
    path = tmp_path / "profile.yaml"
    calibration.write(path)
    profile = CalibratedProfile.read(path)
    assert profile.base == "h200" and profile.name == "cpu-fitted"
    assert profile.memory_fixed_bytes == MEMORY_FIXED
    # The simulator with the calibrated profile reproduces the measured durations call by call.
    scenario = load_scenario(SCENARIOS / "queue_drain_17.yaml")
    model = CalibratedTimeModel(LinearTime(guess), profile.time_coefficients)
    rerun = SimBackend(memory=SlotMemory(0), time=model).run(scenario.resolve("cap-aware"), RunContext(host, {}))
    measured = measured_runs(host, ["cap-aware"])[0]
    assert [round(c.duration_s, 6) for c in rerun.calls] == [round(c.duration_s, 6) for c in measured.calls]


def test_profile_with_wrong_schema_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"schema": "other", "time_coefficients": {}}))
    with pytest.raises(UserError, match=r"bad\.yaml, key 'schema'"):
        CalibratedProfile.read(path)


def test_cli_without_features_is_a_clear_error(host, tmp_path, capsys):
    runs = measured_runs(host, ["cap-aware"])
    path = tmp_path / "runs.json"
    write_results(runs, path)
    code = main(["calibrate", str(path), "--profile", "p", "--out", str(tmp_path / "p.yaml"), "--scenarios", str(SCENARIOS)])
    err = capsys.readouterr().err
    from skyrl_sim_plugins.sim.timing import default_time_model

    if hasattr(default_time_model(), "features"):
        assert code == 0 and (tmp_path / "p.yaml").exists()
    else:
        assert code == 2 and "features" in err


def test_cli_unknown_scenario_and_missing_file(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path / "nope.json"), "--profile", "p", "--out", str(tmp_path / "o.yaml")]) == 2
    assert "no such RunResult file" in capsys.readouterr().err

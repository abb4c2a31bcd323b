"""Calibrating the vLLM step model from measured samples: a run made with known factors is fitted back to them."""

from __future__ import annotations

from pathlib import Path

import yaml

from skyrl_sim.commands.calibrate import run_calibration
from skyrl_sim.commands.calibrate_sampling import FIXED, ROOFLINE
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario


def scenario(
    folder: Path, name: str, lengths: list[tuple[int, int, int]], profile: str, model: str = "tiny-dense"
) -> Path:
    requests = [{"type": "sample", "prompt_tokens": p, "max_tokens": m, "num_samples": n} for p, m, n in lengths]
    body = {
        "name": name,
        "endpoint": {
            "name": "tiny-sampling",
            "model": model,
            "hardware": {"profile": profile, "device_memory_gib": 24.0, "reserve_gib": 0.5, "devices": 1},
            "trainer": {"strategy": "megatron"},
            # max_model_len 1,024: 40 blocks of 32 tokens cannot hold one request of the model's context (vLLM
            # refuses to start), and the longest sequence here is 240 tokens
            "inference": {
                "kv_cache_memory_bytes": 2**28,
                "block_size": 32,
                "num_gpu_blocks_override": 40,
                "max_model_len": 1024,
            },
            # vLLM alone on its device, as the measured runs have it (no trainer to switch with: docs/colocation.md)
            "placement": {"colocate_all": False},
        },
        "workload": {
            "clients": [
                {"name": "c", "model_id": "m", "submit": {"mode": "back_to_back", "gap_s": 0.001}, "requests": requests}
            ]
        },
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def measured_and_rebuilt(tmp_path: Path, profile: str, model: str, made: dict[str, float]) -> dict[str, Path]:
    """Runs made on the simulator with ``made`` factors over ``profile`` ("the hardware"), and the scenario files
    calibrate rebuilds them from, on the plain ``profile``."""
    made_path = tmp_path / "made.yaml"
    made_path.write_text(yaml.safe_dump({"schema": "skyrl-sim/profile/1", "base": profile, "time_coefficients": made}))
    (tmp_path / "made").mkdir()
    (tmp_path / "scenarios").mkdir()
    runs = {}
    for name, lengths in (
        ("fit", [(64, 96, 4), (200, 32, 2), (24, 160, 1), (120, 64, 2), (40, 200, 1)]),
        ("held", [(80, 120, 2), (150, 40, 4), (32, 180, 1)]),
    ):
        measured_with = scenario(tmp_path / "made", name, lengths, str(made_path), model)
        result = PluginHost().run(load_scenario(measured_with).resolve("default"), "sim")
        runs[name] = tmp_path / f"{name}.json"
        result.write(runs[name])
        scenario(tmp_path / "scenarios", name, lengths, profile, model)
    return runs


def test_measured_samples_are_fitted_back_to_the_factors_they_were_made_with(tmp_path: Path) -> None:
    """A tiny model on CPU: the steps' host overhead is what the samples measure, and it is found."""
    runs = measured_and_rebuilt(tmp_path, "cpu", "tiny-dense", {FIXED: 3.0, **dict.fromkeys(ROOFLINE, 0.5)})
    calibration = run_calibration(
        [runs["fit"]], "fitted", holdout_from=[runs["held"]], scenario_dirs=[tmp_path / "scenarios"]
    )
    report = calibration.report
    assert report["sample_latency_error_before_fit"]["median"] > 0.2  # the base profile is off
    assert report["sample_latency_error_after_fit"]["median"] < 0.02
    assert report["sample_latency_error_after_holdout"]["median"] < 0.02  # and so is the held-out workload
    assert abs(calibration.coefficients[FIXED] / 3.0 - 1) < 0.1


def test_kernel_bound_samples_are_predicted_after_the_fit(tmp_path: Path) -> None:
    """An 8B model on an H200, its kernels 1.6x slower than the profile says: decode reads the weights every step, so
    the roofline part shows in the latency and the fitted model predicts the held-out workload. (How the step time
    splits between the two factors is not fixed by such runs, whose steps all mix decode and overhead alike; only
    their sum is, and that is what predicts.)"""
    runs = measured_and_rebuilt(tmp_path, "h200", "qwen3-8b", {FIXED: 1.0, **dict.fromkeys(ROOFLINE, 1.6)})
    calibration = run_calibration(
        [runs["fit"]], "fitted", holdout_from=[runs["held"]], scenario_dirs=[tmp_path / "scenarios"]
    )
    assert calibration.report["sample_latency_error_before_holdout"]["median"] > 0.1
    assert calibration.report["sample_latency_error_after_holdout"]["median"] < 0.03
    assert calibration.coefficients["vllm.memory_s"] > 1.2  # slower kernels than the base profile: a factor above 1

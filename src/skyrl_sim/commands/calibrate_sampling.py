"""Fit the vLLM step model to measured samples: the ``vllm.*`` time coefficients a calibrated profile carries.

A sample's latency is not a sum of per-call terms: it is what the engines' continuous batching makes of every sample
at once (which steps it shares, how long each takes, when it is preempted). So the coefficients are fitted by
simulating the measured runs again: every measured run with completed samples is rebuilt from its scenario file
(as ``calibrate`` rebuilds pass calls), run on the simulator with a candidate profile, and each completed sample's
latency (submitted to completed) compared with the measured one, request by request (the ids are the submission
order on both sides). The fit minimises the mean squared relative error over the fit runs' samples (smooth where a
median is flat: two factors that trade off are told apart by every sample, not the middle one); the report gives the
median absolute error, the number ``compare`` reports.

Two factors are fitted, on the step's features (``vllm_step_cost.FEATURES``): ``vllm.fixed_s`` (the per-step and
per-op overheads: on a CPU and at tiny scale the scheduler and Python dominate) and one roofline factor shared by
``vllm.matmul_s``, ``vllm.attention_s``, ``vllm.memory_s`` and ``vllm.comm_s`` (their split stays the roofline's:
a few hundred samples cannot tell them apart). The search is a log-space grid, then a shrinking pattern search
around its best point.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.hardware import load_profile
from skyrl_sim.schema.variant import ResolvedVariant

if TYPE_CHECKING:
    from skyrl_sim.plugin_host.host import PluginHost

PROFILE_SCHEMA = "skyrl-sim/profile/1"
FIXED = "vllm.fixed_s"
ROOFLINE = ("vllm.matmul_s", "vllm.attention_s", "vllm.memory_s", "vllm.comm_s")
GRID = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
REFINE_ROUNDS = 6


@dataclass
class SamplingRun:
    """One measured run with completed samples, and its variant rebuilt from the scenario file."""

    source: str
    run: RunResult
    variant: ResolvedVariant


def sample_latencies(result: RunResult) -> dict[int, float]:
    """Every completed sample's latency (submitted to completed) by request id."""
    return {
        r.id: r.completed_s - r.submitted_s
        for r in result.requests
        if r.type == "sample" and r.status == "completed" and r.completed_s is not None and r.submitted_s is not None
    }


def with_profile(variant: ResolvedVariant, profile: str) -> ResolvedVariant:
    """The variant with its endpoint's hardware profile replaced."""
    hardware = variant.endpoint.hardware.model_copy(update={"profile": profile})
    return replace(variant, endpoint=variant.endpoint.model_copy(update={"hardware": hardware}))


def latency_errors(runs: Sequence[SamplingRun], profile: str, host: PluginHost) -> list[float]:
    """Per completed sample of the runs, ``(simulated - measured) / measured`` on the simulator with ``profile``."""
    errors: list[float] = []
    for item in runs:
        measured = sample_latencies(item.run)
        simulated = sample_latencies(host.run(with_profile(item.variant, profile), "sim"))
        errors += [(simulated[i] - m) / m for i, m in measured.items() if i in simulated and m > 0]
    return errors


def median_abs(errors: Sequence[float]) -> float:
    return statistics.median(abs(e) for e in errors) if errors else float("inf")


def mean_square(errors: Sequence[float]) -> float:
    return statistics.fmean(e * e for e in errors) if errors else float("inf")


def candidate_profile(folder: Path, base: str, inherited: dict[str, float], fixed: float, roofline: float) -> str:
    """A calibrated profile file over ``base`` with the two factors (and what the base already carries)."""
    coefficients = {**inherited, FIXED: fixed, **dict.fromkeys(ROOFLINE, roofline)}
    path = folder / f"vllm-{fixed:.6g}-{roofline:.6g}.yaml"
    path.write_text(yaml.safe_dump({"schema": PROFILE_SCHEMA, "base": base, "time_coefficients": coefficients}))
    return str(path)


def fit_sampling(
    fit: Sequence[SamplingRun], holdout: Sequence[SamplingRun], base: str, host: PluginHost
) -> tuple[dict[str, float], dict[str, Any]]:
    """The fitted ``vllm.*`` coefficients and a report: the latency error before (the base profile) and after, on the
    fit runs' samples and on the held-out runs' samples."""
    inherited = dict(load_profile(base).time_coefficients)
    start_fixed = inherited.get(FIXED, 1.0)
    start_roofline = inherited.get(ROOFLINE[0], 1.0)
    with tempfile.TemporaryDirectory(prefix="skyrl-sim-calibrate-sampling-") as tmp:
        folder = Path(tmp)
        seen: dict[tuple[float, float], float] = {}

        def objective(fixed: float, roofline: float) -> float:
            key = (round(fixed, 9), round(roofline, 9))
            if key not in seen:
                profile = candidate_profile(folder, base, inherited, fixed, roofline)
                seen[key] = mean_square(latency_errors(fit, profile, host))
            return seen[key]

        points = [(start_fixed * f, start_roofline * r) for f in GRID for r in GRID]
        best = min(points, key=lambda p: objective(*p))
        step = 2.0
        for _ in range(REFINE_ROUNDS):
            step = step**0.5
            around = [(best[0] * a, best[1] * b) for a in (1 / step, 1.0, step) for b in (1 / step, 1.0, step)]
            best = min(around, key=lambda p: objective(*p))
        fitted = {FIXED: best[0], **dict.fromkeys(ROOFLINE, best[1])}
        after = candidate_profile(folder, base, inherited, *best)
        report: dict[str, Any] = {"sampling_fit_runs": len(fit), "sampling_holdout_runs": len(holdout)}
        for label, runs in (("fit", fit), ("holdout", holdout)):
            if not runs:
                continue
            before_errors = latency_errors(runs, base, host)
            after_errors = latency_errors(runs, after, host)
            report[f"sample_latency_error_before_{label}"] = summarise(before_errors)
            report[f"sample_latency_error_after_{label}"] = summarise(after_errors)
        report["sampling_evaluations"] = len(seen)
    return fitted, report


def summarise(errors: Sequence[float]) -> dict[str, Any]:
    """Count, median and largest absolute error, and the signed median (is the model fast or slow?)."""
    if not errors:
        return {"samples": 0, "median": None, "max": None, "signed_median": None}
    return {
        "samples": len(errors),
        "median": median_abs(errors),
        "max": max(abs(e) for e in errors),
        "signed_median": statistics.median(errors),
    }

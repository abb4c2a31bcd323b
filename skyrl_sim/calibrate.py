"""Fit the time model to measured runs: coefficients per time-model feature, a fixed memory term, and the error
before and after on calls that were not used for fitting.

The time model says what a call costs as features of its shape (``features(shape, endpoint, model)``: FLOPs,
bytes moved, collectives, a fixed 1 per call, whatever terms it models), and its duration is linear in them. So
calibration is a least-squares fit of one coefficient per feature (seconds per unit) over the measured
forward_backward / forward calls of one or more RunResults. The fit minimises *relative* error (each call's row is
divided by its measured duration), because relative error is what ``compare`` reports, and keeps coefficients
non-negative (a negative cost per FLOP is a fit artefact, not hardware). The memory term is the median of measured
minus modelled peak over completed calls: what the stack holds that the allocation walk does not see.

A RunResult carries its scenario and variant names, not their settings, so each run's endpoint is rebuilt from the
scenario file of that name (searched in ``--scenarios``, default ``scenarios/``) and every call's shape is rebuilt
with the shared shape rules from the requests' datum lengths; a call whose rebuilt shape differs from the recorded
one (the run used ``--set`` overrides) is skipped and counted, never fitted with the wrong features.

The profile file written (``schema: skyrl-sim/profile/1``) names its base profile and holds ``time_coefficients``
(seconds per unit of each feature) and ``memory.fixed_bytes``; ``CalibratedTimeModel`` applies it over any time
model that exposes the same features.
"""

from __future__ import annotations

import argparse
import platform
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from skyrl_sim.architecture import ModelArch
from skyrl_sim.costs import MemoryModel, TimeModel
from skyrl_sim.endpoint import Endpoint
from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.result import CallRecord, RunResult, read_results
from skyrl_sim.scenario import PASSES, Request, ScenarioFile, load_scenario, read_yaml
from skyrl_sim.shapes import CallShape, PaddingRule, shape_call

PROFILE_SCHEMA = "skyrl-sim/profile/1"


class FeatureTimeModel(TimeModel, Protocol):
    """A time model whose call duration is linear in named per-call features."""

    def features(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> dict[str, float]:
        """The cost terms of one call (e.g. ``flops``, ``bytes``, ``collectives``, ``fixed``)."""
        ...


@dataclass
class Sample:
    """One measured pass call with what the models say about it."""

    source: str
    call: int
    features: dict[str, float]
    measured_s: float
    predicted_s: float
    measured_peak: int | None
    modelled_peak: int | None

    @property
    def key(self) -> str:
        return f"{self.source}#{self.call}"


@dataclass
class Collected:
    samples: list[Sample] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def find_scenario(name: str, directories: Sequence[Path]) -> Path:
    """The scenario file whose ``name`` is ``name``."""
    for directory in directories:
        for path in sorted(directory.glob("*.yaml")):
            try:
                if read_yaml(path).get("name") == name:
                    return path
            except ScenarioError:
                continue
    where = ", ".join(str(d) for d in directories)
    raise UserError(f"no scenario named '{name}' in {where} (pass --scenarios DIR holding the file the run came from)")


def _recorded_shape(call: CallRecord) -> tuple[int, int, int, int]:
    return call.rows, call.padded_rows, call.width, call.microbatches


def _rebuilt_shape(shape: CallShape) -> tuple[int, int, int, int]:
    return shape.rows, shape.padded_rows, shape.width, len(shape.microbatches_of_rank(0))


def collect(
    runs: Iterable[tuple[str, RunResult]],
    scenario_dirs: Sequence[Path],
    time_model: FeatureTimeModel,
    memory_model: MemoryModel | None,
    rule_for: Any,
) -> Collected:
    """Every completed pass call of the runs, with its features, measured and predicted duration and peaks.

    ``rule_for(strategy)`` gives the padding rule of a training stack (the plugin host's ``padding_rule``).
    """
    if not callable(getattr(time_model, "features", None)):
        raise UserError(
            f"the time model {type(time_model).__name__} exposes no features(shape, endpoint, model); calibrate fits "
            "one coefficient per feature and cannot run without them"
        )
    out = Collected()
    scenarios: dict[tuple[str, str], ScenarioFile] = {}
    for source, run in runs:
        key = (run.scenario, run.endpoint)
        if key not in scenarios:
            path = find_scenario(run.scenario, scenario_dirs)
            scenario = load_scenario(path)
            try:
                same = scenario.resolve(scenario.variant_names[0]).endpoint.name == run.endpoint
            except ScenarioError:
                same = False
            scenarios[key] = scenario if same else load_scenario(path, run.endpoint)
        scenario = scenarios[key]
        if run.variant not in scenario.variant_names:
            raise UserError(f"{source}: scenario {scenario.path} has no variant '{run.variant}'")
        variant = scenario.resolve(run.variant)
        endpoint, model = variant.endpoint, variant.model
        rule: PaddingRule = rule_for(endpoint.trainer.strategy)
        datums = {r.id: r.datums for r in run.requests}
        for call in run.calls:
            if call.kind not in PASSES:
                continue
            if call.oom is not None or call.error:
                out.skip("failed call (OOM or error)")
                continue
            lengths = [length for rid in call.request_ids for length in datums.get(rid, [])]
            if not lengths:
                out.skip("no datum lengths recorded")
                continue
            shape = shape_call(call.kind, lengths, endpoint, rule)
            if _rebuilt_shape(shape) != _recorded_shape(call):
                out.skip("shape differs from the scenario's (run with overrides?)")
                continue
            if call.duration_s <= 0:
                out.skip("no measured duration")
                continue
            modelled = memory_model.evaluate(shape, endpoint, model).peak_bytes if memory_model else None
            out.samples.append(
                Sample(
                    source=f"{source}:{run.variant}",
                    call=call.index,
                    features={k: float(v) for k, v in time_model.features(shape, endpoint, model).items()},
                    measured_s=call.duration_s,
                    predicted_s=time_model.call_seconds(shape, endpoint, model),
                    measured_peak=call.peak_bytes,
                    modelled_peak=modelled,
                )
            )
    return out


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """Non-negative least squares (Lawson and Hanson's active-set method): argmin ||a x - b|| with x >= 0."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(a.shape)
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        candidates = np.where(~passive & (gradient > tol))[0]
        if candidates.size == 0:
            break
        passive[candidates[np.argmax(gradient[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
    return x


@dataclass
class Fit:
    """Fitted seconds per unit of each feature, and the fixed memory term."""

    coefficients: dict[str, float]
    memory_fixed_bytes: int | None

    def seconds(self, features: dict[str, float]) -> float:
        return sum(self.coefficients.get(name, 0.0) * value for name, value in features.items())


def fit(samples: Sequence[Sample]) -> Fit:
    """Least squares in relative error, non-negative coefficients; features that are zero on every call get 0."""
    if not samples:
        raise UserError("no completed forward_backward / forward calls to fit (every call failed, or none matched)")
    names = sorted({name for s in samples for name in s.features})
    a = np.array([[s.features.get(n, 0.0) for n in names] for s in samples], dtype=float)
    y = np.array([s.measured_s for s in samples], dtype=float)
    scale = np.abs(a).max(axis=0)
    used = scale > 0
    if int(used.sum()) > len(samples):
        raise UserError(f"{len(samples)} calls cannot fix {int(used.sum())} coefficients: give more measured runs")
    weighted = a[:, used] / scale[used] / y[:, None]  # columns scaled to 1, rows to relative error
    solution = nnls(weighted, np.ones(len(samples)))
    coefficients = dict.fromkeys(names, 0.0)
    fitted = [name for name, is_used in zip(names, used, strict=True) if is_used]
    for name, value, unit in zip(fitted, solution, scale[used], strict=True):
        coefficients[name] = float(value / unit)
    gaps = [
        s.measured_peak - s.modelled_peak for s in samples if s.measured_peak is not None and s.modelled_peak is not None
    ]
    return Fit(coefficients, int(np.median(gaps)) if gaps else None)


def split_holdout(samples: list[Sample], fraction: float, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """A seeded random ``fraction`` of the calls held out (at least one, and at least one left to fit)."""
    if not 0 < fraction < 1:
        raise UserError(f"--holdout {fraction}: must be a fraction strictly between 0 and 1")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    count = min(len(samples) - 1, max(1, round(fraction * len(samples))))
    held = set(order[:count])
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def duration_errors(samples: Sequence[Sample], predict: Any) -> list[float]:
    """Signed relative errors ``(predicted - measured) / measured`` of each call."""
    return [(predict(s) - s.measured_s) / s.measured_s for s in samples]


def memory_errors(samples: Sequence[Sample], fixed: int) -> list[float]:
    return [
        (s.modelled_peak + fixed - s.measured_peak) / s.measured_peak
        for s in samples
        if s.measured_peak and s.modelled_peak is not None
    ]


def _stats(errors: list[float]) -> dict[str, Any]:
    if not errors:
        return {"median": None, "p95": None, "max": None, "calls": 0}
    data = sorted(abs(e) for e in errors)
    return {
        "median": float(np.median(data)),
        "p95": data[max(0, int(np.ceil(0.95 * len(data))) - 1)],
        "max": data[-1],
        "calls": len(data),
    }


@dataclass
class Calibration:
    """A fit and its report: errors before (the time model as it was) and after, on fit and held-out calls."""

    profile: str
    base_profile: str
    fit: Fit
    fit_calls: list[Sample]
    holdout_calls: list[Sample]
    skipped: dict[str, int]
    sources: list[str]

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fit_calls": len(self.fit_calls), "holdout_calls": len(self.holdout_calls)}
        for label, samples in (("fit", self.fit_calls), ("holdout", self.holdout_calls)):
            out[f"duration_error_before_{label}"] = _stats(duration_errors(samples, lambda s: s.predicted_s))
            out[f"duration_error_after_{label}"] = _stats(duration_errors(samples, lambda s: self.fit.seconds(s.features)))
            if self.fit.memory_fixed_bytes is not None:
                out[f"peak_memory_error_before_{label}"] = _stats(memory_errors(samples, 0))
                out[f"peak_memory_error_after_{label}"] = _stats(memory_errors(samples, self.fit.memory_fixed_bytes))
        out["skipped"] = dict(self.skipped)
        return out

    def profile_document(self) -> dict[str, Any]:
        return {
            "schema": PROFILE_SCHEMA,
            "name": self.profile,
            "base": self.base_profile,
            "time_coefficients": self.fit.coefficients,
            "memory": {"fixed_bytes": self.fit.memory_fixed_bytes},
            "calibration": {
                "sources": self.sources,
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "report": self.report(),
            },
        }

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(self.profile_document(), sort_keys=False))


def calibrate(
    fit_samples: list[Sample],
    holdout_samples: list[Sample],
    profile: str,
    base_profile: str,
    skipped: dict[str, int] | None = None,
    sources: list[str] | None = None,
) -> Calibration:
    return Calibration(profile, base_profile, fit(fit_samples), fit_samples, holdout_samples, skipped or {}, sources or [])


@dataclass
class CalibratedProfile:
    """A profile file written by ``calibrate``."""

    name: str
    base: str
    time_coefficients: dict[str, float]
    memory_fixed_bytes: int | None

    @classmethod
    def read(cls, path: str | Path) -> CalibratedProfile:
        data = read_yaml(Path(path))
        if data.get("schema") != PROFILE_SCHEMA:
            raise ScenarioError(str(path), "schema", f"expected '{PROFILE_SCHEMA}', got {data.get('schema')!r}")
        coefficients = data.get("time_coefficients")
        if not isinstance(coefficients, dict) or not all(isinstance(v, (int, float)) for v in coefficients.values()):
            raise ScenarioError(str(path), "time_coefficients", "must map feature names to seconds per unit")
        memory = data.get("memory") or {}
        return cls(str(data.get("name", "")), str(data.get("base", "")), dict(coefficients), memory.get("fixed_bytes"))


class CalibratedTimeModel:
    """A time model whose pass calls cost ``sum(coefficient * feature)`` over a base model's features; samples and
    singles keep the base model's times (calibration fits pass calls only)."""

    def __init__(self, base: FeatureTimeModel, coefficients: dict[str, float]) -> None:
        self.base = base
        self.coefficients = coefficients

    def features(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> dict[str, float]:
        return self.base.features(shape, endpoint, model)

    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        terms = self.base.features(shape, endpoint, model)
        return sum(self.coefficients.get(name, 0.0) * value for name, value in terms.items())

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        return self.base.sample_seconds(requests, endpoint, model)

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        return self.base.single_seconds(request, endpoint, model)


# ---------------------------------------------------------------- command line


def _load_runs(paths: Sequence[str]) -> list[tuple[str, RunResult]]:
    runs: list[tuple[str, RunResult]] = []
    for path in paths:
        try:
            results = read_results(path)
        except FileNotFoundError:
            raise UserError(f"{path}: no such RunResult file") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"{path}: not a skyrl-sim RunResult JSON ({type(exc).__name__}: {exc})") from None
        runs.extend((path, r) for r in results)
    return runs


def default_models() -> tuple[FeatureTimeModel, MemoryModel]:
    """The simulator's own time and memory models: the ones a calibrated profile corrects."""
    from skyrl_sim_plugins.sim.memory import default_memory_model
    from skyrl_sim_plugins.sim.timing import default_time_model

    return default_time_model(), default_memory_model()  # type: ignore[return-value]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def print_calibration(console: Console, calibration: Calibration) -> None:
    report = calibration.report()
    table = Table(title=f"calibration of profile '{calibration.profile}' (absolute errors)", title_justify="left")
    for column in ("metric", "calls", "before median", "after median", "after p95", "after max"):
        table.add_column(column)
    for metric in ("duration", "peak_memory"):
        for label in ("fit", "holdout"):
            before = report.get(f"{metric}_error_before_{label}")
            after = report.get(f"{metric}_error_after_{label}")
            if before is None or after is None:
                continue
            table.add_row(
                f"{metric.replace('_', ' ')} ({label})",
                str(after["calls"]),
                _fmt(before["median"]),
                _fmt(after["median"]),
                _fmt(after["p95"]),
                _fmt(after["max"]),
            )
    console.print(table)
    coefficients = ", ".join(f"{k} {v:.4g}" for k, v in calibration.fit.coefficients.items())
    console.print(f"time coefficients (s per unit): {coefficients}")
    if calibration.fit.memory_fixed_bytes is not None:
        console.print(f"memory fixed term: {calibration.fit.memory_fixed_bytes:,} bytes")
    if calibration.skipped:
        console.print("skipped calls: " + ", ".join(f"{n} {reason}" for reason, n in calibration.skipped.items()))


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    from skyrl_sim.host import PluginHost

    if args.holdout is not None and args.holdout_from:
        raise UserError("give --holdout FRACTION or --holdout-from FILES, not both")
    runs = _load_runs(args.runs)
    held_runs = _load_runs(args.holdout_from or [])
    host = PluginHost()
    time_model, memory_model = default_models()
    dirs = [Path(d) for d in (args.scenarios or ["scenarios"])]
    collected = collect(runs, dirs, time_model, memory_model, host.padding_rule)
    samples = collected.samples
    if held_runs:
        held = collect(held_runs, dirs, time_model, memory_model, host.padding_rule)
        fit_samples, holdout = samples, held.samples
    elif args.holdout is not None:
        fit_samples, holdout = split_holdout(samples, args.holdout, args.seed)
    else:
        fit_samples, holdout = samples, []
    bases = sorted({_base_profile(dirs, run) for _, run in runs})
    calibration = calibrate(
        fit_samples, holdout, args.profile, ",".join(bases), collected.skipped, sorted({p for p, _ in runs})
    )
    print_calibration(console, calibration)
    calibration.write(args.out)
    console.print(f"wrote {args.out}")
    return 0


def _base_profile(dirs: Sequence[Path], run: RunResult) -> str:
    scenario = load_scenario(find_scenario(run.scenario, dirs), run.endpoint)
    return scenario.resolve(run.variant).endpoint.hardware.profile


def add_parser(sub: Any) -> None:
    """``skyrl-sim calibrate``: registered by the CLI."""
    p = sub.add_parser(
        "calibrate",
        help="fit the time model's coefficients (and a memory term) to measured RunResults; write a hardware profile",
    )
    p.add_argument("runs", nargs="+", metavar="RUNRESULT.json", help="measured runs (e.g. --backend megatron --json)")
    p.add_argument("--profile", required=True, metavar="NAME", help="name of the calibrated profile")
    p.add_argument("--out", required=True, metavar="PROFILE.yaml", help="where to write the profile")
    p.add_argument("--holdout", type=float, metavar="FRACTION", help="hold out this fraction of the calls (seeded)")
    p.add_argument("--holdout-from", nargs="+", metavar="RUNRESULT.json", help="report on these runs' calls instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the --holdout split")
    p.add_argument("--scenarios", action="append", metavar="DIR", help="where the runs' scenario files are (scenarios/)")
    p.set_defaults(func=cmd_calibrate)

"""Fit the time model to measured runs and write a hardware profile the simulator loads; report the error before and
after on calls that were not used for fitting.

**Features.** The time model splits a call's duration into terms (``features(shape, endpoint, model)``; the roofline
model's are ``matmul_s``, ``attention_s``, ``memory_s``, ``comm_s`` and ``fixed_s``, each in seconds on the
uncalibrated profile) and a profile's ``time_coefficients`` multiply them. Calibration fits one coefficient per term
by least squares over the measured forward_backward / forward calls, in *relative* error (each call's row divided by
its measured duration, since relative error is what ``compare`` reports), with non-negative coefficients (a negative
cost is a fit artefact, not hardware). A term that is zero on every measured call (``comm_s`` at TP 1) carries no
information and keeps the base profile's coefficient.

**Profile.** The file written (``schema: skyrl-sim/profile/1``) names its base profile and holds the fitted
``time_coefficients``; ``skyrl_sim.schema.hardware.load_profile`` loads it as the base with those factors, so an endpoint
uses it with ``hardware.profile: PATH``. Errors before and after are always the time model's own predictions with
the base profile and with the written one.

**Memory.** The median of measured minus modelled peak over completed calls is reported (and written as
``memory.fixed_bytes``) as the fixed memory term: what the stack holds that the allocation walk does not see.

A RunResult carries its scenario and variant names, not their settings: each run's endpoint is rebuilt from the
scenario file of that name (searched in ``--scenarios``) and each call's shape from its requests' datum lengths with
the shared shape rules. A call whose rebuilt shape differs from the recorded one (the run used ``--set`` overrides)
is skipped and counted, never fitted with the wrong features.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import yaml
from rich.console import Console
from rich.table import Table

from skyrl_sim.commands.calibrate_sampling import SamplingRun, fit_sampling, sample_latencies
from skyrl_sim.engine.shapes import CallShape, PaddingRule, shape_call
from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.plugin_host.costs import BoundTimeModel, CarriedMemory, DeviceMemory, MemoryModel, TimeModel
from skyrl_sim.results.outputs import Output, check_outputs, write_atomic
from skyrl_sim.results.result import CallRecord, RunResult, read_results
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.documents import read_yaml
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.hardware import HardwareProfile, base_ref_beside, load_profile
from skyrl_sim.schema.requests import PASSES
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario
from skyrl_sim.schema.shipped import shipped_scenarios
from skyrl_sim.units import pct

if TYPE_CHECKING:
    from skyrl_sim.plugin_host.host import PluginHost

PROFILE_SCHEMA = "skyrl-sim/profile/1"
"""A calibrated profile: a base profile plus fitted time coefficients (read by ``skyrl_sim.schema.hardware``)."""

RIDGE = 1e-6
"""Weight of the pull towards the base coefficients, against a squared relative error per call (see fit_coefficients)."""

Features = Callable[[CallShape, Endpoint, ModelArch], dict[str, float]]


def feature_terms(time_model: object) -> Features:
    """The time model's per-call feature terms, or a clear error when it has none."""
    features = getattr(time_model, "features", None)
    if not callable(features):
        raise UserError(
            f"the time model {type(time_model).__name__} exposes no features(shape, endpoint, model); calibrate fits "
            "one coefficient per feature term and cannot run without them"
        )
    return features  # type: ignore[no-any-return]


@dataclass
class Sample:
    """One measured, completed pass call and what is needed to ask the models about it again."""

    source: str
    call: int
    shape: CallShape
    endpoint: Endpoint
    model: ModelArch
    measured_s: float
    measured_peak: int | None = None
    modelled_peak: int | None = None

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
    """The scenario file whose ``name`` is ``name``: in ``directories``, else the shipped scenario of that name (a run
    of ``scenarios/queue_drain_17_tiny.yaml`` made after a plain install, as ``run`` resolves that path)."""
    shipped = shipped_scenarios().get(name)
    for directory in [*directories, *([shipped.parent] if shipped is not None else [])]:
        for path in sorted(directory.glob("*.yaml")):
            try:
                if read_yaml(path, role="a scenario file").get("name") == name:
                    return path
            except ScenarioError:
                continue
    where = ", ".join(str(d) for d in directories)
    raise UserError(f"no scenario named '{name}' in {where} (pass --scenarios DIR holding the file the run came from)")


def _scenario_for(run: RunResult, directories: Sequence[Path]) -> ScenarioFile:
    path = find_scenario(run.scenario, directories)
    scenario = load_scenario(path)
    if scenario.resolve(scenario.variant_names[0]).endpoint.name != run.endpoint:
        scenario = load_scenario(path, run.endpoint)  # the run used --endpoint
    if run.variant not in scenario.variant_names:
        raise UserError(f"scenario {scenario.path} has no variant '{run.variant}' (a run of it was given)")
    return scenario


def collect(
    runs: Iterable[tuple[str, RunResult]],
    scenario_dirs: Sequence[Path],
    rule_for: Callable[[str], PaddingRule],
    memory_model: MemoryModel | None = None,
) -> Collected:
    """Every completed pass call of the runs with its rebuilt shape and endpoint and its measured numbers.

    ``rule_for(strategy)`` gives a training stack's padding rule (the plugin host's ``padding_rule``).
    """
    out = Collected()
    scenarios: dict[tuple[str, str], ScenarioFile] = {}
    for source, run in runs:
        key = (run.scenario, run.endpoint)
        if key not in scenarios:
            scenarios[key] = _scenario_for(run, scenario_dirs)
        variant = scenarios[key].resolve(run.variant)
        endpoint, model = variant.endpoint, variant.model
        device = DeviceMemory.of(endpoint)
        if run.capacity_bytes and run.capacity_bytes != device.capacity_bytes:
            # the run had another memory limit (a --set override): walk it with the capacity it ran under
            device = DeviceMemory(run.capacity_bytes + device.reserve_bytes, device.reserve_bytes)
        bound = memory_model.bind(endpoint, model) if memory_model is not None else None
        rule = rule_for(endpoint.trainer.strategy)
        datums = {r.id: r.datums for r in run.requests}
        carried = CarriedMemory()  # what earlier calls of this run left on the device, in call order
        for call in run.calls:
            if call.kind not in PASSES:
                continue
            lengths = [length for rid in call.request_ids for length in datums.get(rid, [])]
            shape = shape_call(call.kind, lengths, endpoint, rule) if lengths else None
            report = bound.evaluate(shape, carried, device) if bound is not None and shape else None
            if report is not None:
                carried = report.carried
            if call.oom is not None or call.error:
                out.skip("failed call (OOM or error)")
                continue
            if shape is None:
                out.skip("no datum lengths recorded")
                continue
            if _rebuilt(shape) != _recorded(call):
                out.skip("shape differs from the scenario's (run with overrides?)")
                continue
            if call.duration_s <= 0:
                out.skip("no measured duration")
                continue
            modelled = report.peak_bytes if report is not None else None
            out.samples.append(
                Sample(
                    f"{source}:{run.variant}", call.index, shape, endpoint, model, call.duration_s, call.peak_bytes, modelled
                )
            )
    return out


def _recorded(call: CallRecord) -> tuple[int, int, int, int]:
    return call.rows, call.padded_rows, call.width, call.microbatches


def _rebuilt(shape: CallShape) -> tuple[int, int, int, int]:
    return shape.rows, shape.padded_rows, shape.width, len(shape.microbatches_of_rank(0))


# ---------------------------------------------------------------- fitting


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


def fit_coefficients(
    features: Sequence[dict[str, float]],
    measured: Sequence[float],
    prior: dict[str, float] | None = None,
    lower: dict[str, float] | None = None,
) -> dict[str, float]:
    """``c >= lower`` (0 where none) minimising ``sum(((c . f_i) - y_i) / y_i)^2 + RIDGE * sum((c_j / p_j - 1)^2)``.

    The small pull towards the prior ``p`` (the base profile's coefficients, 1 where none) decides only what the data
    cannot: two terms that grow in a fixed ratio on every measured call (matmul and memory time on a tiny model) keep
    the base profile's split of their sum instead of an arbitrary one. ``lower`` keeps every term physical: a
    coefficient below the profile's efficiency for that unit would mean the device ran faster than its peak
    (``physical_lower_bounds``). A term that is zero on every call carries no information and is left out.
    """
    if not features:
        raise UserError("no completed forward_backward / forward calls to fit (every call failed, or none matched)")
    names = sorted({name for f in features for name in f})
    a = np.array([[f.get(n, 0.0) for n in names] for f in features], dtype=float)
    y = np.array(measured, dtype=float)
    scale = np.abs(a).max(axis=0)
    used = scale > 0
    fitted = [name for name, is_used in zip(names, used, strict=True) if is_used]
    if len(fitted) > len(features):
        raise UserError(f"{len(features)} calls cannot fix {len(fitted)} coefficients: give more measured runs")
    prior_x = np.array([(prior or {}).get(n, 1.0) for n in fitted]) * scale[used]
    floor = np.array([(lower or {}).get(n, 0.0) for n in fitted]) * scale[used]
    rows = a[:, used] / scale[used] / y[:, None]
    penalty = np.diag(np.sqrt(RIDGE) / np.maximum(prior_x, 1e-300))
    matrix = np.vstack([rows, penalty])
    target = np.concatenate([np.ones(len(features)), np.full(len(fitted), np.sqrt(RIDGE))])
    solution = floor + nnls(matrix, target - matrix @ floor)  # c = floor + c', c' >= 0
    return {name: float(value / unit) for name, value, unit in zip(fitted, solution, scale[used], strict=True)}


def physical_lower_bounds(profile: HardwareProfile) -> dict[str, float]:
    """The smallest coefficient of each rate-bound term: its profile efficiency, where it would run at the device's
    peak (``time = work / (peak x efficiency) x c``). Fixed overheads have no bound."""
    e = profile.efficiency
    return {"matmul_s": e.matmul, "attention_s": e.attention, "memory_s": e.memory, "comm_s": e.interconnect}


def memory_fixed_bytes(samples: Sequence[Sample]) -> int | None:
    """Median of measured minus modelled peak: the memory the stack holds that the model does not walk."""
    gaps = [
        s.measured_peak - s.modelled_peak for s in samples if s.measured_peak is not None and s.modelled_peak is not None
    ]
    return int(np.median(gaps)) if gaps else None


def with_profile(endpoint: Endpoint, profile: str) -> Endpoint:
    return endpoint.model_copy(update={"hardware": endpoint.hardware.model_copy(update={"profile": profile})})


def relative_errors(samples: Sequence[Sample], predicted: Sequence[float]) -> list[float]:
    """Signed ``(predicted - measured) / measured`` per call."""
    return [(p - s.measured_s) / s.measured_s for s, p in zip(samples, predicted, strict=True)]


def error_summary(errors: Sequence[float]) -> dict[str, Any]:
    if not errors:
        return {"median": None, "p95": None, "max": None, "calls": 0}
    data = sorted(abs(e) for e in errors)
    return {
        "median": float(np.median(data)),
        "p95": data[max(0, int(np.ceil(0.95 * len(data))) - 1)],
        "max": data[-1],
        "calls": len(data),
    }


def predict(time_model: TimeModel, samples: Sequence[Sample], profile_ref: str) -> list[float]:
    """The time model's durations of the samples' calls with the endpoint's profile replaced by ``profile_ref`` (the
    model bound once per run's endpoint and model: the samples of one run share them)."""
    bound: dict[tuple[int, int], BoundTimeModel] = {}
    seconds = []
    for sample in samples:
        key = (id(sample.endpoint), id(sample.model))  # the samples hold them: no id is reused in this loop
        times = bound.get(key)
        if times is None:
            times = bound[key] = time_model.bind(with_profile(sample.endpoint, profile_ref), sample.model)
        seconds.append(times.call_seconds(sample.shape))
    return seconds


@dataclass
class Calibration:
    """Fitted coefficients over a base profile and the report: errors before (base) and after (calibrated)."""

    name: str
    base: str
    coefficients: dict[str, float]
    memory_fixed_bytes: int | None
    report: dict[str, Any]

    def document(self, path: str | Path | None = None) -> dict[str, Any]:
        """The profile file's content (``skyrl_sim.schema.hardware`` reads ``base`` and ``time_coefficients``); written
        at ``path``, a base profile given as a path is named relative to it."""
        return {
            "schema": PROFILE_SCHEMA,
            "name": self.name,
            "base": self.base if path is None else base_ref_beside(self.base, Path(path)),
            "time_coefficients": self.coefficients,
            "memory": {"fixed_bytes": self.memory_fixed_bytes},
            "calibration": _plain(self.report),
        }

    def write(self, path: str | Path) -> None:
        write_atomic(path, yaml.safe_dump(self.document(path), sort_keys=False))


def _plain(value: Any) -> Any:
    """Numbers as plain floats and ints (YAML cannot write numpy scalars)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def calibrate(
    fit_samples: Sequence[Sample],
    holdout: Sequence[Sample],
    time_model: TimeModel,
    name: str,
    skipped: dict[str, int] | None = None,
    sampling_bases: Sequence[str] = (),
) -> Calibration:
    """Fit the coefficients to ``fit_samples`` and report the time model's errors before and after on both sets.
    ``sampling_bases``: the profiles of runs whose samples are fitted too (``calibrate_sampling``), so a calibration of
    sampling runs alone has a base."""
    bases = sorted({s.endpoint.hardware.profile for s in [*fit_samples, *holdout]} | set(sampling_bases))
    if len(bases) != 1:
        raise UserError(f"the runs use {len(bases)} hardware profiles ({', '.join(bases)}): calibrate one at a time")
    base = bases[0]
    terms = feature_terms(time_model)
    base_profile = load_profile(base)
    inherited = dict(base_profile.time_coefficients)
    fitted = (
        fit_coefficients(
            [terms(s.shape, s.endpoint, s.model) for s in fit_samples],
            [s.measured_s for s in fit_samples],
            lower=physical_lower_bounds(base_profile),
        )
        if fit_samples or not sampling_bases  # runs of samples only fit the sampling coefficients alone
        else {}
    )
    coefficients = {**inherited, **fitted}
    fixed = memory_fixed_bytes(fit_samples)
    calibration = Calibration(name, base, coefficients, fixed, {})
    report: dict[str, Any] = {"base": base, "fit_calls": len(fit_samples), "holdout_calls": len(holdout)}
    with tempfile.TemporaryDirectory(prefix="skyrl-sim-calibrate-") as tmp:
        candidate = Path(tmp) / f"{name or 'calibrated'}.yaml"
        calibration.write(candidate)
        for label, samples in (("fit", fit_samples), ("holdout", holdout)):
            before = relative_errors(samples, predict(time_model, samples, base))
            after = relative_errors(samples, predict(time_model, samples, str(candidate)))
            report[f"duration_error_before_{label}"] = error_summary(before)
            report[f"duration_error_after_{label}"] = error_summary(after)
            if fixed is not None:
                peaks = [
                    (s.modelled_peak, s.measured_peak) for s in samples if s.measured_peak and s.modelled_peak is not None
                ]
                report[f"peak_memory_error_before_{label}"] = error_summary([(m - r) / r for m, r in peaks])
                report[f"peak_memory_error_after_{label}"] = error_summary([(m + fixed - r) / r for m, r in peaks])
    report["coefficients"] = coefficients
    report["memory_fixed_bytes"] = fixed
    report["skipped"] = dict(skipped or {})
    calibration.report = report
    return calibration


def split_holdout(samples: Sequence[Sample], fraction: float, seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """A seeded random ``fraction`` of the calls held out (at least one, and at least one left to fit)."""
    if not 0 < fraction < 1:
        raise UserError(f"--holdout {fraction}: must be a fraction strictly between 0 and 1")
    if len(samples) < 2:
        raise UserError(f"--holdout needs at least two measured calls, got {len(samples)}")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    count = min(len(samples) - 1, max(1, round(fraction * len(samples))))
    held = set(order[:count])
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


# ---------------------------------------------------------------- command line


def load_runs(paths: Sequence[str | Path]) -> list[tuple[str, RunResult]]:
    runs: list[tuple[str, RunResult]] = []
    for path in paths:
        results = read_results(path)
        runs.extend((str(path), r) for r in results)
    return runs


def print_calibration(console: Console, calibration: Calibration) -> None:
    report = calibration.report
    table = Table(title=f"calibration of '{calibration.name}' over '{calibration.base}'", title_justify="left")
    for column in ("absolute error", "calls", "before median", "after median", "after p95", "after max"):
        table.add_column(column)
    for metric in ("duration", "peak_memory"):
        for label in ("fit", "holdout"):
            before, after = report.get(f"{metric}_error_before_{label}"), report.get(f"{metric}_error_after_{label}")
            if before is None or after is None or not after["calls"]:
                continue
            table.add_row(
                f"{metric.replace('_', ' ')} ({label})",
                str(after["calls"]),
                pct(before["median"]),
                pct(after["median"]),
                pct(after["p95"]),
                pct(after["max"]),
            )
    for label in ("fit", "holdout"):
        before, after = report.get(f"sample_latency_error_before_{label}"), report.get(f"sample_latency_error_after_{label}")
        if before and after and after["samples"]:
            table.add_row(
                f"sample latency ({label})", str(after["samples"]), pct(before["median"]), pct(after["median"]), "",
                pct(after["max"]),
            )
    console.print(table)
    console.print("time coefficients: " + ", ".join(f"{k} {v:.3g}" for k, v in calibration.coefficients.items()))
    if calibration.memory_fixed_bytes is not None:
        console.print(f"memory fixed term: {calibration.memory_fixed_bytes:,} bytes")
    if report["skipped"]:
        console.print("skipped calls: " + ", ".join(f"{n} {reason}" for reason, n in report["skipped"].items()))


def run_calibration(
    runs: Sequence[str | Path],
    name: str,
    holdout: float | None = None,
    holdout_from: Sequence[str | Path] = (),
    scenario_dirs: Sequence[Path] = (Path("scenarios"),),
    seed: int = 0,
    host: PluginHost | None = None,
) -> Calibration:
    """Calibrate the simulator's time model from RunResult files (the command's work, callable from scripts).

    The cost models and padding rules come from ``host``'s plugins (a host with the installed plugins when None)."""
    from skyrl_sim.plugin_host.host import PluginHost

    if holdout is not None and holdout_from:
        raise UserError("give --holdout FRACTION or --holdout-from FILES, not both")
    host = host or PluginHost()
    time_model, memory_model = host.cost_models()  # the simulator's own: the ones a calibrated profile corrects
    collected = collect(load_runs(runs), scenario_dirs, host.padding_rule, memory_model)
    if holdout_from:
        fit_samples = collected.samples
        held = collect(load_runs(holdout_from), scenario_dirs, host.padding_rule, memory_model).samples
    elif holdout is not None:
        fit_samples, held = split_holdout(collected.samples, holdout, seed)
    else:
        fit_samples, held = collected.samples, []
    fit_sampling_runs = sampling_runs(load_runs(runs), scenario_dirs)
    held_sampling_runs = sampling_runs(load_runs(holdout_from), scenario_dirs) if holdout_from else []
    bases = sorted({r.variant.endpoint.hardware.profile for r in [*fit_sampling_runs, *held_sampling_runs]})
    calibration = calibrate(fit_samples, held, time_model, name, skipped=collected.skipped, sampling_bases=bases)
    if fit_sampling_runs:
        fitted, sampling_report = fit_sampling(fit_sampling_runs, held_sampling_runs, calibration.base, host)
        calibration.coefficients.update(fitted)
        calibration.report.update(sampling_report)
        calibration.report["coefficients"] = calibration.coefficients
    calibration.report["sources"] = [str(p) for p in runs]
    calibration.report["holdout_sources"] = [str(p) for p in holdout_from]
    calibration.report["holdout_fraction"] = holdout
    return calibration


def sampling_runs(runs: Iterable[tuple[str, RunResult]], scenario_dirs: Sequence[Path]) -> list[SamplingRun]:
    """The runs with completed samples, each with its variant rebuilt from its scenario file."""
    out: list[SamplingRun] = []
    for source, run in runs:
        if sample_latencies(run):
            out.append(SamplingRun(source, run, _scenario_for(run, scenario_dirs).resolve(run.variant)))
    return out


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    runs = [("a measured run", path) for path in [*args.runs, *(args.holdout_from or [])]]
    check_outputs([Output("--out", args.out, stdout=False), Output("--json", args.json)], runs)
    calibration = run_calibration(
        args.runs,
        args.profile,
        args.holdout,
        args.holdout_from or [],
        [Path(d) for d in (args.scenarios or ["scenarios"])],
        args.seed,
    )
    print_calibration(console, calibration)
    calibration.write(args.out)
    console.print(f"wrote {args.out} (use it as hardware.profile: {args.out})")
    if args.json:
        write_atomic(args.json, orjson.dumps(calibration.report, option=orjson.OPT_INDENT_2))
    return 0


def add_parser(sub: Any) -> None:
    """``skyrl-sim calibrate``: registered by the CLI."""
    p = sub.add_parser(
        "calibrate",
        help="fit the time model to measured RunResults and write a hardware profile (error before/after on held-out calls)",
    )
    p.add_argument("runs", nargs="+", metavar="RUNRESULT.json", help="measured runs (e.g. run --backend megatron --json)")
    p.add_argument("--profile", required=True, metavar="NAME", help="name of the calibrated profile")
    p.add_argument("--out", required=True, metavar="PROFILE.yaml", help="where to write the profile")
    p.add_argument("--holdout", type=float, metavar="FRACTION", help="hold out this fraction of the calls (seeded)")
    p.add_argument("--holdout-from", nargs="+", metavar="RUNRESULT.json", help="report on these runs' calls instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the --holdout split")
    p.add_argument("--scenarios", action="append", metavar="DIR", help="where the runs' scenario files are (scenarios/)")
    p.add_argument("--json", metavar="PATH", help="write the calibration report as JSON")
    p.set_defaults(func=cmd_calibrate)

"""Compare two RunResults of one scenario variant call by call: where does backend A (the model) agree with B (the
reference, usually the real hardware), and by how much does it miss?

Both runs come from any two registered backends, or one live backend and a saved RunResult JSON. Calls are paired by
position: the engine rules are shared, so two correct backends make the same calls in the same order, and a pairing
that breaks is itself the first finding (``calls_identical`` false). Per pair: batch composition (kind, request ids),
shapes (rows, padded rows, width, micro-batches), peak memory, OOM verdict and attempted size, duration. Per request:
status and latency. Errors are signed fractions of the reference, ``(a - b) / b``; the summaries use their absolute
values (median, p95, max). Peak memory is compared only where both calls completed (an OOM call's peak is "up to the
failing allocation"; its attempted size is compared instead), and durations only where the OOM verdicts agree; a
call that failed with another error (a crash, not an OOM) is compared for neither.

A scenario's ``tolerances`` name summary metrics: an ``*_error_*`` metric must not exceed its tolerance, an
``*agreement`` metric must reach it, and an ``*_identical`` metric with tolerance 1 must be true.

The terminal tables and plots of a comparison are ``reports.comparison``; ``skyrl-sim compare`` and ``replay`` run the
two sides and print them.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.results.inference import inference_summary
from skyrl_sim.results.outputs import write_atomic
from skyrl_sim.results.result import UNRECORDED, CallRecord, RunResult
from skyrl_sim.results.tenants import tenancy_summary
from skyrl_sim.schema.requests import PASSES
from skyrl_sim.units import pct

SCHEMA = "skyrl-sim/compare/1"
SHAPE_FIELDS: tuple[str, ...] = ("rows", "padded_rows", "width", "microbatches")
STATS: tuple[str, ...] = ("median", "p95", "max")
ERROR_METRICS: tuple[str, ...] = ("peak_memory", "oom_attempted", "duration", "latency")
AGREEMENT_METRICS: tuple[str, ...] = ("oom_agreement", "status_agreement")
IDENTITY_METRICS: tuple[str, ...] = ("calls_identical", "batches_identical", "shapes_identical")


def tolerance_metrics() -> list[str]:
    """Every summary metric a scenario's ``tolerances`` may name."""
    errors = [f"{metric}_error_{stat}" for metric in ERROR_METRICS for stat in STATS]
    return [*errors, *AGREEMENT_METRICS, *IDENTITY_METRICS]


def relative_error(a: float | None, b: float | None) -> float | None:
    """``(a - b) / b``: signed, as a fraction of the reference. None when either is missing; infinite when the
    reference is zero and the model is not (no finite fraction describes that miss)."""
    if a is None or b is None:
        return None
    if b == 0:
        return 0.0 if a == 0 else math.copysign(math.inf, a)
    return (a - b) / b


def error_stats(values: list[float]) -> dict[str, float | None]:
    """Median, p95 (nearest rank) and max of the absolute errors; None each when there is nothing to compare."""
    if not values:
        return dict.fromkeys(STATS)
    data = sorted(abs(v) for v in values)
    return {
        "median": float(np.median(data)),
        "p95": data[max(0, math.ceil(0.95 * len(data)) - 1)],
        "max": data[-1],
    }




def _shape(call: CallRecord | None, other: CallRecord | None = None) -> dict[str, int] | None:
    if call is None:
        return None
    if call.kind not in PASSES:
        return {}
    unknown = {*call.extra.get(UNRECORDED, ()), *(other.extra.get(UNRECORDED, ()) if other is not None else ())}
    return {name: int(getattr(call, name)) for name in SHAPE_FIELDS if name not in unknown}


def _swap(call: CallRecord | None) -> list[str | None] | None:
    swap = call.extra.get("swap") if call is not None else None
    return [swap["saved"], swap["restored"]] if swap else None


@dataclass
class CallDiff:
    """One call of A against the call at the same position in B (either side may be missing)."""

    index: int
    kind_a: str | None
    kind_b: str | None
    request_ids_a: list[int] | None
    request_ids_b: list[int] | None
    batch_equal: bool
    shape_a: dict[str, int] | None
    shape_b: dict[str, int] | None
    shape_equal: bool
    peak_a: int | None = None
    peak_b: int | None = None
    peak_error: float | None = None
    oom_a: bool = False
    oom_b: bool = False
    error_a: bool = False
    error_b: bool = False
    attempted_a: int | None = None
    attempted_b: int | None = None
    attempted_error: float | None = None
    site_agree: bool | None = None  # both ran out of memory: at the same allocation (``same_oom_site``)
    # under pipeline parallelism, both completed: each stage's peak error, first stage first (``stage_peaks``)
    stage_peak_errors: list[float | None] | None = None
    duration_a: float | None = None
    duration_b: float | None = None
    duration_error: float | None = None
    swap_a: list[str | None] | None = None  # [saved, restored] of the adapter swap before the call; None: no swap
    swap_b: list[str | None] | None = None

    @property
    def oom_agree(self) -> bool:
        return self.kind_a is not None and self.kind_b is not None and self.oom_a == self.oom_b

    @classmethod
    def of(cls, index: int, a: CallRecord | None, b: CallRecord | None) -> CallDiff:
        batch_equal = a is not None and b is not None and (a.kind, a.request_ids) == (b.kind, b.request_ids)
        shape_a, shape_b = _shape(a, b), _shape(b, a)
        diff = cls(
            index=index,
            kind_a=a.kind if a else None,
            kind_b=b.kind if b else None,
            request_ids_a=list(a.request_ids) if a else None,
            request_ids_b=list(b.request_ids) if b else None,
            batch_equal=batch_equal,
            shape_a=shape_a,
            shape_b=shape_b,
            shape_equal=batch_equal and shape_a == shape_b,
        )
        diff.swap_a, diff.swap_b = _swap(a), _swap(b)
        if a is None or b is None:
            return diff
        diff.oom_a, diff.oom_b = a.oom is not None, b.oom is not None
        diff.error_a = a.oom is None and bool(a.error)
        diff.error_b = b.oom is None and bool(b.error)
        diff.peak_a, diff.peak_b = a.peak_bytes, b.peak_bytes
        if not (diff.oom_a or diff.oom_b or diff.error_a or diff.error_b):
            diff.peak_error = relative_error(a.peak_bytes, b.peak_bytes)
            diff.stage_peak_errors = _stage_peak_errors(a, b)
        diff.attempted_a = a.oom.attempted_bytes if a.oom is not None else None
        diff.attempted_b = b.oom.attempted_bytes if b.oom is not None else None
        if a.oom is not None and b.oom is not None:
            diff.attempted_error = relative_error(a.oom.attempted_bytes, b.oom.attempted_bytes)
            diff.site_agree = same_oom_site(a.oom.where, b.oom.where)
        diff.duration_a, diff.duration_b = a.duration_s, b.duration_s
        if a.kind == b.kind and diff.oom_agree and not (diff.error_a or diff.error_b):
            diff.duration_error = relative_error(a.duration_s, b.duration_s)
        return diff


def _stage_peak_errors(a: CallRecord, b: CallRecord) -> list[float | None] | None:
    """Each pipeline stage's peak error, when both calls report every stage's peak (``memory.stage_peaks``)."""
    peaks = [(call.memory or {}).get("stage_peaks") for call in (a, b)]
    if peaks[0] is None or peaks[1] is None or len(peaks[0]) != len(peaks[1]):
        return None
    return [relative_error(x, y) for x, y in zip(peaks[0], peaks[1], strict=True)]


LAYER_PREFIX = re.compile(r"^(?:.*\.)?layers\.\d+\.")
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def same_oom_site(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two backends' failing allocations are the same one, by what both name of it: the phase, the stage
    (forward, a recompute inside backward, backward), the decoder layer, the module (a real run's running module
    against the walk's op path: ``decoder.layers.1.mlp.linear_fc1`` is where ``mlp.linear_fc1.lora_scale`` runs) and
    the dtype, and under pipeline parallelism the pipeline stage. A key one side does not report is not compared."""
    for key in ("phase", "stage", "pp_stage"):
        if a.get(key) is not None and b.get(key) is not None and a[key] != b[key]:
            return False
    layers = [w.get("layer") for w in (a, b)]
    if all(isinstance(layer, int) for layer in layers) and layers[0] != layers[1]:
        return False
    dtypes = [DTYPE_NAMES.get(str(w.get("dtype")), w.get("dtype")) for w in (a, b)]
    if None not in dtypes and dtypes[0] != dtypes[1]:
        return False
    walk, real = (a, b) if "module" in b else (b, a)
    if "module" not in real or not isinstance(walk.get("op"), str):
        return True
    module = LAYER_PREFIX.sub("", real.get("module") or "")
    if not isinstance(walk.get("layer"), int):  # the LM head or the embedding: outside the decoder layers
        return not LAYER_PREFIX.match(real.get("module") or "")
    path = walk["op"].rsplit(".", 1)[0] if "." in walk["op"] else walk["op"]
    return bool(module) and (module.startswith(path) or path.startswith(module))


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


@dataclass
class RequestDiff:
    """One request in both runs: its outcome and its latency (submitted to completed)."""

    id: int
    status_a: str | None
    status_b: str | None
    latency_a: float | None
    latency_b: float | None
    latency_error: float | None

    @property
    def status_equal(self) -> bool:
        return self.status_a == self.status_b


def diff_requests(a: RunResult, b: RunResult) -> list[RequestDiff]:
    by_a = {r.id: r for r in a.requests}
    by_b = {r.id: r for r in b.requests}
    out = []
    for request_id in sorted(set(by_a) | set(by_b)):
        ra, rb = by_a.get(request_id), by_b.get(request_id)
        la = ra.latency_s if ra else None
        lb = rb.latency_s if rb else None
        both_done = ra is not None and rb is not None and ra.status == rb.status == "completed"
        out.append(
            RequestDiff(
                id=request_id,
                status_a=ra.status if ra else None,
                status_b=rb.status if rb else None,
                latency_a=la,
                latency_b=lb,
                latency_error=relative_error(la, lb) if both_done else None,
            )
        )
    return out


def summarize(calls: list[CallDiff], requests: list[RequestDiff]) -> dict[str, Any]:
    """The numbers a user reads first; also what tolerances are checked against."""
    paired = [c for c in calls if c.kind_a is not None and c.kind_b is not None]
    summary: dict[str, Any] = {
        "calls_a": sum(c.kind_a is not None for c in calls),
        "calls_b": sum(c.kind_b is not None for c in calls),
        "batches_identical": all(c.batch_equal for c in calls),
        "shapes_identical": all(c.shape_equal for c in calls),
        "calls_identical": all(c.batch_equal and c.shape_equal for c in calls),
        "swaps_identical": all(c.swap_a == c.swap_b for c in calls),
        "oom_calls_a": sum(c.oom_a for c in calls),
        "oom_calls_b": sum(c.oom_b for c in calls),
        "oom_agreement": sum(c.oom_agree for c in paired) / len(calls) if calls else 1.0,
        "oom_site_agreement": _share([c.site_agree for c in calls if c.site_agree is not None]),
        "status_agreement": sum(r.status_equal for r in requests) / len(requests) if requests else 1.0,
    }
    samples = {
        "peak_memory": [c.peak_error for c in calls if c.peak_error is not None],
        "oom_attempted": [c.attempted_error for c in calls if c.attempted_error is not None],
        "duration": [c.duration_error for c in calls if c.duration_error is not None],
        "latency": [r.latency_error for r in requests if r.latency_error is not None],
    }
    if any(c.stage_peak_errors is not None for c in calls):  # pipeline stages: every stage's peak is a sample
        samples["stage_peak_memory"] = [e for c in calls for e in c.stage_peak_errors or [] if e is not None]
    for metric, values in samples.items():
        summary[f"{metric}_compared"] = len(values)
        for stat, value in error_stats(values).items():
            summary[f"{metric}_error_{stat}"] = value
    return summary


@dataclass
class VariantComparison:
    """One variant on two sides: A (the model) and B (the reference)."""

    variant: str
    backend_a: str
    backend_b: str
    calls: list[CallDiff]
    requests: list[RequestDiff]
    summary: dict[str, Any] = field(default_factory=dict)
    tenancy: dict[str, dict[str, Any]] = field(default_factory=dict)  # "a" and "b": each run's summary["tenancy"]
    inference: dict[str, Any] = field(default_factory=dict)  # each side's vLLM numbers (results.inference)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "variant": self.variant,
            "a": self.backend_a,
            "b": self.backend_b,
            "summary": self.summary,
            "tenancy": self.tenancy,
            "calls": [asdict(c) for c in self.calls],
            "requests": [asdict(r) for r in self.requests],
        }
        if self.inference:
            out["inference"] = self.inference
        return out


def compare_runs(
    a: RunResult, b: RunResult, pairs: list[tuple[CallRecord | None, CallRecord | None]] | None = None
) -> VariantComparison:
    """Call-by-call and request-by-request comparison of one variant's two runs; calls are paired by position unless
    ``pairs`` gives the pairing (``call_alignment.align_calls``)."""
    if pairs is None:
        count = max(len(a.calls), len(b.calls))
        pairs = [(a.calls[i] if i < len(a.calls) else None, b.calls[i] if i < len(b.calls) else None) for i in range(count)]
    calls = [CallDiff.of(i, call_a, call_b) for i, (call_a, call_b) in enumerate(pairs)]
    requests = diff_requests(a, b)
    tenancy = {"a": tenancy_summary(a), "b": tenancy_summary(b)}
    comparison = VariantComparison(
        a.variant, a.backend, b.backend, calls, requests, summarize(calls, requests), tenancy
    )
    sides = {"a": inference_summary(a), "b": inference_summary(b)}
    if any(sides.values()):
        comparison.inference = sides
    return comparison


@dataclass
class Comparison:
    """Every compared variant of one scenario, with a summary pooled over all of them."""

    scenario: str
    variants: list[VariantComparison]
    tolerances: dict[str, float] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, Any]:
        calls = [c for v in self.variants for c in v.calls]
        requests = [r for v in self.variants for r in v.requests]
        return summarize(calls, requests)

    def violations(self) -> list[str]:
        return check_tolerances(self.summary, self.tolerances)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "scenario": self.scenario,
            "tolerances": self.tolerances,
            "violations": self.violations(),
            "summary": self.summary,
            "variants": [v.to_dict() for v in self.variants],
        }

    def to_json(self) -> bytes:
        return orjson.dumps(json_finite(self.to_dict()), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)

    def write(self, path: str | Path) -> None:
        write_atomic(path, self.to_json())


def json_finite(value: Any) -> Any:
    """JSON has no infinity: an infinite error (a zero reference) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_finite(v) for v in value]
    return value


def validate_tolerances(tolerances: dict[str, float], source: str) -> None:
    """Every tolerance must name a known metric with a sensible bound, or the check would silently pass."""
    known = tolerance_metrics()
    for key, value in tolerances.items():
        if key not in known:
            raise ScenarioError(source, f"tolerances.{key}", f"unknown metric (known: {', '.join(known)})")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ScenarioError(source, f"tolerances.{key}", "must be a non-negative number")
        if key in AGREEMENT_METRICS and value > 1:
            raise ScenarioError(source, f"tolerances.{key}", "an agreement is a fraction: at most 1")
        if key in IDENTITY_METRICS and value not in (0, 1):
            raise ScenarioError(source, f"tolerances.{key}", "must be 1 (required) or 0 (not checked)")


def check_tolerances(summary: dict[str, Any], tolerances: dict[str, float]) -> list[str]:
    """One line per tolerance the summary does not meet. A metric with nothing to compare (None) is not checked."""
    problems: list[str] = []
    for key, bound in tolerances.items():
        value = summary.get(key)
        if key in IDENTITY_METRICS:
            if bound == 1 and value is not True:
                problems.append(f"{key}: the two runs differ (required identical)")
        elif value is None:
            continue
        elif key in AGREEMENT_METRICS:
            if value < bound:
                problems.append(f"{key} {value:.1%} below the required {bound:.1%}")
        elif not value <= bound:
            problems.append(f"{key} {pct(value)} exceeds the tolerance {bound:.1%}")
    return problems


def parse_tolerance(key: str, text: str) -> float:
    """``--tolerance KEY=FRACTION``: a finite number, or one clear error."""
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"--tolerance {key}={text}: '{text}' is not a number (a fraction, e.g. 0.05)") from None
    if not math.isfinite(value):
        raise UserError(f"--tolerance {key}={text}: must be a finite number")
    return value

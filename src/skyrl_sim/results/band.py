"""The memory error band: how far a simulated peak may be from the real one, and what that means for a verdict.

The simulator's peak for a call is a model. The real backend measured how wrong that model was on the endpoints in
``validation/<endpoint>/`` (``compare.json``: the per-call relative errors of peak memory and of the attempted size
of a failed allocation). The band of an endpoint is the largest of those errors, as a fraction of a call's peak:

- a validated endpoint takes its own measured errors (when it is still of the kind it was measured in: a variant that
  changes its ``tp``, ``ep``, layer spec, dtype or hardware profile is another kind, and borrows);
- any other endpoint takes the errors of the validated endpoint nearest in kind: the same trainer (strategy, LoRA or
  full fine-tuning), the same layer spec, the same
  parameter dtype (``trainer.layer_spec``, ``trainer.params_dtype``) and a model of the same family (dense or
  mixture-of-experts: an MoE model's walk has its own errors, routing among them), then the same hardware profile, then
  the closest tensor-parallel size, then the closest expert-parallel size; the band says which one it borrowed;
- with no such endpoint, a stated default (``DEFAULT_FRACTION``).

A new validation folder is picked up with no code change: every ``validation/*/summary.json`` is read, and its
endpoint's kind comes from the summary (``layer_spec``, ``params_dtype`` when written there) or from the endpoint file
of the same name.

A call that completed is **AT RISK** when its headroom (capacity minus what it held at its peak, allocator pages
included) is smaller than the margin: the band times its peak by default, or a margin given in GiB or in % of the
peak (``check --margin``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.results.result import CallRecord
from skyrl_sim.schema.documents import load_json_file, read_yaml
from skyrl_sim.schema.endpoint import Endpoint, Hardware, Trainer
from skyrl_sim.schema.limits import MAX_DEVICE_MEMORY_GIB
from skyrl_sim.schema.shipped import REPOSITORY
from skyrl_sim.units import GIB

MAX_MARGIN_PERCENT = 1000.0
"""A margin of more than ten times a call's peak cannot be meant."""
DEFAULT_FRACTION = 0.05
"""The band with no validated endpoint of the same kind: 5% of the peak. The seed's reconstruction carries 3-5 GiB at
its tightest points (of about 130 GiB) and the validated CPU endpoints stay under 3%, so 5% is the conservative end."""
Kind = Literal["validated", "nearest", "default"]


@dataclass(frozen=True)
class MemoryBand:
    """The relative error band of one endpoint's simulated peaks, and where it came from."""

    fraction: float
    kind: Kind
    source: str
    """The validated endpoint the band was measured on (its name), or "default"."""
    calls: int = 0
    """How many measured calls the band rests on."""
    path: str | None = None

    def bytes_at(self, peak_bytes: int) -> int:
        """The band around one peak, in bytes."""
        return int(round(self.fraction * peak_bytes))

    def describe(self) -> str:
        """One line: the band and where it comes from."""
        pct = f"±{self.fraction:.1%} of each call's peak"
        if self.kind == "validated":
            return f"memory band {pct}: the largest of {self.calls} per-call errors measured on this endpoint ({self.path})"
        if self.kind == "nearest":
            return (
                f"memory band {pct}: borrowed from the nearest validated endpoint, {self.source} "
                f"(same layer spec and dtype; the largest of {self.calls} per-call errors, {self.path})"
            )
        return f"memory band {pct}: the default (no validated endpoint with this layer spec and dtype)"

    def to_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "kind": self.kind, "source": self.source, "calls": self.calls, "path": self.path}


DEFAULT_BAND = MemoryBand(DEFAULT_FRACTION, "default", "default")


@dataclass(frozen=True)
class Margin:
    """The headroom a completed call needs to count as safe: the band (default), a fixed size, or a % of the peak."""

    band: MemoryBand
    gib: float | None = None
    fraction: float | None = None

    def bytes_at(self, peak_bytes: int) -> int:
        if self.gib is not None:
            return int(self.gib * GIB)
        if self.fraction is not None:
            return int(round(self.fraction * peak_bytes))
        return self.band.bytes_at(peak_bytes)

    def describe(self) -> str:
        if self.gib is not None:
            return f"margin {self.gib:g} GiB"
        if self.fraction is not None:
            return f"margin {self.fraction:.1%} of each call's peak"
        return "margin = the memory band"

    def to_dict(self) -> dict[str, Any]:
        return {"gib": self.gib, "fraction": self.fraction, "band": self.band.to_dict()}


def parse_margin(text: str | None, band: MemoryBand) -> Margin:
    """``--margin`` as ``2.5`` or ``2.5GiB`` (a fixed size, at most a device's largest memory) or ``3%`` (of each
    call's peak, at most ``MAX_MARGIN_PERCENT``); None: the band. NaN and infinities are refused."""
    if text is None:
        return Margin(band)
    raw = text.strip().replace(" ", "")
    try:
        if raw.endswith("%"):
            value = float(raw[:-1])
            if not (math.isfinite(value) and 0 <= value <= MAX_MARGIN_PERCENT):
                raise ValueError
            return Margin(band, fraction=value / 100)
        value = float(raw[:-3] if raw.lower().endswith("gib") else raw)
        if not (math.isfinite(value) and 0 <= value <= MAX_DEVICE_MEMORY_GIB):
            raise ValueError
        return Margin(band, gib=value)
    except ValueError:
        raise UserError(
            f"--margin '{text}': expected a size in GiB (2.5 or 2.5GiB, at most {MAX_DEVICE_MEMORY_GIB:,.0f}) or a "
            f"percentage of the peak (3%, at most {MAX_MARGIN_PERCENT:g}%)"
        ) from None


def held_bytes(call: CallRecord) -> int | None:
    """What a call held at its highest point, as the capacity sees it: the allocator's reserved peak when the memory
    model reports it (allocations are rounded into 2 MiB pages; that, not the tensors' sum, is what runs out), else
    the peak of the tensors."""
    reserved = ((call.memory or {}).get("breakdown") or {}).get("reserved")
    if call.peak_bytes is None:
        return None
    return max(call.peak_bytes, int(reserved or 0))


def headroom_state(call: CallRecord, capacity_bytes: int | None, margin: Margin) -> str | None:
    """``ok`` or ``at_risk`` for a call with a peak (headroom = capacity - held memory, margin around the peak)."""
    held = held_bytes(call)
    if held is None or call.peak_bytes is None or not capacity_bytes:
        return None
    return "at_risk" if capacity_bytes - held < margin.bytes_at(call.peak_bytes) else "ok"


def validation_dirs(scenario_path: str | Path | None = None) -> list[Path]:
    """Where ``validation/`` folders are looked for: beside the scenarios, the working directory, this package's repo."""
    candidates: list[Path] = []
    if scenario_path is not None:
        here = Path(scenario_path).resolve().parent
        candidates += [here.parent / "validation", here / "validation"]
    candidates += [Path.cwd() / "validation", REPOSITORY / "validation"]
    seen: list[Path] = []
    for path in candidates:
        if path.is_dir() and path.resolve() not in seen:
            seen.append(path.resolve())
    return seen


@dataclass(frozen=True)
class Validated:
    """One validated endpoint: its kind and its measured per-call errors."""

    name: str
    layer_spec: str | None
    params_dtype: str | None
    profile: str | None
    tp: int | None
    fraction: float
    calls: int
    path: str
    pp: int | None = None  # pipeline stages (each stage's peak is among the errors)
    moe: bool = False  # a mixture-of-experts model (``model_is_moe``)
    ep: int = 1
    trainer: tuple[str, bool] = ("megatron", False)  # the trainer: its strategy, and whether every weight trains
    attention: tuple[str, ...] = ("full_attention",)  # the model's attention kinds (``model_attention``)


def model_is_moe(model: Any) -> bool:
    """Whether an endpoint's ``model`` is a mixture-of-experts model: a preset that is one, or one whose overrides give
    it ``moe`` dimensions (a model read from a config file counts as dense here)."""
    from skyrl_sim.schema.architecture import PRESETS

    if isinstance(model, dict) and "moe" in model:
        return bool(model["moe"])
    name = model.get("preset") if isinstance(model, dict) else model
    preset = PRESETS.get(name) if isinstance(name, str) else None
    return preset is not None and preset.moe is not None


def model_attention(model: Any) -> tuple[str, ...]:
    """The attention kinds an endpoint's ``model`` computes: its layers' kinds (full, sliding-window, gated-DeltaNet
    linear attention), with full attention read as ``mla`` on a multi-head latent attention model. Each kind is walked
    by its own ops, so a band measured on one family says little of another: a preset's, else full attention (a model
    read from a config file counts as full attention here, as it counts as dense)."""
    from skyrl_sim.schema.architecture import PRESETS

    name = model.get("preset") if isinstance(model, dict) else model
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if preset is None:
        return ("full_attention",)
    kinds = {"mla" if kind == "full_attention" and preset.mla is not None else kind for kind in preset.layer_types}
    return tuple(sorted(kinds))


def measured_errors(folder: Path, summary: dict[str, Any]) -> tuple[float, int]:
    """The largest per-call |error| of peak memory in ``compare.json`` (else the summary's max): what the band is
    applied to, each call's peak. A failed allocation's size error is no bound on a peak (the walk can hold the real
    run's bytes to the byte and still size the failing tensor by the micro-batch's width, not the row's tokens); the
    accuracy table reports it on its own."""
    compare = folder / "compare.json"
    errors: list[float] = []
    if compare.exists():
        data = load_json_file(compare, role="a validation artifact")
        for variant in data.get("variants", []):
            for call in variant.get("calls", []):
                if call.get("peak_error") is not None:
                    errors.append(abs(float(call["peak_error"])))
    if errors:
        return max(errors), len(errors)
    value = summary.get("peak_memory_error_max")
    return (abs(float(value)) if value is not None else DEFAULT_FRACTION), int(summary.get("calls", 0))


def _endpoint_file(name: str, folder: Path) -> dict[str, Any] | None:
    for directory in (folder.parent.parent / "scenarios" / "endpoints", Path.cwd() / "scenarios" / "endpoints"):
        path = directory / f"{name}.yaml"
        if path.exists():
            return read_yaml(path, role="the endpoint file")
    return None


def read_validated(folder: Path) -> Validated | None:
    """One ``validation/<endpoint>/`` folder; None when it has no readable summary or its kind is unknown. Its files
    go through the documents loader; a folder whose files are not what the tool writes (not JSON, not UTF-8, a list
    where an object belongs, a number that is text) is not a validation, whatever put it there (``validation/`` is
    looked for in the working directory too)."""
    try:
        return _read_validated(folder)
    except (ScenarioError, ValidationError, ValueError, TypeError, AttributeError, KeyError):
        return None


def _read_validated(folder: Path) -> Validated | None:
    summary_path = folder / "summary.json"
    if not summary_path.exists():
        return None
    summary = load_json_file(summary_path, role="a validation artifact")
    name = str(summary.get("endpoint") or folder.name)
    raw = _endpoint_file(name, folder) or _endpoint_file(folder.name, folder) or {}
    try:  # the schema's defaults apply where the endpoint file leaves a key out
        trainer = Trainer.model_validate(raw.get("trainer") or {})
        hardware = Hardware.model_validate(raw.get("hardware") or {})
    except ValidationError:
        return None
    known = bool(raw) or "layer_spec" in summary
    if not known:
        return None
    layer_spec = summary.get("layer_spec") or trainer.layer_spec
    dtype = summary.get("params_dtype") or trainer.params_dtype
    profile = summary.get("profile") or hardware.profile
    tp = summary.get("tp") or (raw.get("parallelism") or {}).get("tp")
    pp = summary.get("pp") or (raw.get("parallelism") or {}).get("pp")
    fraction, calls = measured_errors(folder, summary)
    if not math.isfinite(fraction):  # "NaN" as text reads as a float
        return None
    moe, ep = model_is_moe(raw.get("model")), int((raw.get("parallelism") or {}).get("ep") or 1)
    shown = _shown(folder / "compare.json")
    kind = (trainer.strategy, trainer.train_base_weights)
    attention = model_attention(raw.get("model"))
    return Validated(
        name, layer_spec, dtype, profile, tp, fraction, calls, shown, pp=pp, moe=moe, ep=ep, trainer=kind,
        attention=attention,
    )


def trainer_kind(endpoint: Endpoint) -> tuple[str, bool]:
    """The trainer an endpoint runs, as a band matches it: its strategy and whether every weight trains."""
    return (endpoint.trainer.strategy, endpoint.trainer.train_base_weights)


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies under it (shorter in reports), else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def validated_endpoints(scenario_path: str | Path | None = None) -> list[Validated]:
    """Every validated endpoint found (the first folder of a name wins)."""
    out: dict[str, Validated] = {}
    for root in validation_dirs(scenario_path):
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            item = read_validated(folder)
            if item is not None and item.name not in out:
                out[item.name] = item
    return list(out.values())


def same_kind(item: Validated, endpoint: Endpoint) -> bool:
    """Whether a validated endpoint was measured in the kind of this (resolved) endpoint: the same layer spec, dtype,
    model family, hardware profile, tensor-parallel, pipeline-stage and expert-parallel sizes. A variant that sets
    ``parallelism.tp``, ``pp``, ``ep``,
    ``trainer.layer_spec`` or the hardware keeps its endpoint's name but is not the endpoint that was validated: it
    borrows the nearest band."""
    return (
        item.layer_spec == endpoint.trainer.layer_spec
        and item.trainer == trainer_kind(endpoint)
        and item.params_dtype == endpoint.trainer.params_dtype
        and item.moe == model_is_moe(endpoint.model)
        and item.profile in (None, endpoint.hardware.profile)
        and (item.tp or 1) == endpoint.parallelism.tp
        and (item.pp or 1) == endpoint.parallelism.pp
        and item.ep == endpoint.parallelism.ep
    )


def band_for(
    endpoint: Endpoint, scenario_path: str | Path | None = None, known: list[Validated] | None = None
) -> MemoryBand:
    """The band of an endpoint: its own validation, else the nearest validated endpoint of its kind, else the default."""
    validated = validated_endpoints(scenario_path) if known is None else known
    for item in validated:
        if item.name == endpoint.name and same_kind(item, endpoint):
            return MemoryBand(item.fraction, "validated", item.name, item.calls, item.path)
    moe = model_is_moe(endpoint.model)
    same = [
        v
        for v in validated
        if v.layer_spec == endpoint.trainer.layer_spec
        and v.trainer == trainer_kind(endpoint)
        and v.params_dtype == endpoint.trainer.params_dtype
        and v.moe == moe
    ]
    if not same:
        return DEFAULT_BAND

    attention = model_attention(endpoint.model)

    def distance(v: Validated) -> tuple[int, int, int, int, int, float]:
        p = endpoint.parallelism
        return (
            v.attention != attention,  # the same attention family first: its ops are what the band measured
            v.profile != endpoint.hardware.profile,
            abs((v.tp or 1) - p.tp),
            abs((v.pp or 1) - p.pp),
            abs(v.ep - p.ep),
            -v.fraction,
        )

    nearest = min(same, key=distance)
    return MemoryBand(nearest.fraction, "nearest", nearest.name, nearest.calls, nearest.path)

"""Scenario files: an endpoint, a workload, named variants, and what each variant is expected to do.

A scenario is one YAML file. Its endpoint is inline, or a name looked up in ``endpoints/`` beside the file (then in
``./scenarios/endpoints``), or a path. Variants are dotted-key overrides of the endpoint (``engine.cap_aware_padding``)
or of the workload (``workload.clients.0.submit.gap_s``). Every validation error names the file, the key path and the
reason.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from skyrl_sim.architecture import ModelArch, resolve_model
from skyrl_sim.endpoint import Endpoint, Strict
from skyrl_sim.errors import ScenarioError

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's loader when PyYAML has it: imported traces are big

RequestType = Literal[
    "forward_backward",
    "forward",
    "optim_step",
    "sample",
    "save_weights_for_sampler",
    "save_weights",
    "load_weights",
    "create_model",
    "unload_model",
]
BATCHABLE: frozenset[str] = frozenset({"forward_backward", "forward", "sample"})
PASSES: frozenset[str] = frozenset({"forward_backward", "forward"})
BARRIERS: frozenset[str] = frozenset({"optim_step", "load_weights"})


class RequestSpec(Strict):
    """One request, or one request per entry of ``lengths``.

    - ``datums: [L1, L2]``: one request whose datums have these input lengths (tokens).
    - ``lengths: [L1, L2, ...]``: one single-datum request per length, in order (the seed's shape).
    - ``count``: repeat the whole entry.
    """

    type: RequestType
    datums: list[int] | None = None
    lengths: list[int] | None = None
    count: int = Field(1, ge=1)
    loss_fn: Literal["cross_entropy"] = "cross_entropy"
    learning_rate: float = Field(1e-4, gt=0, description="optim_step: Adam learning rate for this step")
    prompt_tokens: int = Field(16, ge=1, description="sample: prompt length")
    max_tokens: int = Field(16, ge=1, description="sample: tokens to generate")
    num_samples: int = Field(1, ge=1)
    checkpoint: str = Field("", description="sample: sampler checkpoint id; save_weights_for_sampler: its name")

    @model_validator(mode="after")
    def _shape(self) -> RequestSpec:
        if self.type in PASSES:
            if (self.datums is None) == (self.lengths is None):
                raise ValueError(f"a {self.type} request needs exactly one of 'datums' or 'lengths'")
            values = self.datums if self.datums is not None else self.lengths
            if not values:
                raise ValueError("needs at least one token length")
            if any(v < 1 for v in values):
                raise ValueError("token lengths must be positive integers")
        elif self.datums is not None or self.lengths is not None:
            raise ValueError(f"a {self.type} request takes no 'datums' or 'lengths'")
        return self


class SampleColumns(Strict):
    """The sample requests of a ``trace``, one entry per request in order."""

    prompt_tokens: list[int] = Field(default_factory=list)
    max_tokens: list[int] = Field(default_factory=list)
    num_samples: list[int] = Field(default_factory=list)
    checkpoint: list[str] = Field(default_factory=list)


class Trace(Strict):
    """A client's requests as columns, the compact form of an imported trace: ``types`` gives every request's type in
    submission order, and each type's own list gives its parameters, one entry per request of that type, in order
    (``forward_backward: [[3693], [100, 200]]`` holds each request's datum lengths)."""

    types: list[RequestType]
    forward_backward: list[list[int]] = Field(default_factory=list)
    forward: list[list[int]] = Field(default_factory=list)
    optim_step: list[float] = Field(default_factory=list, description="each optim_step's learning rate")
    sample: SampleColumns = Field(default_factory=SampleColumns)
    save_weights_for_sampler: list[str] = Field(default_factory=list, description="each save's checkpoint name")
    save_weights: list[str] = Field(default_factory=list)
    load_weights: list[str] = Field(default_factory=list, description="each load's checkpoint name")

    @model_validator(mode="after")
    def _columns(self) -> Trace:
        counts: dict[str, int] = {}
        for kind in self.types:
            counts[kind] = counts.get(kind, 0) + 1
        columns: dict[str, int] = {
            "forward_backward": len(self.forward_backward),
            "forward": len(self.forward),
            "optim_step": len(self.optim_step),
            "save_weights_for_sampler": len(self.save_weights_for_sampler),
            "save_weights": len(self.save_weights),
            "load_weights": len(self.load_weights),
        }
        for name in ("prompt_tokens", "max_tokens", "num_samples", "checkpoint"):
            columns[f"sample.{name}"] = len(getattr(self.sample, name))
        for column, have in columns.items():
            want = counts.get(column.split(".")[0], 0)
            if have != want:
                raise ValueError(f"trace.{column} has {have} entries for {want} '{column.split('.')[0]}' requests")
        for kind in ("forward_backward", "forward"):
            for index, datums in enumerate(getattr(self, kind)):
                if not datums or any(v < 1 for v in datums):
                    raise ValueError(f"trace.{kind}.{index}: needs positive token lengths")
        if any(v <= 0 for v in self.optim_step):
            raise ValueError("trace.optim_step: learning rates must be positive")
        for name in ("prompt_tokens", "max_tokens", "num_samples"):
            if any(v < 1 for v in getattr(self.sample, name)):
                raise ValueError(f"trace.sample.{name}: must be positive integers")
        return self

    def expand(self) -> list[tuple[RequestSpec, tuple[int, ...]]]:
        """(spec, datum lengths) per request in order. The columns are validated as a whole, so the specs are built
        without validating each again (an imported trace has 100,000s of them)."""
        shared: dict[tuple[Any, ...], RequestSpec] = {}  # one spec per distinct set of parameters

        def spec_of(kind: str, **params: Any) -> RequestSpec:
            key = (kind, *(tuple(v) if isinstance(v, list) else v for v in params.values()))
            spec = shared.get(key)
            if spec is None:
                spec = shared[key] = RequestSpec.model_construct(type=kind, **params)
            return spec

        cursor: dict[str, int] = {}
        out: list[tuple[RequestSpec, tuple[int, ...]]] = []
        s = self.sample
        for kind in self.types:
            i = cursor.get(kind, 0)
            cursor[kind] = i + 1
            if kind in PASSES:
                out.append((spec_of(kind, datums=[1]), tuple(getattr(self, kind)[i])))
                continue
            if kind == "optim_step":
                spec = spec_of(kind, learning_rate=self.optim_step[i])
            elif kind == "sample":
                spec = spec_of(
                    kind,
                    prompt_tokens=s.prompt_tokens[i],
                    max_tokens=s.max_tokens[i],
                    num_samples=s.num_samples[i],
                    checkpoint=s.checkpoint[i],
                )
            elif kind in ("save_weights_for_sampler", "save_weights", "load_weights"):
                spec = spec_of(kind, checkpoint=getattr(self, kind)[i])
            else:
                spec = spec_of(kind)
            out.append((spec, ()))
        return out


class Submit(Strict):
    """When a client submits its requests.

    - ``back_to_back``: one after another without waiting, each costing ``gap_s`` (an HTTP round trip of the SDK).
    - ``at_times``: request i at ``times_s[i]`` after the client starts.
    - ``after_previous``: each request after the previous one's result has been retrieved.
    ``warmup`` requests are first submitted one at a time, each awaited, before the pattern starts.
    """

    mode: Literal["back_to_back", "at_times", "after_previous"] = "back_to_back"
    gap_s: float = Field(0.005, ge=0)
    times_s: list[float] | None = None
    warmup: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _times(self) -> Submit:
        if self.mode == "at_times" and not self.times_s:
            raise ValueError("mode at_times needs times_s")
        if self.times_s is not None and any(t < 0 for t in self.times_s):
            raise ValueError("times_s must be non-negative")
        return self


class Blocker(Strict):
    """A leading forward_backward submitted first, alone, to keep the engine busy while the rest pile up."""

    tokens: int = Field(10000, ge=1)
    lead_s: float = Field(0.5, ge=0, description="time between the blocker and the first of the rest")


class Client(Strict):
    name: str = "client"
    model_id: str = "model-0"
    start_s: float = Field(0.0, ge=0)
    submit: Submit = Field(default_factory=Submit)
    blocker: Blocker | None = None
    requests: list[RequestSpec] = Field(default_factory=list)
    trace: Trace | None = Field(None, description="the requests as columns (an imported trace), instead of 'requests'")

    def expanded(self) -> list[tuple[RequestSpec, tuple[int, ...]]]:
        """(spec, datum lengths) per request, in submission order, from ``requests`` or ``trace``."""
        return self.trace.expand() if self.trace is not None else expand_requests(self.requests)

    def request_types(self) -> set[str]:
        return set(self.trace.types) if self.trace is not None else {spec.type for spec in self.requests}

    @model_validator(mode="after")
    def _times_match(self) -> Client:
        if (self.trace is None) == (not self.requests):
            raise ValueError("a client needs exactly one of 'requests' or 'trace'")
        if self.submit.mode == "at_times":
            n = len(self.trace.types) if self.trace is not None else len(expand_requests(self.requests))
            assert self.submit.times_s is not None
            if len(self.submit.times_s) != n:
                raise ValueError(f"submit.times_s has {len(self.submit.times_s)} entries for {n} requests")
        return self


class Workload(Strict):
    clients: list[Client] = Field(..., min_length=1)
    result_timeout_s: float = Field(3600.0, gt=0, description="a client gives up on a result after this long")
    loaded_models: list[str] | None = Field(
        None,
        description="models loaded when the run starts (default: every client's model); the others need a create_model",
    )

    def initial_loaded(self) -> frozenset[str]:
        """The loaded set the engine starts with."""
        if self.loaded_models is not None:
            return frozenset(self.loaded_models)
        return frozenset(client.model_id for client in self.clients)


class Range(Strict):
    min: float | None = None
    max: float | None = None

    def contains(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)


class OomExpectation(Strict):
    """What every OOM of the variant must look like."""

    phase: str | None = None
    op_contains: str | None = None
    attempted_gib: Range | None = None


class Expectations(Strict):
    """What must happen. A variant with no expectations must complete every request."""

    all_completed: bool | None = None
    completed: int | None = None
    failed: int | None = None
    failed_requests: list[int] | None = None
    calls: int | None = None
    oom_calls: int | None = None
    oom: OomExpectation | None = None
    padded_rows: list[int] | None = Field(None, description="padded rows of every call, in order")
    request_metrics: dict[int, dict[str, float]] | None = None
    min_headroom_gib: float | None = None
    makespan_s: Range | None = None


class Variant(Strict):
    description: str = ""
    set: dict[str, Any] = Field(default_factory=dict)
    expect: Expectations | None = None


class Scenario(Strict):
    name: str
    description: str = ""
    endpoint: str | dict[str, Any]
    workload: Workload
    variants: dict[str, Variant] = Field(default_factory=lambda: {"default": Variant()})
    expect: Expectations | None = Field(None, description="expectations of variants that state none")
    tolerances: dict[str, float] = Field(default_factory=dict, description="compare: allowed errors (fractions)")


@dataclass(frozen=True)
class Datum:
    tokens: int


@dataclass(frozen=True)
class Request:
    """One request as the engine sees it. ``id`` is the arrival order at the API (assigned at submission)."""

    id: int
    type: str
    model_id: str
    datums: tuple[int, ...] = ()
    learning_rate: float = 1e-4
    prompt_tokens: int = 0
    max_tokens: int = 0
    num_samples: int = 1
    checkpoint: str = ""
    client: str = ""

    @property
    def tokens(self) -> int:
        return sum(self.datums)


@dataclass(frozen=True)
class PlannedRequest:
    """A request before submission: its client, its position, and what it asks."""

    client_index: int
    index: int
    spec: RequestSpec
    datums: tuple[int, ...]
    is_blocker: bool = False


def expand_requests(specs: list[RequestSpec]) -> list[tuple[RequestSpec, tuple[int, ...]]]:
    """Each spec entry expanded to (spec, datum lengths) per request, in submission order."""
    out: list[tuple[RequestSpec, tuple[int, ...]]] = []
    for spec in specs:
        for _ in range(spec.count):
            if spec.lengths is not None:
                out.extend((spec, (length,)) for length in spec.lengths)
            else:
                out.append((spec, tuple(spec.datums or ())))
    return out


@dataclass
class ResolvedVariant:
    """A scenario with one variant applied: what a backend runs."""

    scenario: Scenario
    variant_name: str
    endpoint: Endpoint
    model: ModelArch
    workload: Workload
    expectations: Expectations
    source: str

    def client_requests(self, client_index: int) -> list[PlannedRequest]:
        """Requests of one client in submission order, the blocker first."""
        client = self.workload.clients[client_index]
        planned: list[PlannedRequest] = []
        if client.blocker is not None:
            spec = RequestSpec(type="forward_backward", lengths=[client.blocker.tokens])
            planned.append(PlannedRequest(client_index, 0, spec, (client.blocker.tokens,), is_blocker=True))
        for spec, datums in client.expanded():
            planned.append(PlannedRequest(client_index, len(planned), spec, datums))
        return planned

    def workload_totals(self) -> dict[str, int]:
        """Requests and tokens of the workload (blockers excluded), and the repro's unpadded slot count."""
        requests = 0
        tokens = 0
        longest = 0
        for index in range(len(self.workload.clients)):
            for planned in self.client_requests(index):
                if planned.is_blocker or planned.spec.type not in PASSES:
                    continue
                requests += 1
                tokens += sum(planned.datums)
                longest = max([longest, *planned.datums])
        return {"requests": requests, "tokens": tokens, "unpadded_slots": requests * longest}


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not str(p).startswith("function-after") and p not in ("str", "dict[str,any]")]
    return ".".join(parts)


def validation_error(path: str, prefix: str, exc: ValidationError) -> ScenarioError:
    first = exc.errors()[0]
    key = _format_loc(first["loc"])
    if prefix:
        key = f"{prefix}.{key}" if key else prefix
    reason = first["msg"]
    if first["type"] == "extra_forbidden":
        reason = "unknown key"
    elif first["type"] == "missing":
        reason = "required key is missing"
    more = len(exc.errors()) - 1
    if more:
        reason += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ScenarioError(path, key, reason)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping from a file, or a ScenarioError that says what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(str(path), "", f"cannot read file: {exc.strerror}") from None
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ScenarioError(str(path), "", f"malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ScenarioError(str(path), "", "the file must hold a YAML mapping")
    return data


def endpoint_search_dirs(scenario_path: Path) -> list[Path]:
    """Where endpoint names are looked up, first match wins."""
    dirs = [scenario_path.parent / "endpoints", scenario_path.parent.parent / "endpoints", Path("scenarios/endpoints")]
    seen: list[Path] = []
    for d in dirs:
        if d not in seen:
            seen.append(d)
    return seen


def load_endpoint(ref: str | dict[str, Any], scenario_path: Path) -> tuple[dict[str, Any], str]:
    """The endpoint mapping and the file it came from (the scenario itself when inline)."""
    if isinstance(ref, dict):
        return ref, str(scenario_path)
    candidate = Path(ref)
    if candidate.suffix in (".yaml", ".yml") or "/" in ref:
        path = candidate if candidate.is_absolute() else (Path.cwd() / candidate)
        if not path.exists():
            path = scenario_path.parent / candidate
        if not path.exists():
            raise ScenarioError(str(scenario_path), "endpoint", f"endpoint file '{ref}' does not exist")
        return read_yaml(path), str(path)
    for directory in endpoint_search_dirs(scenario_path):
        path = directory / f"{ref}.yaml"
        if path.exists():
            return read_yaml(path), str(path)
    known = sorted({p.stem for d in endpoint_search_dirs(scenario_path) if d.is_dir() for p in d.glob("*.yaml")})
    raise ScenarioError(str(scenario_path), "endpoint", f"no endpoint named '{ref}' (known: {', '.join(known) or 'none'})")


def parse_value(text: str) -> Any:
    """A --set value as YAML would read it (numbers, booleans, null, lists)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    """Set ``a.b.c`` (list indices allowed) in a nested mapping; the key path must already make sense."""
    parts = dotted.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ScenarioError(origin, dotted, f"'{part}' is not an index of the list at {'.'.join(parts[:i])}")
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ScenarioError(origin, dotted, f"'{'.'.join(parts[: i + 1])}' is a value, not a section")
        else:
            raise ScenarioError(origin, dotted, "cannot descend into a value")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ScenarioError(origin, dotted, f"'{last}' is not an index of the list")
        node[int(last)] = value
    else:
        node[last] = value


def _split_override(dotted: str) -> tuple[str, str]:
    """Which document an override addresses: the workload, or (by default) the endpoint."""
    if dotted.startswith("workload."):
        return "workload", dotted[len("workload.") :]
    if dotted.startswith("endpoint."):
        return "endpoint", dotted[len("endpoint.") :]
    return "endpoint", dotted


class ScenarioFile:
    """A loaded, validated scenario file; ``resolve`` applies a variant and command-line overrides."""

    def __init__(self, path: Path, endpoint_override: str | None = None, raw: dict[str, Any] | None = None) -> None:
        """``raw``: the file's mapping when the caller already has it (an imported trace: no YAML round trip);
        ``path`` then only locates endpoint names and names the source in errors."""
        self.path = path
        self.raw = raw if raw is not None else read_yaml(path)
        try:
            self.scenario = Scenario.model_validate(self.raw)
        except ValidationError as exc:
            raise validation_error(str(path), "", exc) from None
        ref: str | dict[str, Any] = endpoint_override or self.scenario.endpoint
        self.endpoint_raw, self.endpoint_source = load_endpoint(ref, path)
        self.endpoint_prefix = "" if self.endpoint_source != str(path) else "endpoint"
        for name in self.scenario.variants:
            self.resolve(name)  # every variant must be valid up front

    @property
    def variant_names(self) -> list[str]:
        return list(self.scenario.variants)

    def resolve(self, variant: str, sets: dict[str, Any] | None = None) -> ResolvedVariant:
        if variant not in self.scenario.variants:
            raise ScenarioError(
                str(self.path), "variants", f"no variant '{variant}' (known: {', '.join(self.scenario.variants)})"
            )
        spec = self.scenario.variants[variant]
        endpoint_data = copy.deepcopy(self.endpoint_raw)
        workload_data = copy.deepcopy(self.raw["workload"])
        overrides = [(k, v, f"{self.path} (variant {variant})") for k, v in spec.set.items()]
        overrides += [(k, v, "--set") for k, v in (sets or {}).items()]
        for dotted, value, origin in overrides:
            target, key = _split_override(dotted)
            apply_override(endpoint_data if target == "endpoint" else workload_data, key, value, origin)
        try:
            endpoint = Endpoint.model_validate(endpoint_data)
        except ValidationError as exc:
            raise validation_error(self.endpoint_source, self.endpoint_prefix, exc) from None
        try:
            workload = Workload.model_validate(workload_data)
        except ValidationError as exc:
            raise validation_error(str(self.path), "workload", exc) from None
        try:
            model = resolve_model(endpoint.model, Path(self.endpoint_source).parent)
        except ValueError as exc:
            raise ScenarioError(self.endpoint_source, "model", str(exc)) from None
        expectations = spec.expect or self.scenario.expect or Expectations(all_completed=True)
        return ResolvedVariant(
            scenario=self.scenario,
            variant_name=variant,
            endpoint=endpoint,
            model=model,
            workload=workload,
            expectations=expectations,
            source=str(self.path),
        )


def load_scenario(path: str | Path, endpoint: str | None = None) -> ScenarioFile:
    return ScenarioFile(Path(path), endpoint)

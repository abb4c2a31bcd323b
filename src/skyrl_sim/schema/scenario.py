"""Scenario files: an endpoint, a workload, named variants, and what each variant is expected to do.

A scenario is one YAML file. Its endpoint is inline, or a name looked up in ``endpoints/`` beside the file (then in
``./scenarios/endpoints``), or a path. Variants are dotted-key overrides of the endpoint (``engine.cap_aware_padding``)
or of the workload (``workload.clients.0.submit.gap_s``). Every validation error names the file, the key path and the
reason.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import Field, ValidationError, model_validator

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.schema.architecture import ModelArch, resolve_model
from skyrl_sim.schema.documents import parse_yaml, read_yaml, validation_error
from skyrl_sim.schema.endpoint import Endpoint, Strict
from skyrl_sim.schema.limits import (
    MAX_INDEX_DIGITS,
    MAX_LEARNING_RATE,
    MAX_REQUESTS,
    MAX_SAMPLES,
    MAX_SCENARIO_BYTES,
    MAX_TIME_S,
    MAX_TOKENS,
)
from skyrl_sim.schema.shipped import endpoints_dir, shipped_scenarios
from skyrl_sim.schema.tinker_sdk import SDK_CALLS, chunk_datums, submission_order

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
    "forward_backward_custom",
    "compute_logprobs",
]
BATCHABLE: frozenset[str] = frozenset({"forward_backward", "forward", "sample"})
PASSES: frozenset[str] = frozenset({"forward_backward", "forward"})
BARRIERS: frozenset[str] = frozenset({"optim_step", "load_weights"})
DATUM_TYPES: frozenset[str] = PASSES | {"forward_backward_custom"}
"""Request types whose entry gives datum lengths (the SDK's custom forward_backward is a forward and a pass)."""
LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "dppo"]
"""The Tinker API's policy losses (``skyrl/tinker/types.py``; which ones a SkyRL revision takes is its
``SkyrlRules.loss_fns``)."""


class LossInputs(Strict):
    """What an RL loss reads per target token besides the target itself (Tinker's ``loss_fn_inputs``): the sampler's
    log-probs and the advantages. Each is one value for every token, or a list cycled over each datum's tokens."""

    logprobs: float | list[float] = Field(..., description="the sampling log-probs of the targets (at most 0)")
    advantages: float | list[float] = Field(..., description="the advantage of each target token")

    @model_validator(mode="after")
    def _values(self) -> LossInputs:
        for name in ("logprobs", "advantages"):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [value]
            if not values:
                raise ValueError(f"{name} needs at least one value")
            if len(values) > MAX_TOKENS:
                raise ValueError(f"{name} has more than {MAX_TOKENS:,} values")
            if any(abs(v) > 1e6 for v in values):
                raise ValueError(f"{name} must be finite numbers of magnitude at most 1e6")
        logprobs = self.logprobs if isinstance(self.logprobs, list) else [self.logprobs]
        if any(v > 0 for v in logprobs):
            raise ValueError("logprobs are log-probabilities: each must be at most 0")
        return self

    def per_token(self, name: str, tokens: int) -> list[float]:
        """``name``'s values for a datum of ``tokens`` targets (a scalar repeated, a list cycled)."""
        value = getattr(self, name)
        values = value if isinstance(value, list) else [value]
        return [values[i % len(values)] for i in range(tokens)]


class RecordedRoutes(Strict):
    """The experts the sampler routed each datum's tokens to, recorded for routed-expert replay (R3): synthetic ids
    (``engine.recorded_routes``), seeded, covering a captured prefix of each row. vLLM records a route only for the
    tokens it evaluated: the last sampled token has no later decode step, and an EOS SkyRL appends was never seen, so
    the last ``uncaptured`` tokens of each row carry none (SkyRL's ``router_padding_mask`` marks them)."""

    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of the synthetic routes")
    uncaptured: int = Field(1, ge=0, le=MAX_TOKENS, description="tokens at the end of each row without a route")


class LoraConfig(Strict):
    """A ``create_model``'s LoRA config (Tinker's ``LoraConfig``): SkyRL compares ``(int(rank), int(alpha))`` with the
    first model's."""

    rank: int = Field(..., ge=1, le=MAX_TOKENS)
    alpha: float = Field(..., gt=0, le=1e6)


class RequestSpec(Strict):
    """One request, or one request per entry of ``lengths``.

    - ``datums: [L1, L2]``: one request whose datums have these input lengths (tokens).
    - ``lengths: [L1, L2, ...]``: one single-datum request per length, in order (the seed's shape).
    - ``count``: repeat the whole entry.
    """

    type: RequestType
    datums: list[int] | None = Field(None, max_length=MAX_REQUESTS)
    lengths: list[int] | None = Field(None, max_length=MAX_REQUESTS)
    count: int = Field(1, ge=1, le=MAX_REQUESTS)
    loss_fn: LossFn = Field("cross_entropy", description="forward_backward: the Tinker loss")
    loss_fn_config: dict[str, float] | None = Field(
        None, description="forward_backward: the loss's settings (ppo: clip_low_threshold, clip_high_threshold)"
    )
    loss_fn_inputs: LossInputs | None = Field(None, description="forward_backward with an RL loss: its inputs")
    learning_rate: float = Field(
        1e-4, gt=0, le=MAX_LEARNING_RATE, description="optim_step: Adam learning rate for this step"
    )
    prompt_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="sample: prompt length")
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="sample: tokens to generate")
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    checkpoint: str = Field("", description="sample: sampler checkpoint id; save_weights_for_sampler: its name")
    prompt_logprobs: bool = Field(False, description="sample: also compute the log-prob of every prompt token")
    lora_config: LoraConfig | None = Field(
        None, description="create_model: the model's LoRA rank and alpha; null: the endpoint's lora"
    )
    routed_experts: RecordedRoutes | None = Field(
        None, description="forward_backward / forward on an MoE model: the sampler's recorded routes, for R3"
    )

    @model_validator(mode="after")
    def _shape(self) -> RequestSpec:
        if self.lora_config is not None and self.type != "create_model":
            raise ValueError(f"a {self.type} request takes no 'lora_config' (only create_model does)")
        if self.routed_experts is not None and self.type not in PASSES:
            raise ValueError(f"a {self.type} request takes no 'routed_experts' (only forward_backward and forward do)")
        if self.type in DATUM_TYPES:
            if (self.datums is None) == (self.lengths is None):
                raise ValueError(f"a {self.type} request needs exactly one of 'datums' or 'lengths'")
            values = self.datums if self.datums is not None else self.lengths
            if not values:
                raise ValueError("needs at least one token length")
            if any(v < 1 for v in values):
                raise ValueError("token lengths must be positive integers")
            if any(v > MAX_TOKENS for v in values):
                raise ValueError(f"token lengths must be at most {MAX_TOKENS:,} (past every model's context length)")
        elif self.datums is not None or self.lengths is not None:
            raise ValueError(f"a {self.type} request takes no 'datums' or 'lengths'")
        self._loss()
        return self

    def _loss(self) -> None:
        """An RL loss needs its inputs; cross-entropy and the other request types take none (Tinker's contract)."""
        rl = self.loss_fn != "cross_entropy"
        if rl and self.type == "forward_backward_custom":
            raise ValueError(
                "forward_backward_custom runs the custom loss on the client: the SDK sends cross_entropy (its surrogate); "
                "leave loss_fn unset"
            )
        if rl and self.type != "forward_backward":
            raise ValueError(f"loss_fn {self.loss_fn}: only a forward_backward takes a loss")
        if self.prompt_logprobs and self.type != "sample":
            raise ValueError("prompt_logprobs is a sample's setting (compute_logprobs sets it itself)")
        if rl and self.loss_fn_inputs is None:
            raise ValueError(
                f"loss_fn {self.loss_fn} needs loss_fn_inputs: {{logprobs: ..., advantages: ...}} (the sampling "
                "log-probs and the advantages of the target tokens)"
            )
        if not rl and self.loss_fn_inputs is not None:
            raise ValueError("loss_fn_inputs are the inputs of an RL loss; cross_entropy takes none (every target weighs 1)")
        if not rl and self.loss_fn_config:
            raise ValueError("loss_fn_config: cross_entropy has no settings")
        for key, value in (self.loss_fn_config or {}).items():
            if abs(value) > 1e6:
                raise ValueError(f"loss_fn_config.{key} must be a finite number of magnitude at most 1e6")


Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
"""A datum's, prompt's or generation's token count: what ``RequestSpec`` allows, per entry of a ``trace`` column."""
LearningRate = Annotated[float, Field(gt=0, le=MAX_LEARNING_RATE)]
SampleCount = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]


class SampleColumns(Strict):
    """The sample requests of a ``trace``, one entry per request in order."""

    prompt_tokens: list[Tokens] = Field(default_factory=list)
    max_tokens: list[Tokens] = Field(default_factory=list)
    num_samples: list[SampleCount] = Field(default_factory=list)
    checkpoint: list[str] = Field(default_factory=list)


class Trace(Strict):
    """A client's requests as columns, the compact form of an imported trace: ``types`` gives every request's type in
    submission order, and each type's own list gives its parameters, one entry per request of that type, in order
    (``forward_backward: [[3693], [100, 200]]`` holds each request's datum lengths)."""

    types: list[RequestType]
    forward_backward: list[list[Tokens]] = Field(default_factory=list)
    forward: list[list[Tokens]] = Field(default_factory=list)
    optim_step: list[LearningRate] = Field(default_factory=list, description="each optim_step's learning rate")
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
    gap_s: float = Field(0.005, ge=0, le=MAX_TIME_S)
    times_s: list[float] | None = Field(None, max_length=MAX_REQUESTS)
    warmup: int = Field(0, ge=0, le=MAX_REQUESTS)

    @model_validator(mode="after")
    def _times(self) -> Submit:
        if self.mode == "at_times" and not self.times_s:
            raise ValueError("mode at_times needs times_s")
        if self.times_s is not None and any(not 0 <= t <= MAX_TIME_S for t in self.times_s):
            raise ValueError(f"times_s must be between 0 and {MAX_TIME_S:,.0f} s ({MAX_TIME_S / 86_400:g} days)")
        return self


class Blocker(Strict):
    """A leading forward_backward submitted first, alone, to keep the engine busy while the rest pile up."""

    tokens: int = Field(10000, ge=1, le=MAX_TOKENS)
    lead_s: float = Field(0.5, ge=0, le=MAX_TIME_S, description="time between the blocker and the first of the rest")


class Client(Strict):
    name: str = "client"
    model_id: str = "model-0"
    sdk: Literal["none", "tinker-0.25"] = Field(
        "none",
        description="how requests reach the API: none (each entry one API request, as written) or tinker-0.25 (each "
        "entry one call of the Tinker SDK 0.25, shaped as it sends it: schema/tinker_sdk.py)",
    )
    start_s: float = Field(0.0, ge=0, le=MAX_TIME_S)
    submit: Submit = Field(default_factory=Submit)
    blocker: Blocker | None = None
    requests: list[RequestSpec] = Field(default_factory=list)
    trace: Trace | None = Field(None, description="the requests as columns (an imported trace), instead of 'requests'")

    def expanded(self) -> list[tuple[RequestSpec, tuple[int, ...]]]:
        """(spec, datum lengths) per request, in submission order, from ``requests`` or ``trace``."""
        return self.trace.expand() if self.trace is not None else expand_requests(self.requests)

    def request_types(self) -> set[str]:
        return set(self.trace.types) if self.trace is not None else {spec.type for spec in self.requests}

    def request_count(self) -> int:
        """How many requests the client submits (without expanding them: the limit is checked first)."""
        return len(self.trace.types) if self.trace is not None else expanded_count(self.requests)

    @model_validator(mode="after")
    def _times_match(self) -> Client:
        if (self.trace is None) == (not self.requests):
            raise ValueError("a client needs exactly one of 'requests' or 'trace'")
        sdk_only = sorted(self.request_types() & set(SDK_CALLS))
        if sdk_only and self.sdk == "none":
            raise ValueError(f"{sdk_only[0]} is a call of the Tinker SDK, not of the API: set the client's sdk: tinker-0.25")
        total = self.request_count()
        if total > MAX_REQUESTS:
            raise ValueError(f"expands to {total:,} requests, over the limit of {MAX_REQUESTS:,}")
        if self.submit.mode == "at_times":
            n = len(self.trace.types) if self.trace is not None else len(expand_requests(self.requests))
            assert self.submit.times_s is not None
            if len(self.submit.times_s) != n:
                raise ValueError(f"submit.times_s has {len(self.submit.times_s)} entries for {n} requests")
        return self


class Workload(Strict):
    clients: list[Client] = Field(..., min_length=1, max_length=MAX_REQUESTS)
    result_timeout_s: float = Field(
        3600.0, gt=0, le=MAX_TIME_S, description="a client gives up on a result after this long"
    )
    loaded_models: list[str] | None = Field(
        None,
        description="models loaded when the run starts (default: every client's model); the others need a create_model",
    )

    def initial_loaded(self) -> frozenset[str]:
        """The loaded set the engine starts with."""
        return frozenset(self.initial_loaded_ids())

    def initial_loaded_ids(self) -> list[str]:
        """The models loaded when the run starts, in the order they were created (``loaded_models``' order, else the
        clients'): the first one's adapter is live."""
        ids = self.loaded_models if self.loaded_models is not None else [client.model_id for client in self.clients]
        return list(dict.fromkeys(ids))

    @model_validator(mode="after")
    def _bounded(self) -> Workload:
        total = sum(client.request_count() for client in self.clients)
        if total > MAX_REQUESTS:
            raise ValueError(f"the clients expand to {total:,} requests, over the limit of {MAX_REQUESTS:,}")
        checkpoints = {"save_weights", "save_weights_for_sampler", "load_weights"}
        specs = {
            index: client.requests if client.trace is None else [spec for spec, _ in client.expanded()]
            for index, client in enumerate(self.clients)
            if client.request_types() & checkpoints
        }
        saved: dict[str, set[str]] = {}
        for index, listed in specs.items():
            for spec in listed:
                if spec.type in ("save_weights", "save_weights_for_sampler"):
                    saved.setdefault(self.clients[index].model_id, set()).add(spec.checkpoint)
        for index, listed in specs.items():
            client = self.clients[index]
            where = "requests" if client.trace is None else "trace"
            for position, spec in enumerate(listed):
                if spec.type == "load_weights" and spec.checkpoint not in saved.get(client.model_id, set()):
                    raise ValueError(
                        f"clients.{index}.{where}.{position}: load_weights of checkpoint '{spec.checkpoint}', "
                        f"which no save_weights of model '{client.model_id}' writes"
                    )
        return self


class Range(Strict):
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is larger than max {self.max}: no value can meet it")
        return self

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
    completed: int | None = Field(None, ge=0)
    failed: int | None = Field(None, ge=0)
    failed_requests: list[int] | None = None
    calls: int | None = Field(None, ge=0)
    oom_calls: int | None = Field(None, ge=0)
    oom: OomExpectation | None = None
    padded_rows: list[int] | None = Field(None, description="padded rows of every call, in order")
    request_metrics: dict[int, dict[str, float]] | None = None
    min_headroom_gib: float | None = None
    makespan_s: Range | None = None
    swaps: int | None = Field(None, ge=0, description="adapter swaps of the run (SkyRL's ensure_active_adapter)")
    host_memory_peak_gib: Range | None = Field(None, description="the adapter slots' peak host memory per worker")


class Variant(Strict):
    description: str = ""
    set: dict[str, Any] = Field(default_factory=dict)
    expect: Expectations | None = None


class Scenario(Strict):
    name: str
    description: str = ""
    endpoint: str | dict[str, Any]
    workload: Workload
    variants: dict[str, Variant] = Field(default_factory=lambda: {"default": Variant()}, min_length=1)
    expect: Expectations | None = Field(None, description="expectations of variants that state none")
    tolerances: dict[str, float] = Field(default_factory=dict, description="compare: allowed errors (fractions)")


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
    loss_fn: str = "cross_entropy"
    loss_fn_config: tuple[tuple[str, float], ...] = ()
    loss_fn_inputs: LossInputs | None = field(default=None, hash=False, compare=False)
    prompt_logprobs: bool = False
    lora: tuple[int, float] | None = None  # create_model: (rank, alpha) it names; None: the endpoint's lora
    routed_experts: RecordedRoutes | None = field(default=None, hash=False, compare=False)  # a pass's R3 routes

    @property
    def tokens(self) -> int:
        return sum(self.datums)


class PlannedRequest(NamedTuple):
    """A request before submission: its client, its position, and what it asks. (Immutable, and a tuple: a run makes
    one per request, at a fraction of a frozen dataclass's cost.)"""

    client_index: int
    index: int
    spec: RequestSpec
    datums: tuple[int, ...]
    is_blocker: bool = False
    call: int = -1  # the client's call (scenario entry) it belongs to: the SDK turns one call into several requests
    phase: int = 0  # within its call: a later phase is submitted once every request of the earlier ones is done


def sdk_requests(spec: RequestSpec, datums: tuple[int, ...]) -> list[tuple[int, RequestSpec, tuple[int, ...]]]:
    """The API requests the Tinker SDK sends for one call (``tinker_sdk``), each with its phase in the call: a pass
    in its chunks (first chunk last); ``forward_backward_custom`` a chunked forward, then (phase 1, once the forward's
    results are in) a chunked forward_backward; ``compute_logprobs`` a one-token sample with prompt log-probs."""
    if spec.type in PASSES:
        return [(0, spec, chunk) for chunk in submission_order(chunk_datums(datums, spec.loss_fn))]
    if spec.type == "forward_backward_custom":
        chunks = submission_order(chunk_datums(datums, "cross_entropy"))
        forward = spec.model_copy(update={"type": "forward"})
        backward = spec.model_copy(update={"type": "forward_backward"})
        return [(0, forward, chunk) for chunk in chunks] + [(1, backward, chunk) for chunk in chunks]
    if spec.type == "compute_logprobs":
        sample = spec.model_copy(update={"type": "sample", "max_tokens": 1, "num_samples": 1, "prompt_logprobs": True})
        return [(0, sample, ())]
    return [(0, spec, datums)]


def expanded_count(specs: list[RequestSpec]) -> int:
    """How many requests ``expand_requests`` makes of these entries, without making them (the limit is checked first)."""
    return sum(spec.count * (len(spec.lengths) if spec.lengths is not None else 1) for spec in specs)


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
    endpoint_source: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)  # the command line's --set, applied on top of the variant

    def client_requests(self, client_index: int) -> list[PlannedRequest]:
        """Requests of one client in submission order, the blocker first."""
        client = self.workload.clients[client_index]
        planned: list[PlannedRequest] = []
        if client.blocker is not None:
            spec = RequestSpec(type="forward_backward", lengths=[client.blocker.tokens])
            planned.append(PlannedRequest(client_index, 0, spec, (client.blocker.tokens,), is_blocker=True))
        if client.sdk == "none":
            for spec, datums in client.expanded():
                planned.append(PlannedRequest(client_index, len(planned), spec, datums))
            return planned
        for call, (spec, datums) in enumerate(client.expanded()):
            for phase, sent, chunk in sdk_requests(spec, datums):
                planned.append(PlannedRequest(client_index, len(planned), sent, chunk, call=call, phase=phase))
        return planned

    def request_count(self) -> int:
        """Requests the workload submits, blockers included (request ids run from 1 to this)."""
        count = 0
        for index, client in enumerate(self.workload.clients):
            if client.sdk == "none":  # trace clients too, without expanding them
                count += client.request_count() + (client.blocker is not None)
            else:  # the SDK's shaping decides how many requests a call becomes
                count += len(self.client_requests(index))
        return count

    def workload_totals(self) -> dict[str, int]:
        """Requests and tokens of the workload (blockers excluded), and the repro's unpadded slot count."""
        requests = 0
        tokens = 0
        longest = 0
        for client in self.workload.clients:
            for spec, datums in client.expanded():
                if spec.type not in DATUM_TYPES:
                    continue
                requests += 1
                tokens += sum(datums)
                if datums:
                    longest = max(longest, max(datums))
        return {"requests": requests, "tokens": tokens, "unpadded_slots": requests * longest}


def endpoint_search_dirs(scenario_path: Path) -> list[Path]:
    """Where endpoint names are looked up, first match wins: beside the scenario, then ./scenarios/endpoints, then the
    endpoints shipped with skyrl-sim."""
    dirs = [scenario_path.parent / "endpoints", scenario_path.parent.parent / "endpoints", Path("scenarios/endpoints")]
    shipped = endpoints_dir()
    if shipped is not None:
        dirs.append(shipped)
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


def parse_value(text: str, origin: str = "--set") -> Any:
    """A --set value as YAML would read it (numbers, booleans, null, lists); a plain string if it is no YAML value.
    Text that is not valid Unicode (a lone surrogate from undecodable bytes) and YAML that is well-formed but refused
    (a duplicate key, nesting or a number past the limits) are errors. An empty value is an error too: YAML would
    read it as null, which for a limit means "unlimited"; write ``null``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{origin}: the value is not valid UTF-8 text") from None
    if not text.strip():
        raise UserError(f"{origin}: the value is empty (write null to unset it)")
    try:
        return parse_yaml(text, origin)
    except ScenarioError as exc:
        if not exc.reason.startswith("malformed YAML"):
            raise UserError(f"{origin}: {exc.reason}") from None
        return text


REPLACED_WHOLE: frozenset[str] = frozenset({"model"})
"""Endpoint keys whose mapping is replaced, not merged: ``model`` names one model (``{config: path}`` or ``{preset:
name, ...}``), and a new reference must not keep keys of the old one."""


def merged_section(current: Any, value: Any) -> Any:
    """``value`` merged into ``current`` when both are mappings (recursively: a key ``value`` does not name keeps its
    value), else ``value``. Lists and values replace. Copies only the mappings it changes."""
    if not isinstance(current, dict) or not isinstance(value, dict):
        return value
    out = dict(current)
    for key, item in value.items():
        out[key] = merged_section(current.get(key), item)
    return out


def apply_override(data: dict[str, Any], dotted: str, value: Any, origin: str, merge: bool = True) -> dict[str, Any]:
    """``data`` with ``a.b.c`` (list indices allowed) set to ``value``; the key path must already make sense.

    A mapping set on a section is merged into it (``--set 'trainer={micro_train_batch_size_per_gpu: 8}'`` changes that
    key and keeps the others, as ``--set trainer.micro_train_batch_size_per_gpu=8`` does) unless ``merge`` is false;
    an empty mapping would change nothing and is refused, since it reads as "reset this section".

    Copy on write: the result is a new mapping that copies only the mappings and lists on the key's path and shares
    the rest with ``data``, which is left as it was, so resolving a variant of a 10^6-request workload (or each point
    of a sweep over it) does not copy the workload."""
    if value == {}:
        raise ScenarioError(
            origin, dotted, "an empty mapping changes nothing (a section is merged, not reset): set the keys to change"
        )
    parts = dotted.split(".")
    if not all(parts):
        raise ScenarioError(origin, dotted, "an empty key in the dotted path")
    root = dict(data)
    node: Any = root
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not is_index(part) or int(part) >= len(node):
                raise ScenarioError(origin, dotted, f"'{part}' is not an index of the list at {'.'.join(parts[:i])}")
            key: int | str = int(part)
            child = node[key]
        else:
            key = part
            child = node.get(part, {})
        if not isinstance(child, (dict, list)):
            raise ScenarioError(origin, dotted, f"'{'.'.join(parts[: i + 1])}' is a value, not a section")
        node[key] = child = dict(child) if isinstance(child, dict) else list(child)
        node = child
    last = parts[-1]
    if isinstance(node, list):
        if not is_index(last) or int(last) >= len(node):
            raise ScenarioError(origin, dotted, f"'{last}' is not an index of the list")
        node[int(last)] = merged_section(node[int(last)], value) if merge else value
    else:
        node[last] = merged_section(node.get(last), value) if merge else value
    return root


def is_index(part: str) -> bool:
    """A list index in a key path: ASCII digits only (``str.isdigit`` takes ``²``, which ``int`` refuses), bounded."""
    return part.isascii() and part.isdigit() and len(part) <= MAX_INDEX_DIGITS


def _split_override(dotted: str) -> tuple[str, str]:
    """Which document an override addresses: the workload, or (by default) the endpoint."""
    if dotted.startswith("workload."):
        return "workload", dotted[len("workload.") :]
    if dotted.startswith("endpoint."):
        return "endpoint", dotted[len("endpoint.") :]
    return "endpoint", dotted


def _blame(
    error: ScenarioError, overrides: list[tuple[str, Any, str]], target: str, prefix: str
) -> ScenarioError:
    """An error whose key an override set is reported against that override's origin (the variant or ``--set``)."""
    key = error.key[len(prefix) + 1 :] if prefix and error.key.startswith(prefix + ".") else error.key
    for dotted, _, origin in reversed(overrides):
        override_target, override_key = _split_override(dotted)
        if override_target == target and (key == override_key or key.startswith(override_key + ".")):
            return ScenarioError(origin, dotted, error.reason)
    return error


class ScenarioFile:
    """A loaded, validated scenario file; ``resolve`` applies a variant and command-line overrides."""

    def __init__(self, path: Path, endpoint_override: str | None = None, raw: dict[str, Any] | None = None) -> None:
        """``raw``: the file's mapping when the caller already has it (an imported trace: no YAML round trip);
        ``path`` then only locates endpoint names and names the source in errors."""
        self.path = path
        self.raw = raw if raw is not None else read_yaml(path, MAX_SCENARIO_BYTES)
        try:
            self.scenario = Scenario.model_validate(self.raw)
        except ValidationError as exc:
            raise validation_error(str(path), "", exc) from None
        ref: str | dict[str, Any] = endpoint_override or self.scenario.endpoint
        self.endpoint_raw, self.endpoint_source = load_endpoint(ref, path)
        self.endpoint_prefix = "" if self.endpoint_source != str(path) else "endpoint"
        self._validate_endpoint(copy.deepcopy(self.endpoint_raw), [])  # the base itself, even if variants override it
        for name in self.scenario.variants:
            self.resolve(name)  # every variant must be valid up front

    @property
    def variant_names(self) -> list[str]:
        return list(self.scenario.variants)

    def _validate_endpoint(self, data: dict[str, Any], overrides: list[tuple[str, Any, str]]) -> tuple[Endpoint, ModelArch]:
        """The endpoint and its model, checked together; errors name the file (or override) and the key."""
        try:
            endpoint = Endpoint.model_validate(data)
        except ValidationError as exc:
            error = validation_error(self.endpoint_source, self.endpoint_prefix, exc)
            raise _blame(error, overrides, "endpoint", self.endpoint_prefix) from None
        try:
            model = resolve_model(endpoint.model, Path(self.endpoint_source).parent)
        except ValueError as exc:
            error = ScenarioError(self.endpoint_source, self._key("model"), str(exc))
            raise _blame(error, overrides, "endpoint", self.endpoint_prefix) from None
        try:
            check_fit(endpoint, model)
        except ScenarioError as exc:
            error = ScenarioError(self.endpoint_source, self._key(exc.key), exc.reason)
            raise _blame(error, overrides, "endpoint", self.endpoint_prefix) from None
        return endpoint, model

    def _key(self, key: str) -> str:
        return f"{self.endpoint_prefix}.{key}" if self.endpoint_prefix else key

    def resolve(
        self, variant: str, sets: dict[str, Any] | None = None, origins: dict[str, str] | None = None
    ) -> ResolvedVariant:
        """The variant with its ``set`` and then ``sets`` applied; ``origins`` names where a ``sets`` key came from
        (``--grid``; default ``--set``) so an error is reported against it."""
        if variant not in self.scenario.variants:
            raise ScenarioError(
                str(self.path), "variants", f"no variant '{variant}' (known: {', '.join(self.scenario.variants)})"
            )
        spec = self.scenario.variants[variant]
        endpoint_data, workload_data = self.endpoint_raw, self.raw["workload"]  # overrides copy what they change
        overrides = [(k, v, f"{self.path} (variant {variant}, set)") for k, v in spec.set.items()]
        overrides += [(k, v, (origins or {}).get(k, "--set")) for k, v in (sets or {}).items()]
        for dotted, value, origin in overrides:
            target, key = _split_override(dotted)
            if target == "endpoint":
                endpoint_data = apply_override(endpoint_data, key, value, origin, merge=key not in REPLACED_WHOLE)
            else:
                workload_data = apply_override(workload_data, key, value, origin)
        endpoint, model = self._validate_endpoint(endpoint_data, overrides)
        try:
            workload = Workload.model_validate(workload_data)
        except ValidationError as exc:
            raise _blame(validation_error(str(self.path), "workload", exc), overrides, "workload", "workload") from None
        if model.moe is None:
            for c, client in enumerate(workload.clients):
                for r, request in enumerate(client.requests):
                    if request.routed_experts is not None:
                        where = f"workload.clients[{c}].requests[{r}].routed_experts"
                        reason = f"model '{model.name}' has no mixture-of-experts layers: there are no routes to replay"
                        raise ScenarioError(str(self.path), where, reason)
        expectations = spec.expect or self.scenario.expect or Expectations(all_completed=True)
        resolved = ResolvedVariant(
            scenario=self.scenario,
            variant_name=variant,
            endpoint=endpoint,
            model=model,
            workload=workload,
            expectations=expectations,
            source=str(self.path),
            endpoint_source=self.endpoint_source,
            overrides=dict(sets or {}),
        )
        where = f"variants.{variant}.expect" if spec.expect else "expect"
        check_expectations(expectations, resolved.request_count(), str(self.path), where)
        return resolved


def check_fit(endpoint: Endpoint, model: ModelArch) -> None:
    """What the endpoint and its model must agree on: TP splits the attention heads and the KV groups evenly, the
    pipeline stages have layers, the hardware profile exists. Raises ScenarioError with the endpoint key (the caller
    adds the file)."""
    if endpoint.parallelism.pp > model.num_layers:
        reason = f"pipeline parallel size {endpoint.parallelism.pp} exceeds the model's {model.num_layers} layers"
        raise ScenarioError("", "parallelism.pp", reason)
    tp = endpoint.parallelism.tp
    for what, count in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", model.num_kv_heads)):
        if count % tp:
            raise ScenarioError("", "parallelism.tp", f"tp {tp} does not divide the model's {what} ({count})")
    from skyrl_sim.schema.hardware import load_profile  # hardware reads its files through this module

    try:
        load_profile(endpoint.hardware.profile)
    except UserError as exc:
        raise ScenarioError("", "hardware.profile", str(exc)) from None


def check_expectations(expect: Expectations, requests: int, path: str, where: str) -> None:
    """Expectations no run of this workload can meet are bad input (exit 2), not a failed check (exit 1)."""
    for key in ("completed", "failed"):
        value = getattr(expect, key)
        if value is not None and value > requests:
            raise ScenarioError(path, f"{where}.{key}", f"{value} is more than the workload's {requests} requests")
    if expect.completed is not None and expect.failed is not None and expect.completed + expect.failed > requests:
        raise ScenarioError(
            path, where, f"completed {expect.completed} + failed {expect.failed} is more than {requests} requests"
        )
    if expect.calls is not None and expect.oom_calls is not None and expect.oom_calls > expect.calls:
        raise ScenarioError(path, f"{where}.oom_calls", f"{expect.oom_calls} is more than calls {expect.calls}")
    if expect.all_completed and (expect.failed or expect.failed_requests or expect.completed not in (None, requests)):
        raise ScenarioError(path, f"{where}.all_completed", "contradicts the expected failures or completed count")
    known = range(1, requests + 1)
    for request_id in [*(expect.failed_requests or []), *(expect.request_metrics or {})]:
        if request_id not in known:
            raise ScenarioError(
                path, where, f"request {request_id} does not exist (request ids run from 1 to {requests})"
            )


def load_scenario(path: str | Path, endpoint: str | None = None) -> ScenarioFile:
    """A scenario file; a path that does not exist but names a shipped scenario (``queue_drain_17``,
    ``scenarios/queue_drain_17.yaml``) is that shipped file, so the commands of the README and the manual (docs/) run
    after a plain install."""
    return ScenarioFile(resolve_scenario_path(Path(path)), endpoint)


def resolve_scenario_path(path: Path) -> Path:
    if path.exists() or str(path.parent) not in (".", "scenarios"):
        return path
    shipped = shipped_scenarios().get(path.stem if path.suffix in (".yaml", ".yml") else path.name)
    return shipped if shipped is not None else path

"""The requests a scenario's client sends, as the user writes them: one entry per request (``RequestSpec``), or the
columns of an imported trace (``Trace``), each expanded to (spec, datum lengths) per request in submission order.

The request types are the Tinker API's (and two calls of the Tinker SDK, shaped in ``tinker_sdk``); RL losses take
their inputs here. What the engine makes of a submitted request is ``skyrl_sim.engine.request.Request``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from skyrl_sim.schema.limits import MAX_LEARNING_RATE, MAX_REQUESTS, MAX_SAMPLES, MAX_TOKENS
from skyrl_sim.schema.strict import Strict

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
PASSES: frozenset[str] = frozenset({"forward_backward", "forward"})
"""The forward passes: request types whose datums the trainer runs (each a batchable pass)."""
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
    expert_weights: list[float] | None = Field(
        None,
        max_length=MAX_TOKENS,
        description="how likely a router picks each expert (one positive weight per expert; null: uniformly): "
        "skewed routes, as trained routers record them",
    )

    @field_validator("expert_weights")
    @classmethod
    def _positive(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and (not value or any(not w > 0 or w == float("inf") for w in value)):
            raise ValueError("expert_weights must be positive, finite numbers, one per expert")
        return value


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

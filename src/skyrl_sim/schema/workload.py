"""A scenario's workload: its clients, when each submits its requests, and what the engine starts with loaded.

A client's requests are ``requests`` entries or an imported ``trace`` (``schema.requests``); ``sdk: tinker-0.25``
shapes each entry as the Tinker SDK sends it (``schema.tinker_sdk``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from skyrl_sim.schema.limits import MAX_NAME_CHARS, MAX_REQUESTS, MAX_TIME_S, MAX_TOKENS
from skyrl_sim.schema.requests import RequestSpec, Trace, expand_requests, expanded_count
from skyrl_sim.schema.strict import Strict
from skyrl_sim.schema.tinker_sdk import SDK_CALLS


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
    model_id: str = Field(
        "model-0",
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="the model (LoRA adapter) the client trains and samples: SkyRL keys its queue, adapters and "
        "checkpoints by it",
    )

    @field_validator("model_id")
    @classmethod
    def _model_id_is_a_name(cls, value: str) -> str:
        """A model id names the client's adapter in every table and log: visible text, no control characters (an
        empty id is what an imported row without a model has, and the import names it)."""
        if not value.strip():
            raise ValueError("a model id must be visible text, not only white space")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("a model id must hold no control characters (a newline, a tab, NUL)")
        return value

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

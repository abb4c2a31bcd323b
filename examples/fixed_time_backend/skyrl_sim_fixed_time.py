"""An example third-party backend: SkyRL's engine on simulated time, with every call taking a fixed time.

It shows the whole of what a backend is, through the public API only (``skyrl_sim.api``; no import of a built-in
plugin): a clock, a call executor, and the schema of its options. The host's run driver (``drive``) runs the scenario's
clients, the futures table and SkyRL's engine loop on them, so the calls this backend sees are the ones the simulator
and the real backend see; it decides only what a call costs.

* ``skyrl_sim_backends``: a ``BackendSpec`` naming the backend;
* ``skyrl_sim_backend_options``: the pydantic schema of its ``--option`` keys (the host refuses any other key, and
  ``skyrl-sim plugins`` lists these with their defaults);
* ``FixedTimeExecutor``: every batch call and every single request takes ``seconds``; nothing runs out of memory.

Install it (``pip install examples/fixed_time_backend``) and it appears in ``skyrl-sim plugins`` and runs with
``skyrl-sim run SCENARIO --backend fixed-time --option seconds=2``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from skyrl_sim.api import (
    BackendOptions,
    BackendSpec,
    BatchCall,
    CallOutcome,
    CallShape,
    Request,
    ResolvedVariant,
    RunContext,
    RunResult,
    SimpyClock,
    drive,
    hookimpl,
    pass_metrics,
)

NAME = "fixed-time"


class FixedTimeOptions(BaseModel):
    """``--option`` keys of ``--backend fixed-time``."""

    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(1.0, ge=0, description="what every call costs")


class FixedTimeExecutor:
    """A call executor in which every call costs ``seconds`` of simulated time and always succeeds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def batch(self, call: BatchCall, shape: CallShape | None) -> CallOutcome:
        metrics = pass_metrics(call.requests) if shape is not None else {}
        return CallOutcome(duration_s=self.seconds, wait_s=self.seconds, metrics=metrics)

    def single(self, request: Request) -> CallOutcome:
        return CallOutcome(duration_s=self.seconds, wait_s=self.seconds)


class FixedTimeBackend:
    name = NAME

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        options = context.typed_options(FixedTimeOptions, self.name)
        result = context.new_result(variant, self.name)
        return drive(variant, context, result, FixedTimeExecutor(options.seconds), SimpyClock())


@hookimpl
def skyrl_sim_backends() -> list[BackendSpec]:
    return [BackendSpec(NAME, FixedTimeBackend, "every call takes --option seconds=N (an example plugin)")]


@hookimpl
def skyrl_sim_backend_options() -> list[BackendOptions]:
    return [BackendOptions(NAME, FixedTimeOptions)]

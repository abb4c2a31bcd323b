"""An example third-party backend: the simulated engine with every call taking a fixed time.

It shows the whole plugin surface a backend needs, through the public API only (``skyrl_sim.hookspecs`` and the
cost-model interfaces; no import of a built-in plugin):

* ``skyrl_sim_backends``: a ``BackendSpec`` naming the backend;
* ``skyrl_sim_backend_options``: the pydantic schema of its ``--option`` keys (the host refuses any other key, and
  ``skyrl-sim plugins`` lists these with their defaults);
* a class with ``run(variant, context) -> RunResult``, which here asks the host for the simulator with its own time
  model (``context.simulator(time=...)``) instead of driving an engine itself.

Install it (``pip install examples/fixed_time_backend``) and it appears in ``skyrl-sim plugins`` and runs with
``skyrl-sim run SCENARIO --backend fixed-time --option seconds=2``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from skyrl_sim.architecture import ModelArch
from skyrl_sim.endpoint import Endpoint
from skyrl_sim.hookspecs import BackendOptions, BackendSpec, RunContext, hookimpl
from skyrl_sim.result import RunResult
from skyrl_sim.scenario import Request, ResolvedVariant
from skyrl_sim.shapes import CallShape

NAME = "fixed-time"


class FixedTimeOptions(BaseModel):
    """``--option`` keys of ``--backend fixed-time``."""

    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(1.0, ge=0, description="what every call costs")


class FixedTime:
    """A time model in which every call costs ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        return self.seconds

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        return self.seconds

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        return self.seconds


class FixedTimeBackend:
    name = NAME

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        options = context.typed_options(FixedTimeOptions, self.name)
        result = context.simulator(time=FixedTime(options.seconds)).run(variant, context)
        result.backend = self.name
        return result


@hookimpl
def skyrl_sim_backends() -> list[BackendSpec]:
    return [BackendSpec(NAME, FixedTimeBackend, "every call takes --option seconds=N (an example plugin)")]


@hookimpl
def skyrl_sim_backend_options() -> list[BackendOptions]:
    return [BackendOptions(NAME, FixedTimeOptions)]

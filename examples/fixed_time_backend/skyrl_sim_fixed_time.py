"""An example third-party backend: the simulator with every call taking a fixed time.

It shows the whole plugin surface a backend needs: one ``@hookimpl`` returning a ``BackendSpec``, and a class with
``run(variant, context) -> RunResult``. Install it (``pip install examples/fixed_time_backend``) and it appears in
``skyrl-sim plugins`` and runs with ``skyrl-sim run SCENARIO --backend fixed-time``.
"""

from __future__ import annotations

from skyrl_sim_plugins.sim.backend import SimBackend

from skyrl_sim.architecture import ModelArch
from skyrl_sim.endpoint import Endpoint
from skyrl_sim.hookspecs import BackendSpec, RunContext, hookimpl
from skyrl_sim.result import RunResult
from skyrl_sim.scenario import Request, ResolvedVariant
from skyrl_sim.shapes import CallShape


class FixedTime:
    """A time model in which every call costs ``seconds`` (from ``--option seconds=N``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        return self.seconds

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        return self.seconds

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        return self.seconds


class FixedTimeBackend:
    name = "fixed-time"

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        seconds = float(context.options.get("seconds", "1.0"))
        result = SimBackend(time=FixedTime(seconds)).run(variant, context)
        result.backend = self.name
        return result


@hookimpl
def skyrl_sim_backends() -> list[BackendSpec]:
    return [BackendSpec("fixed-time", FixedTimeBackend, "every call takes --option seconds=N (an example plugin)")]

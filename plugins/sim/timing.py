"""Time model of backend calls (placeholder constants until the roofline model lands)."""

from __future__ import annotations

from skyrl_sim.architecture import ModelArch
from skyrl_sim.endpoint import Endpoint
from skyrl_sim.scenario import Request
from skyrl_sim.shapes import CallShape


class ConstantTimeModel:
    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        return 1.0

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        return 1.0

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        return 0.05


def default_time_model() -> ConstantTimeModel:
    return ConstantTimeModel()

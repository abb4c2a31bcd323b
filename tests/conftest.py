"""Shared fixtures: paths to the shipped scenarios and a plugin host."""

from __future__ import annotations

import pytest

from project_paths import SCENARIOS
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario


@pytest.fixture(scope="session")
def host() -> PluginHost:
    return PluginHost()


@pytest.fixture(scope="session")
def run_sim(host: PluginHost):
    """Run one variant of a shipped scenario on the simulator."""

    def run(name: str, variant: str, endpoint: str | None = None, sets: dict | None = None):
        scenario = load_scenario(SCENARIOS / name, endpoint)
        return host.run(scenario.resolve(variant, sets), "sim")

    return run

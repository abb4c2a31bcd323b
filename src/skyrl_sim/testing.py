"""Helpers for plugin authors' tests: a host with your plugin registered, and a one-call scenario run.

In a plugin's ``conftest.py``::

    from skyrl_sim.testing import plugin_host  # noqa: F401  (a pytest fixture)

    def test_my_backend(plugin_host):
        host = plugin_host(my_plugin_module)
        result = run_scenario(host, "scenarios/queue_drain_17.yaml", "cap-aware", backend="my-backend")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario


def host_with(*plugins: object, load_entry_points: bool = True) -> PluginHost:
    """A plugin host with the given plugin objects or modules registered (names from their ``__name__``)."""
    host = PluginHost(load_entry_points=load_entry_points)
    for plugin in plugins:
        host.register(plugin, getattr(plugin, "__name__", type(plugin).__name__), "registered by a test")
    return host


def run_scenario(
    host: PluginHost, path: str | Path, variant: str | None = None, backend: str = "sim", endpoint: str | None = None
) -> RunResult:
    """Run one variant (the first when none is named) of a scenario file on a backend."""
    scenario = load_scenario(path, endpoint)
    return host.run(scenario.resolve(variant or scenario.variant_names[0]), backend)


@pytest.fixture
def plugin_host() -> Callable[..., PluginHost]:
    """Make a host with your plugins registered: ``plugin_host(my_plugin)``."""
    return host_with

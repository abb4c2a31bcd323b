"""Registers ``--backend tinker`` (a live Tinker-API service) and its options."""

from __future__ import annotations

from skyrl_sim.api import BackendOptions, BackendSpec, hookimpl
from skyrl_sim_plugins.tinker_client.options import HONOURS, TinkerOptions


def _make() -> object:
    from skyrl_sim_plugins.tinker_client.backend import TinkerBackend

    return TinkerBackend()


@hookimpl
def skyrl_sim_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="tinker",
            factory=_make,  # type: ignore[arg-type]
            description="a live Tinker-API service (SkyRL) driven with the tinker SDK; calls parsed from its log",
        )
    ]


@hookimpl
def skyrl_sim_backend_options() -> list[BackendOptions]:
    return [BackendOptions("tinker", TinkerOptions, honours=HONOURS)]

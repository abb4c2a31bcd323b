"""Registers ``--backend tinker`` (a live Tinker-API service) and the ``jax`` padding rule (SkyRL's JAX backend)."""

from __future__ import annotations

from skyrl_sim_plugins.tinker_client.padding import JAX

from skyrl_sim.hookspecs import BackendSpec, hookimpl
from skyrl_sim.shapes import PaddingRule


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
def skyrl_sim_padding_rules() -> list[PaddingRule]:
    return [JAX]

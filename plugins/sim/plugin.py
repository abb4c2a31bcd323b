"""Registers the simulator backend (``--backend sim``)."""

from __future__ import annotations

from skyrl_sim.hookspecs import BackendSpec, hookimpl


def _make() -> object:
    from skyrl_sim_plugins.sim.backend import SimBackend

    return SimBackend()


@hookimpl
def skyrl_sim_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="sim",
            factory=_make,  # type: ignore[arg-type]
            description="simpy simulator: SkyRL's queue, scheduling, padding, memory and time",
        )
    ]

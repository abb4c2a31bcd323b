"""Registers the simulator backend (``--backend sim``) and its one option (``spool``: how a run holds its request
records), and the simulator's services: its cost models (for ``calibrate``) and a simulator with a plugin's own cost
models (for backends that reuse it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyrl_sim.api import BackendOptions, BackendSpec, hookimpl

if TYPE_CHECKING:
    from skyrl_sim.api import Backend, MemoryModel, TimeModel


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


@hookimpl
def skyrl_sim_backend_options() -> list[BackendOptions]:
    from skyrl_sim_plugins.sim.options import SimOptions

    return [BackendOptions("sim", SimOptions)]  # every modelling setting is an endpoint key


@hookimpl
def skyrl_sim_cost_models() -> tuple[TimeModel, MemoryModel]:
    from skyrl_sim_plugins.sim.bound.memory import default_memory_model
    from skyrl_sim_plugins.sim.bound.timing import default_time_model

    return default_time_model(), default_memory_model()


@hookimpl
def skyrl_sim_simulator(time: TimeModel | None, memory: MemoryModel | None) -> Backend:
    from skyrl_sim_plugins.sim.backend import SimBackend

    return SimBackend(memory=memory, time=time)

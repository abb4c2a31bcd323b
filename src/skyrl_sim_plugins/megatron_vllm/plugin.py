"""Registers the real backend (``--backend megatron``)."""

from __future__ import annotations

from skyrl_sim.api import BackendOptions, BackendSpec, hookimpl
from skyrl_sim_plugins.megatron_vllm.options import MegatronOptions


def _make() -> object:
    from skyrl_sim_plugins.megatron_vllm.backend import MegatronBackend

    return MegatronBackend()


@hookimpl
def skyrl_sim_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="megatron",
            factory=_make,  # type: ignore[arg-type]
            description="real backend: megatron-core LoRA training + vLLM sampling (CPU tiny scale, CUDA full scale)",
        )
    ]


@hookimpl
def skyrl_sim_backend_options() -> list[BackendOptions]:
    return [BackendOptions("megatron", MegatronOptions)]

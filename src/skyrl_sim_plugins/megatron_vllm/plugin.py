"""Registers the real backend (``--backend megatron``)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from skyrl_sim.plugin_host.hookspecs import BackendOptions, BackendSpec, hookimpl


class MegatronOptions(BaseModel):
    """``--option`` keys of ``--backend megatron``."""

    model_config = ConfigDict(extra="forbid")

    run_dir: str | None = Field(None, description="keep checkpoints and the worker log here (default: a scratch dir)")
    seed: int = Field(0, description="weights and synthetic token ids")
    startup_timeout_s: float = Field(300.0, gt=0, description="workers' start-up limit")
    call_timeout_s: float = Field(1800.0, gt=0, description="one call's limit")
    threads: int = Field(0, ge=0, description="torch threads per rank (0: cores / ranks)")
    kill_rank_before_call: str | None = Field(
        None, description="CALL:RANK, fault injection for tests: SIGKILL that rank before the CALL-th call"
    )

    @field_validator("kill_rank_before_call")
    @classmethod
    def _call_rank(cls, value: str | None) -> str | None:
        if value and not re.fullmatch(r"\d+:\d+", value):
            raise ValueError("expected CALL:RANK, e.g. 2:0")
        return value

    @property
    def kill(self) -> tuple[int, int] | None:
        """``kill_rank_before_call`` as (call, rank)."""
        if not self.kill_rank_before_call:
            return None
        call, rank = self.kill_rank_before_call.split(":")
        return int(call), int(rank)


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

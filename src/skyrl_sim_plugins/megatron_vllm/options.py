"""The ``--option`` schema of ``--backend megatron``: read by the plugin (which declares it) and the backend (which
uses it), without either importing the other."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class MegatronOptions(BaseModel):
    """``--option`` keys of ``--backend megatron``."""

    model_config = ConfigDict(extra="forbid")

    run_dir: str | None = Field(None, description="keep checkpoints and the worker log here (default: a scratch dir)")
    seed: int = Field(0, description="weights and synthetic token ids")
    startup_timeout_s: float = Field(300.0, gt=0, description="workers' start-up limit")
    call_timeout_s: float = Field(1800.0, gt=0, description="one call's limit")
    threads: int = Field(0, ge=0, description="torch threads per rank (0: cores / ranks)")
    clock: Literal["wall", "measured"] = Field(
        "wall",
        description="wall: clients and the engine in real time (threads); measured: in simulated time, each call "
        "really run and its measured duration advancing the clock, so batching never depends on the machine's load",
    )
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

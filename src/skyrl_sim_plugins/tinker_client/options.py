"""The ``--option`` schema of ``--backend tinker``: read by the plugin (which declares it) and the backend (which uses
it), without either importing the other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from skyrl_sim.api import MAX_TIME_S


class TinkerOptions(BaseModel):
    """``--option`` keys of ``--backend tinker``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    base_url: str | None = Field(None, description="the service's URL (default: the endpoint's base_url)")
    log: str | None = Field(None, description="the service's log, parsed into calls (default: endpoint service_log)")
    api_key: str | None = Field(None, description="default $TINKER_API_KEY or a tml- key")
    base_model: str | None = Field(None, description="default: the service's first supported model")
    timeout_s: float | None = Field(
        None, ge=0.001, le=MAX_TIME_S, description="per request, submission included (default: workload result_timeout_s)"
    )
    setup_timeout_s: float = Field(60.0, ge=0.001, le=MAX_TIME_S, description="session and model creation")
    http_timeout_s: float = Field(30.0, ge=0.001, le=MAX_TIME_S, description="one HTTP call")
    retries: int = Field(2, ge=0, le=100, description="for connection errors and 5xx")
    token_id_max: int = Field(256, ge=2, le=2**31 - 1, description="synthetic token ids are below this")


# What a client of a live service can apply: its own workload, where the service is, and the adapter it creates.
# The engine, trainer, parallelism and hardware are the service's own configuration, out of a client's reach.
HONOURS = ("name", "description", "workload", "base_url", "service_log", "lora.rank")

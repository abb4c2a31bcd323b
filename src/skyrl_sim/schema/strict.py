"""The base of every schema model (``skyrl_sim.schema.endpoint`` re-exports it as before)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for every schema model: unknown keys are errors, values are validated on assignment too, types are strict
    (``true`` is no integer, ``"1"`` no number) and numbers are finite (``.inf`` and ``.nan`` are refused)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

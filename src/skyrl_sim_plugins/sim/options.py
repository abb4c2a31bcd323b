"""The ``--option`` schema of ``--backend sim``: read by the plugin (which declares it) and the backend (which uses
it), without either importing the other.

Every modelling setting is an endpoint key; the one option is how the run holds its request records, a memory choice
that never changes a result (tests/test_record_spool.py holds both ways to the same bytes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SPOOL_ABOVE_REQUESTS = 50_000
"""A simulated run of more requests than this writes each finished request's record to a temporary file
(``results.record_spool.RecordSpool``) instead of holding it: 49 bytes a request stay in memory instead of a
few hundred (a 10^6-request run held 3.33 GiB). Below it, records stay in memory, where reading them is cheapest."""


class SimOptions(BaseModel):
    """``--option`` keys of ``--backend sim``."""

    model_config = ConfigDict(extra="forbid")

    spool: Literal["auto", "always", "never"] = Field(
        "auto",
        description=f"request records to a temporary file: auto (above {SPOOL_ABOVE_REQUESTS:,} requests), always, never",
    )

    def spools(self, request_count: int) -> bool:
        """Whether a run of ``request_count`` requests spools its records."""
        if self.spool == "auto":
            return request_count > SPOOL_ABOVE_REQUESTS
        return self.spool == "always"

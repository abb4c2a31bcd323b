"""A scenario that reproduces a public report (``scenarios/public/``): which report, what it states, what the file
assumes where the report is silent, and which of its variants the model does not yet reproduce.

The gallery is the product's proof against the world: each file's variants carry the report's own outcome as their
``expect:`` (the failing setting fails where the report says, its fix completes), so ``check`` on the file says whether
the model reproduces the report. A variant the model gets wrong stays in the file as a *known miss*, with the reason;
it is never made to pass with a constant (``tests/test_public_gallery.py`` fails when a known miss starts passing, so
the mark cannot go stale).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from skyrl_sim.schema.strict import Strict


class PublicCase(Strict):
    """The ``public:`` block of a gallery scenario."""

    report: str = Field(min_length=1, description="the report, as its tracker names it: 'SkyRL PR #2051'")
    url: str = Field(description="where the report is public (https://...)")
    states: list[str] = Field(min_length=1, description="the setup and outcome the report states, one fact a line")
    assumed: list[str] = Field(default_factory=list, description="what the report leaves out, and what the file assumes")
    known_misses: dict[str, str] = Field(
        default_factory=dict, description="variant -> why the model does not reproduce the report's outcome for it"
    )

    @field_validator("url")
    @classmethod
    def _public_address(cls, value: str) -> str:
        if not value.startswith("https://"):
            raise ValueError(f"'{value}' is not a public https:// address")
        return value

    @field_validator("known_misses")
    @classmethod
    def _reasons(cls, value: dict[str, str]) -> dict[str, str]:
        for variant, reason in value.items():
            if not reason.strip():
                raise ValueError(f"known miss '{variant}' gives no reason: say why the model misses it")
        return value

    def miss_reason(self, variant: str) -> str | None:
        """Why ``variant`` is a known miss, or None when the model is meant to reproduce it."""
        return self.known_misses.get(variant)

"""What a scenario file says, validated: ``Scenario`` (its name, endpoint, workload, variants, expectations,
tolerances and public report) and ``Variant`` (a named variant's overrides and expectations).

The file's schema by itself, below both the file's resolution (``scenario.ScenarioFile``) and what a resolution
gives a backend (``variant.ResolvedVariant``, which keeps the ``Scenario`` it came from).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from skyrl_sim.schema.expect import Expectations
from skyrl_sim.schema.public_case import PublicCase
from skyrl_sim.schema.strict import Strict
from skyrl_sim.schema.workload import Workload


class Variant(Strict):
    description: str = ""
    set: dict[str, Any] = Field(default_factory=dict)
    expect: Expectations | None = None


class Scenario(Strict):
    name: str
    description: str = ""
    endpoint: str | dict[str, Any]
    workload: Workload
    variants: dict[str, Variant] = Field(default_factory=lambda: {"default": Variant()}, min_length=1)
    expect: Expectations | None = Field(None, description="expectations of variants that state none")
    tolerances: dict[str, float] = Field(default_factory=dict, description="compare: allowed errors (fractions)")
    public: PublicCase | None = Field(None, description="the public report this scenario reproduces (scenarios/public/)")

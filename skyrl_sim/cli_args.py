"""Parsing of the arguments every scenario command shares (``--set``, ``--option``, ``--variant``).

Its own module so that commands living beside their logic (``compare``, ``calibrate``, ``sweep``) use them without
importing the CLI that registers them (which would be an import cycle).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from skyrl_sim.errors import UserError
from skyrl_sim.scenario import ScenarioFile, parse_value


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set '{item}': expected KEY=VALUE (for example engine.cap_aware_padding=true)")
        key, value = item.split("=", 1)
        if not key.strip():
            raise UserError(f"--set '{item}': no key before '=' (for example engine.cap_aware_padding=true)")
        out[key.strip()] = parse_value(value, f"--set {key.strip()}")
    return out


def parse_options(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--option '{item}': expected KEY=VALUE")
        key, value = item.split("=", 1)
        if not key.strip():
            raise UserError(f"--option '{item}': no key before '='")
        out[key.strip()] = value
    return out


def selected_variants(scenario: ScenarioFile, args: argparse.Namespace, default_all: bool) -> list[str]:
    if getattr(args, "variant", None):
        for name in args.variant:
            if name not in scenario.variant_names:
                raise UserError(f"{scenario.path}: no variant '{name}' (known: {', '.join(scenario.variant_names)})")
        return list(args.variant)
    if getattr(args, "all_variants", False) or default_all:
        return scenario.variant_names
    return scenario.variant_names[:1]

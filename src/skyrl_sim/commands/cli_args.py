"""Parsing of the arguments every scenario command shares (``--set``, ``--option``, ``--variant``).

Its own module so that commands living beside their logic (``compare``, ``calibrate``, ``sweep``) use them without
importing the CLI that registers them (which would be an import cycle).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from skyrl_sim.errors import UserError
from skyrl_sim.schema.overrides import parse_value
from skyrl_sim.schema.scenario import ScenarioFile


def key_values(items: Sequence[str], flag: str, example: str = "") -> list[tuple[str, str]]:
    """``KEY=VALUE`` arguments of ``flag`` as (key, raw value) pairs, or a UserError naming the bad one."""
    hint = f" (for example {example})" if example else ""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"{flag} '{item}': expected KEY=VALUE{hint}")
        if not key.strip():
            raise UserError(f"{flag} '{item}': no key before '='{hint}")
        pairs.append((key.strip(), value))
    return pairs


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``--set`` overrides, each value read as YAML (``true``, ``16``, ``[1, 2]``)."""
    return {
        key: parse_value(value, f"--set {key}")
        for key, value in key_values(items, "--set", "engine.cap_aware_padding=true")
    }


def parse_options(items: Sequence[str]) -> dict[str, str]:
    """``--option`` values as strings: the backend's option schema gives them their types."""
    return dict(key_values(items, "--option"))


def scenario_inputs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """The scenario (and an ``--endpoint`` file) a command reads: no output may replace them."""
    inputs: list[tuple[str, str | None]] = [("the scenario file", args.scenario)]
    endpoint = getattr(args, "endpoint", None)
    if endpoint and ("/" in endpoint or endpoint.endswith((".yaml", ".yml"))):
        inputs.append(("the endpoint file", endpoint))
    return inputs


def selected_variants(scenario: ScenarioFile, args: argparse.Namespace, default_all: bool) -> list[str]:
    if getattr(args, "variant", None):
        for name in args.variant:
            if name not in scenario.variant_names:
                raise UserError(f"{scenario.path}: no variant '{name}' (known: {', '.join(scenario.variant_names)})")
        return list(dict.fromkeys(args.variant))  # a variant named twice runs once (one JUnit case, one JSON run)
    if getattr(args, "all_variants", False) or default_all:
        return scenario.variant_names
    return scenario.variant_names[:1]

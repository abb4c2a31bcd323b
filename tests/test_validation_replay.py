"""Every committed validation row, its simulator side rerun on every commit against the row's recorded real runs.

``scripts/validate.py`` runs each CPU endpoint's scenarios through the real backend (minutes per row, torchrun for
the multi-rank ones) and commits the real runs under ``validation/<row>/runs/``; ``tests/real/test_fidelity.py`` keeps
one real row per model family in the suite. This file keeps the rest honest in seconds: the simulator of this commit
runs the same variants (with the row's calibrated ``profile.yaml`` and, for runs measured on a GPU machine, the
manifest's overrides) and is compared with the recorded real runs call by call, as ``validate.py`` does.

A row may not get worse than the targets or than what it recorded, whichever is looser: calls identical where they
were, OOM verdicts agreeing at least as often, attempted sizes and peaks no further off than the target (2%, 3%) or the
recorded error where that was already above it (a known miss stays visible, and cannot grow). A model change that
moves a row past that fails here; rerun ``scripts/validate.py`` for the row and look at what moved.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from project_paths import ROOT, SCENARIOS
from skyrl_sim.results.comparison import Comparison, compare_runs
from skyrl_sim.results.result import RunResult, read_results
from skyrl_sim.schema.scenario import load_scenario

VALIDATION = ROOT / "validation"
# the targets of scripts/validate.py's TARGETS, as fractions
ATTEMPTED_TARGET = 0.02
PEAK_TARGET = 0.03
# float noise only: the simulator is deterministic, so a row that held before holds to the last digit
EPSILON = 1e-9


def _validate_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("validate_script", ROOT / "scripts" / "validate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordedRuns(NamedTuple):
    """One scenario's real runs as a validation row recorded them, with the overrides they ran under."""

    scenario: Path
    overrides: dict[str, Any]
    runs: list[RunResult]


def _training_rows() -> list[Path]:
    """The rows whose summary compares training calls (a sampling or a start-up validation has its own kind)."""
    rows = []
    for summary in sorted(VALIDATION.glob("*/summary.json")):
        if "calls_identical" in json.loads(summary.read_text()):
            rows.append(summary.parent)
    return rows


def _recorded(row: Path, summary: dict[str, Any]) -> list[RecordedRuns]:
    """The row's real runs: a ``--measured`` manifest's (GPU runs, their overrides), or ``runs/<scenario>.<ref>.json``."""
    regenerate = str(summary["regenerate"])
    if regenerate.startswith("--measured "):
        _, _, _, measured = _validate_script().read_manifest(ROOT / regenerate.removeprefix("--measured "))
        return [RecordedRuns(m.scenario, m.overrides or {}, read_results(m.file)) for m in measured]
    suffix = f".{summary['reference']}.json"
    files = sorted((row / "runs").glob(f"*{suffix}"))
    return [RecordedRuns(SCENARIOS / f"{f.name.removesuffix(suffix)}.yaml", {}, read_results(f)) for f in files]


def test_every_training_row_has_recorded_real_runs() -> None:
    """The replay below covers what validate.py committed: a row without real runs would pass vacuously."""
    rows = _training_rows()
    assert len(rows) >= 15, [r.name for r in rows]
    for row in rows:
        summary = json.loads((row / "summary.json").read_text())
        recorded = _recorded(row, summary)
        assert recorded and all(r.runs for r in recorded), row.name
        assert sum(len(run.calls) for r in recorded for run in r.runs) == summary["calls"], row.name


@pytest.mark.parametrize("row", _training_rows(), ids=lambda p: p.name)
def test_the_simulator_still_matches_the_rows_real_runs(row: Path, host) -> None:
    summary = json.loads((row / "summary.json").read_text())
    profile = row / "profile.yaml"
    variants = []
    for recorded in _recorded(row, summary):
        scenario = load_scenario(recorded.scenario, summary["endpoint"])
        for real in recorded.runs:
            overrides = {**recorded.overrides, "hardware.profile": str(profile)}
            sim = host.run(scenario.resolve(real.variant, overrides), "sim")
            variants.append(compare_runs(sim, real))
    now = Comparison(row.name, variants).summary
    problems = []
    if summary["calls_identical"] and not now["calls_identical"]:
        problems.append("calls no longer identical to the real runs'")
    if now["oom_agreement"] < summary["oom_agreement"] - EPSILON:
        problems.append(f"OOM agreement {now['oom_agreement']:.1%}, recorded {summary['oom_agreement']:.1%}")
    for key, target in (("oom_attempted_error_max", ATTEMPTED_TARGET), ("peak_memory_error_max", PEAK_TARGET)):
        recorded_error = summary[key]
        if recorded_error is None or now[key] is None:
            continue
        allowed = max(target, recorded_error) + EPSILON
        if now[key] > allowed:
            problems.append(f"{key} {now[key]:.2%}: over the target {target:.0%} and the recorded {recorded_error:.2%}")
    assert not problems, f"{row.name} (rerun: scripts/validate.py {summary['regenerate']}): " + "; ".join(problems)

"""What ``advise`` reports: the ``Advice`` (the recommendation, the Pareto front, the baseline, the cap-1 reference,
every configuration evaluated), its JSON (schema ``skyrl-sim/advise/1``), its ``--set`` flags and endpoint patch, and
its terminal table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from skyrl_sim.commands.advise_evaluation import OBJECTIVES, Candidate, Objective
from skyrl_sim.commands.advise_space import AxisChoice, changes, settings_labels
from skyrl_sim.results.band import GIB, Margin
from skyrl_sim.results.outputs import write_atomic
from skyrl_sim.results.verdict import AT_RISK, FAIL, PASS
from skyrl_sim.schema.skyrl_versions import PR_SETTING_LABEL

SCHEMA = "skyrl-sim/advise/1"


@dataclass
class Advice:
    """The outcome of a search: the recommendation, the front, the baseline, every configuration tried."""

    scenario: str
    variant: str
    endpoint: str
    endpoint_source: str
    objective: Objective
    margin: Margin
    base_endpoint: dict[str, Any]
    baseline: Candidate | None
    """The scenario's own settings (None only when a signal stopped the search before they ran)."""
    reference: Candidate | None
    recommended: Candidate | None
    front: list[Candidate]
    candidates: list[Candidate]
    axes: list[AxisChoice]
    fixed: list[str]
    rejected_structures: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    skyrl_version: str = ""
    released_only: bool = False
    partial: bool = False
    """True when a signal stopped the search: only the configurations that finished are here, and the recommendation
    is the best of those."""

    def labels(self) -> dict[str, str]:
        """The recommendation's changed settings that the endpoint's SkyRL version lacks, with their label."""
        if self.recommended is None:
            return {}
        return settings_labels(self.overrides(), self.skyrl_version)

    @property
    def objective_key(self) -> str:
        """The RunResult summary key the objective reads (what the Pareto plot's axis shows)."""
        return OBJECTIVES[self.objective]

    def overrides(self) -> dict[str, Any]:
        return changes(self.recommended.settings, self.base_endpoint) if self.recommended else {}

    def set_flags(self) -> list[str]:
        return [f"--set {k}={_yaml_scalar(v)}" for k, v in self.overrides().items()]

    def endpoint_patch(self) -> str:
        """The recommendation as a YAML fragment to merge into the endpoint file."""
        nested: dict[str, Any] = {}
        for dotted, value in self.overrides().items():
            node = nested
            parts = dotted.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        return yaml.safe_dump(nested, sort_keys=False).rstrip() if nested else ""

    def to_dict(self) -> dict[str, Any]:
        base, version = self.base_endpoint, self.skyrl_version
        return {
            "schema": SCHEMA,
            "scenario": self.scenario,
            "variant": self.variant,
            "endpoint": self.endpoint,
            "endpoint_file": self.endpoint_source,
            "skyrl_version": version,
            "released_only": self.released_only,
            "labels": self.labels(),
            "objective": self.objective,
            "objective_key": self.objective_key,
            "margin": self.margin.to_dict(),
            "band": self.margin.band.to_dict(),
            "recommended": self.recommended.to_dict(self.objective, base, version) if self.recommended else None,
            "set": self.set_flags(),
            "endpoint_patch": self.endpoint_patch(),
            "baseline": self.baseline.to_dict(self.objective, base, version) if self.baseline else None,
            "reference_cap1_cap_aware": self.reference.to_dict(self.objective, base, version) if self.reference else None,
            "front": [c.to_dict(self.objective, base, version) for c in self.front],
            "evaluated": len(self.candidates),
            "candidates": [c.to_dict(self.objective, base, version) for c in self.candidates],
            "axes": {a.name: list(a.values) for a in self.axes},
            "fixed": self.fixed,
            "rejected_structures": self.rejected_structures,
            "elapsed_s": self.elapsed_s,
            "partial": self.partial,
        }

    def write(self, path: str | Path) -> None:
        write_atomic(path, orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()

def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _short(changes_: dict[str, Any], version: str = "") -> str:
    """The changes in a cell; a setting ``version`` lacks is marked ``*`` (the table's caption says why)."""
    if not changes_:
        return "(as the endpoint)"
    marked = settings_labels(changes_, version) if version else {}
    return ", ".join(f"{k.split('.')[-1]}={v}{' *' if k in marked else ''}" for k, v in changes_.items())


def advice_table(advice: Advice, top: int = 6) -> Any:
    """Evidence: the scenario's settings, the cap-1 reference, the recommendation and the front, side by side."""
    from rich.table import Table

    table = Table(
        title=f"advise {advice.scenario} / {advice.variant} on {advice.endpoint}: objective {advice.objective} "
        f"({OBJECTIVES[advice.objective]}), {len(advice.candidates)} configurations evaluated",
        title_justify="left",
    )
    for column in ("", "changes from the endpoint", "verdict", "OOM", "done", "makespan s", "p95 lat s", "waste"):
        table.add_column(column, justify="left" if column in ("", "changes from the endpoint", "verdict") else "right")
    table.add_column("peak ± band GiB", justify="right")
    table.add_column("headroom GiB", justify="right")
    rows: list[tuple[str, Candidate]] = [("current", advice.baseline)] if advice.baseline is not None else []
    if advice.reference is not None:
        rows.append(("cap 1 + cap-aware", advice.reference))
    marked = set()
    if advice.recommended is not None:
        rows.append(("[bold]recommended[/bold]", advice.recommended))
    shown = {(c.objective(advice.objective), c.headroom_bytes) for _, c in rows}
    rows += [("front", c) for c in advice.front if (c.objective(advice.objective), c.headroom_bytes) not in shown][:top]
    colours = {PASS: "green", AT_RISK: "yellow", FAIL: "red"}
    for label, c in rows:
        s = c.summary

        def sec(key: str, s: dict[str, Any] = s) -> str:
            return "-" if s.get(key) is None else f"{s[key]:.2f}"

        cell_changes = changes(c.settings, advice.base_endpoint)
        marked |= set(settings_labels(cell_changes, advice.skyrl_version))
        table.add_row(
            label,
            _short(cell_changes, advice.skyrl_version),
            f"[{colours[c.verdict]}]{c.verdict}[/{colours[c.verdict]}]",
            str(c.oom_calls),
            f"{s.get('completed')}/{s.get('requests')}",
            sec("makespan_s"),
            sec("latency_p95_s"),
            f"{s.get('padding_waste', 0):.1%}",
            "-" if c.peak_bytes is None else f"{_gib(c.peak_bytes)} ± {_gib(c.band_bytes)}",
            "-" if c.oom_calls else _gib(c.headroom_bytes),
        )
    if marked:
        table.caption = f"* {', '.join(sorted(marked))}: {PR_SETTING_LABEL} (SkyRL {advice.skyrl_version})"
    return table


def start_fix_line(advice: Advice, baseline: Candidate, recommended: Candidate) -> str:
    """For a baseline whose vLLM start ran out: which change fixes it, and what it costs in KV blocks per engine and
    generated tokens per second (empty when the baseline started)."""
    step = baseline.summary.get("vllm_start_oom")
    if not step:
        return ""
    fixed = ", ".join(f"{k}={v}" for k, v in advice.overrides().items() if k.startswith(("inference.", "placement.")))
    blocks = recommended.summary.get("vllm_kv_blocks")
    planned = baseline.summary.get("vllm_kv_blocks")
    rate = recommended.summary.get("generated_tokens_per_s")
    line = f"vLLM's start ran out in {step}; fixed by {fixed or 'the changes above'}"
    if blocks is not None:
        line += f": {blocks:,} KV blocks per engine"
        if planned:
            line += f" (the failing start sized {planned:,})"
    if rate is not None:
        line += f", {rate:,.0f} generated tokens/s over the run"
    return line


def print_advice(console: Any, advice: Advice) -> None:
    """The table, the margin, the recommendation with its ``--set`` flags and endpoint patch, and the search's cost;
    a partial search says that its recommendation is the best of what finished."""
    console.print(advice_table(advice))
    console.print(f"{advice.margin.band.describe()}; {advice.margin.describe()}")
    if advice.partial:
        console.print("[yellow]partial: the search was stopped; only the configurations that finished are shown[/yellow]")
    if advice.recommended is None:
        console.print("[red]no configuration completes every request with the margin[/red]")
        return
    r = advice.recommended
    b = advice.baseline
    current = "not run" if b is None else f"{b.verdict}, {b.objective(advice.objective):.3g}"
    console.print(
        f"[bold]recommended[/bold]: {OBJECTIVES[advice.objective]} {r.objective(advice.objective):.3g} "
        f"(current: {current}), headroom {_gib(r.headroom_bytes)} GiB >= margin {_gib(r.margin_bytes)} GiB, 0 OOM"
    )
    if advice.set_flags():
        console.print("  " + " ".join(advice.set_flags()))
        for key, label in advice.labels().items():
            version = advice.skyrl_version
            note = f"{key}: {label}; SkyRL {version} has no such setting (--released-only searches without it)"
            console.print(f"  note: {note}")
        console.print(f"endpoint-file patch ({advice.endpoint_source}):")
        console.print("\n".join("  " + line for line in advice.endpoint_patch().splitlines()), highlight=False)
        if b is not None and (line := start_fix_line(advice, b, r)):
            console.print(line)
    else:
        found = "of the configurations that ran" if advice.partial else "found"
        console.print(f"  the endpoint's own settings are already the best {found}")
    console.print(f"search: {len(advice.candidates)} simulator runs in {advice.elapsed_s:.1f} s")

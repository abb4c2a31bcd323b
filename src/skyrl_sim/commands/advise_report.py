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
from skyrl_sim.commands.knobs import KNOBS, PR_CODE, skyrl_settings
from skyrl_sim.results.band import GIB, Margin
from skyrl_sim.results.outputs import write_atomic
from skyrl_sim.results.verdict import AT_RISK, FAIL, PASS
from skyrl_sim.schema.skyrl_versions import rules

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
    mode: str = "version"
    """What the search could change (``advise_space.MODES``): the version's settings, released ones, or what-ifs."""
    devices: int = 0
    """The devices the starting configuration needs (``knobs.devices_needed``)."""
    device_limit: int = 0
    """``--devices``: the most a configuration may need (default: ``devices``)."""
    given: dict[str, Any] = field(default_factory=dict)
    """The ``--set`` overrides the search started from (and the settings it held off for the mode)."""
    partial: bool = False
    """True when a signal stopped the search: only the configurations that finished are here, and the recommendation
    is the best of those."""

    def labels(self) -> dict[str, str]:
        """The footnote of each changed setting of the recommendation that needs one: a setting the endpoint's SkyRL
        version lacks, or one that needs more devices (``advise_space.settings_labels``)."""
        if self.recommended is None:
            return {}
        return settings_labels(self.overrides(), self.skyrl_version)

    def skyrl_settings(self) -> list[dict[str, Any]]:
        """The recommendation as SkyRL settings: per changed endpoint key its SkyRL key(s) and value(s), where an
        operator writes them, and its label (``knobs.skyrl_settings``)."""
        return skyrl_settings(self.overrides(), self.skyrl_version)

    def given_notes(self) -> list[str]:
        """One line per ``--set`` the search started from that needs a footnote on the version: a setting it lacks,
        one that needs more devices, or no SkyRL setting at all (a modelling mode). The advice holds only with it."""
        labels = settings_labels(self.given, self.skyrl_version)
        return [f"--set {key}={_yaml_scalar(self.given[key])}: {text}" for key, text in labels.items()]

    @property
    def objective_key(self) -> str:
        """The RunResult summary key the objective reads (what the Pareto plot's axis shows)."""
        return OBJECTIVES[self.objective]

    @property
    def objective_label(self) -> str:
        """What the search minimises: the objective's number times the devices (``Candidate.objective``)."""
        return "GPU-seconds (makespan_s x GPUs)" if self.objective == "makespan" else f"{self.objective_key} x GPUs"

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
            "mode": self.mode,
            "labels": self.labels(),
            "skyrl_settings": self.skyrl_settings(),
            "given_notes": self.given_notes(),
            "devices": self.devices,
            "device_limit": self.device_limit,
            "objective": self.objective,
            "objective_key": self.objective_key,
            "objective_label": self.objective_label,
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


def headroom_text(candidate: Candidate) -> str:
    """``headroom 12.00 GiB >= margin 0.89 GiB``, or that it is unknown: a run whose calls report no peak (a workload
    of samples only) has no headroom to compare with the margin."""
    if candidate.headroom_bytes is None:
        return "headroom unknown (no call reports its peak)"
    return f"headroom {_gib(candidate.headroom_bytes)} GiB >= margin {_gib(candidate.margin_bytes)} GiB"


def _short(changes_: dict[str, Any], version: str = "") -> str:
    """The changes in a cell; a setting with a footnote is marked ``*`` (the table's caption gives each)."""
    if not changes_:
        return "(as the endpoint)"
    marked = settings_labels(changes_, version) if version else {}
    return ", ".join(f"{k.split('.')[-1]}={v}{' *' if k in marked else ''}" for k, v in changes_.items())


def advice_table(advice: Advice, top: int = 6) -> Any:
    """Evidence: the scenario's settings, the cap-1 reference, the recommendation and the front, side by side, each
    with the devices it needs."""
    from rich.table import Table

    table = Table(
        title=f"advise {advice.scenario} / {advice.variant} on {advice.endpoint}: objective {advice.objective} "
        f"({advice.objective_label}), {len(advice.candidates)} configurations evaluated",
        title_justify="left",
    )
    columns = ("", "changes from the endpoint", "verdict", "OOM", "done", "GPUs", "makespan s", "p95 lat s", "waste")
    for column in columns:
        table.add_column(column, justify="left" if column in ("", "changes from the endpoint", "verdict") else "right")
    table.add_column("peak ± band GiB", justify="right")
    table.add_column("headroom GiB", justify="right")
    rows: list[tuple[str, Candidate]] = [("current", advice.baseline)] if advice.baseline is not None else []
    if advice.reference is not None:
        rows.append(("cap 1 + cap-aware", advice.reference))
    marked: dict[str, str] = {}
    if advice.recommended is not None:
        rows.append(("[bold]recommended[/bold]", advice.recommended))
    shown = {(c.objective(advice.objective), c.headroom_bytes) for _, c in rows}
    rows += [("front", c) for c in advice.front if (c.objective(advice.objective), c.headroom_bytes) not in shown][:top]
    colours = {PASS: "green", AT_RISK: "yellow", FAIL: "red"}
    for name, c in rows:
        s = c.summary

        def sec(key: str, s: dict[str, Any] = s) -> str:
            return "-" if s.get(key) is None else f"{s[key]:.2f}"

        cell_changes = changes(c.settings, advice.base_endpoint)
        marked |= settings_labels(cell_changes, advice.skyrl_version)
        table.add_row(
            name,
            _short(cell_changes, advice.skyrl_version),
            f"[{colours[c.verdict]}]{c.verdict}[/{colours[c.verdict]}]",
            str(c.oom_calls),
            f"{s.get('completed')}/{s.get('requests')}",
            str(c.devices) + ("" if c.within_limit else " > limit"),
            sec("makespan_s"),
            sec("latency_p95_s"),
            f"{s.get('padding_waste', 0):.1%}",
            "-" if c.peak_bytes is None else f"{_gib(c.peak_bytes)} ± {_gib(c.band_bytes)}",
            "-" if c.oom_calls else _gib(c.headroom_bytes),
        )
    if marked:
        table.caption = "; ".join(f"* {key}: {text}" for key, text in sorted(marked.items()))
    return table


def start_fix_line(advice: Advice, baseline: Candidate, recommended: Candidate) -> str:
    """For a baseline whose vLLM start ran out: which change fixes it, and what it costs in KV blocks per engine and
    generated tokens per second (empty when the baseline started)."""
    step = baseline.summary.get("vllm_start_oom")
    if not step:
        return ""
    vllm_keys = ("inference.", "placement.")
    fixed = ", ".join(f"{k}={_yaml_scalar(v)}" for k, v in advice.overrides().items() if k.startswith(vllm_keys))
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


def skyrl_lines(advice: Advice) -> list[str]:
    """The recommendation as an operator writes it in SkyRL: one line per changed endpoint key, its SkyRL key(s) and
    value(s) and where they go, or why there is nothing to write."""
    lines = []
    for row in advice.skyrl_settings():
        if row["skyrl"]:
            written = ", ".join(f"{key}={_yaml_scalar(value)}" for key, value in row["skyrl"].items())
            lines.append(f"{written}  ({row['where']})")
        else:
            # a key SkyRL derives (DP from the GPUs and TP) is not written where its knob's other keys are
            why = "derived by SkyRL from the settings above" if row["where"] != PR_CODE else row["where"]
            lines.append(f"({row['key']}={_yaml_scalar(row['value'])}: nothing to write; {why})")
    return lines


def unsearched_line() -> str:
    """What a search that found nothing did not try: ``advise`` varies only the knobs (``knobs.KNOBS``), so a setting
    outside them (vLLM's tensor parallelism, its LoRA slots) may still make the deployment fit; ``sweep`` tries it."""
    return (
        f"advise varies only: {', '.join(knob.name for knob in KNOBS)}; every other setting (vLLM's "
        "tensor_parallel_size and num_engines, max_loras, fully_sharded_loras, ...) stays as the endpoint has it: "
        "try those with sweep --grid"
    )


def print_advice(console: Any, advice: Advice) -> None:
    """The table, the margin, the recommendation as SkyRL settings (each with its footnote), the devices it needs,
    its ``--set`` flags and endpoint patch, and the search's cost; a partial search says that its recommendation is
    the best of what finished."""
    console.print(advice_table(advice))
    console.print(f"{advice.margin.band.describe()}; {advice.margin.describe()}")
    for note in advice.given_notes():
        console.print(f"note: {note}", soft_wrap=True)
    if advice.partial:
        console.print("[yellow]partial: the search was stopped; only the configurations that finished are shown[/yellow]")
    if advice.recommended is None:
        limit = advice.device_limit
        console.print(
            f"[red]none of the {len(advice.candidates)} configurations searched on at most {limit} GPUs completes "
            "every request with the margin[/red]"
        )
        console.print(unsearched_line(), soft_wrap=True)
        return
    r = advice.recommended
    b = advice.baseline
    current = "not run" if b is None else f"{b.verdict}, {b.objective(advice.objective):.4g} on {b.devices} GPUs"
    console.print(
        f"[bold]recommended[/bold]: {advice.objective_label} {r.objective(advice.objective):.4g} on {r.devices} GPUs "
        f"(current: {current}), {headroom_text(r)}, 0 OOM",
        soft_wrap=True,
    )
    extra = r.devices - advice.devices
    devices = f"needs {r.devices} GPUs" + (f", {extra} more than now" if extra > 0 else ", no more than now")
    console.print(f"  {devices} (--devices {advice.device_limit})")
    if advice.set_flags():
        unreleased = "" if rules(advice.skyrl_version).released else " (a revision no SkyRL release has)"
        console.print(f"  SkyRL {advice.skyrl_version} settings{unreleased}:")
        for line in skyrl_lines(advice):
            console.print(f"    {line}", soft_wrap=True, highlight=False)
        for key, text in advice.labels().items():
            console.print(f"  note: {key}: {text}", soft_wrap=True)
        console.print("  in skyrl-sim: " + " ".join(advice.set_flags()), soft_wrap=True)
        console.print(f"endpoint-file patch ({advice.endpoint_source}):")
        console.print("\n".join("  " + line for line in advice.endpoint_patch().splitlines()), highlight=False)
        if b is not None and (line := start_fix_line(advice, b, r)):
            console.print(line)
    else:
        found = "of the configurations that ran" if advice.partial else "found"
        console.print(f"  the endpoint's own settings are already the best {found}")
    console.print(f"search: {len(advice.candidates)} simulator runs in {advice.elapsed_s:.1f} s")

"""Sweeps: every combination of a grid of settings through the simulator, in parallel worker processes.

A grid axis is a dotted key (the same keys as ``--set`` and a variant's ``set``) and a list of values. Every
combination runs one variant of a scenario on the ``sim`` backend; each point records its summary numbers and
its verdict (``results.verdict``: PASS, AT RISK or FAIL, the same one ``check`` gives) against the variant's
expectations (``require="expectations"``), or against every request completing with no call out of memory
(``require="completed"``, which is what a capacity question usually means), with the point's own memory band (a
point that changes ``tp`` or the hardware has its own) or ``--margin``. A point *passes* when its verdict is PASS.

``find_max`` answers "what is the largest value of this numeric setting that still passes?": over the grid's values
of that key (for every combination of the other axes), or, when the key has no grid, by bisection over an integer
range (which assumes passing is monotone: every value below a passing one passes too; the grid search reports where
that does not hold).

Every point is independent, so points go to an executor (``commands.executors``): local worker processes by default,
or Ray tasks (``executor="ray"``); each worker loads the scenario and the plugin host once and reuses them. A sweep
has an overall timeout: a stuck point cannot hang the command. SIGINT/SIGTERM stop it with the finished points kept
(``SweepInterrupted``, a sweep marked ``partial``).
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from skyrl_sim.commands.cli_args import parse_sets, scenario_inputs
from skyrl_sim.commands.executors import (
    EXECUTORS,
    Executor,
    Interrupted,
    LocalExecutor,
    check_jobs,
    default_workers,
    make_executor,
)
from skyrl_sim.commands.knobs import label, unpriced_changes
from skyrl_sim.commands.points import Job, Require, run_job, summary_numbers
from skyrl_sim.errors import UserError
from skyrl_sim.reports.progress import progress
from skyrl_sim.results.band import DEFAULT_BAND, parse_margin
from skyrl_sim.results.outputs import Output, check_outputs, write_atomic
from skyrl_sim.results.verdict import AT_RISK, FAIL, PASS, Status
from skyrl_sim.schema.limits import MAX_FORCED_GRID_POINTS, MAX_GRID_POINTS
from skyrl_sim.schema.overrides import parse_value
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario
from skyrl_sim.units import gib

SCHEMA = "skyrl-sim/sweep/1"
DEFAULT_TIMEOUT_S = 3600.0
VERDICT_CELLS = {PASS: "[green]PASS[/green]", AT_RISK: "[yellow]AT RISK[/yellow]", FAIL: "[red]FAIL[/red]"}


@dataclass(frozen=True)
class Axis:
    """One grid axis: a dotted settings key and its values, in the order given."""

    key: str
    values: tuple[Any, ...]


def parse_grid(items: Sequence[str]) -> list[Axis]:
    """``KEY=V1,V2,...`` flags as axes; values are read as YAML scalars (numbers, booleans, null)."""
    axes: list[Axis] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(
                f"--grid '{item}': expected KEY=V1,V2,... (for example engine.forward_backward_max_request_count=1,2,4)"
            )
        if not raw.strip():
            raise UserError(f"--grid '{item}': no values after '='")
        texts = [v.strip() for v in raw.split(",")]
        for position, text in enumerate(texts, start=1):
            if not text:
                raise UserError(
                    f"--grid '{item}': value {position} is empty; give one (null, where the setting may be unset)"
                )
        values = tuple(parse_value(text, f"--grid {key}") for text in texts)
        if len(set(map(repr, values))) != len(values):
            raise UserError(f"--grid '{item}': a value is repeated")
        if any(a.key == key for a in axes):
            raise UserError(f"--grid: key '{key}' is given twice; list all its values in one --grid")
        axes.append(Axis(key, values))
    return axes


def grid_points(axes: Sequence[Axis]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the last axis varying fastest."""
    return [dict(zip([a.key for a in axes], combo, strict=True)) for combo in itertools.product(*(a.values for a in axes))]


@dataclass
class Point:
    """One sweep point: its settings, whether it passed, why not, and its summary numbers."""

    settings: dict[str, Any]
    passed: bool
    problems: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Set when the point could not run at all (its worker died): the point fails, the sweep goes on."""
    risks: list[str] = field(default_factory=list)
    """The calls inside the margin (an AT RISK point's reasons)."""
    verdict: Status = FAIL
    """PASS, AT RISK or FAIL (``results.verdict``); ``passed`` is ``verdict == PASS``."""
    devices: int | None = None
    """The devices the point's configuration needs (``knobs.devices_needed``; None when it could not run)."""

    @property
    def oom(self) -> bool:
        return bool(self.summary.get("oom_calls"))


def run_point(job: Job) -> Point:
    """Run one point on the simulator (in a worker process, or in this one)."""
    result, verdict, devices = run_job(job, "sweep point")
    problems, risks = list(verdict.problems), list(verdict.risks)
    summary = summary_numbers(result)
    return Point(dict(job.settings), verdict.passed, problems, summary, risks=risks, verdict=verdict.status, devices=devices)


def crashed_point(job: Job, error: str) -> Point:
    """The result of a point whose worker died or raised: it fails with the error; the sweep goes on."""
    return Point(dict(job.settings), False, [error], {}, error=error, verdict=FAIL)


def run_jobs(
    jobs: list[Job],
    workers: int,
    on_done: Callable[[int], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    executor: Executor | None = None,
) -> list[Point]:
    """Points of the jobs, in job order, on ``executor`` (default: local processes, in this process for one worker).

    Raises ``SweepInterrupted`` with the finished points when SIGINT or SIGTERM stops it."""
    runner = executor or LocalExecutor(max(1, workers))
    try:
        return runner.map(run_point, jobs, on_done, timeout_s)
    except Interrupted as stop:
        raise SweepInterrupted(stop.signum, [stop.results[i] for i in sorted(stop.results)], len(jobs)) from None


class SweepInterrupted(Exception):  # noqa: N818 - the user asked for it
    """SIGINT or SIGTERM stopped a sweep: the points that finished, and the exit code the command should give."""

    def __init__(self, signum: int, points: list[Point], total: int, sweep: Sweep | None = None) -> None:
        self.signum = signum
        self.points = points
        self.total = total
        self.sweep = sweep
        super().__init__(f"sweep stopped by signal {signum} after {len(points)} of {total} points")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class Sweep:
    """A finished sweep: what was swept and every point's outcome."""

    scenario: str
    variant: str
    axes: list[Axis]
    require: Require
    points: list[Point]
    sets: dict[str, Any] = field(default_factory=dict)
    find_max: list[dict[str, Any]] = field(default_factory=list)
    partial: bool = False
    """True when a signal stopped the sweep: ``points`` holds only those that finished."""
    labels: dict[str, str] = field(default_factory=dict)
    """Swept or set keys that need a footnote, with it (``knobs.label``): a setting some point's SkyRL version lacks
    (PR #1874's), or no SkyRL setting at all (the simulator's sampling mode, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "scenario": self.scenario,
            "variant": self.variant,
            "sets": self.sets,
            "grid": {a.key: list(a.values) for a in self.axes},
            "require": self.require,
            "points": [asdict(p) for p in self.points],
            "find_max": self.find_max,
            "partial": self.partial,
            **({"labels": self.labels} if self.labels else {}),
        }

    def write(self, path: str | Path) -> None:
        write_atomic(path, orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def prepare(
    scenario_path: str,
    endpoint: str | None,
    variant: str | None,
    sets: dict[str, Any],
    axes: list[Axis],
    require: Require,
    margin: str | None = None,
) -> tuple[ScenarioFile, str, list[Job]]:
    """Jobs for every grid point, each validated here first: a bad key or value is one clear error, not N failures."""
    scenario, name, jobs, _ = prepare_labelled(scenario_path, endpoint, variant, sets, axes, require, margin)
    return scenario, name, jobs


def prepare_labelled(
    scenario_path: str,
    endpoint: str | None,
    variant: str | None,
    sets: dict[str, Any],
    axes: list[Axis],
    require: Require,
    margin: str | None = None,
) -> tuple[ScenarioFile, str, list[Job], dict[str, str]]:
    """``prepare``, and the labels of the swept and set keys (``key_labels``)."""
    scenario = load_scenario(scenario_path, endpoint)
    name = variant or scenario.variant_names[0]
    if name not in scenario.variant_names:
        raise UserError(f"{scenario.path}: no variant '{name}' (known: {', '.join(scenario.variant_names)})")
    jobs = []
    versions: set[str] = set()
    for settings in grid_points(axes) if axes else [{}]:
        # raises ScenarioError naming the key, the reason and where the value came from
        resolved = scenario.resolve(name, {**sets, **settings}, origins={key: "--grid" for key in settings})
        versions.add(resolved.endpoint.skyrl_version)
        jobs.append(Job(str(scenario_path), endpoint, name, dict(sets), settings, require, margin))
    labels = key_labels([*(a.key for a in axes), *sets], versions)
    for axis in axes:  # a value whose cost the time model leaves out (eager vLLM): its point looks better than it is
        costs = [cost for value in axis.values for cost in unpriced_changes({axis.key: value}).values()]
        if costs and axis.key not in labels:
            labels[axis.key] = costs[0]
    return scenario, name, jobs, labels


def key_labels(keys: Sequence[str], versions: set[str]) -> dict[str, str]:
    """The footnote of each key that needs one on some of ``versions`` (``knobs.label``): a setting a version lacks,
    or a key that is no SkyRL setting at all; with several versions, the first (by name) that needs one."""
    labels = {}
    for key in keys:
        text = next((t for version in sorted(versions) if (t := label(key, version))), "")
        if text:
            labels[key] = text
    return labels


def run_sweep(
    scenario_path: str,
    axes: list[Axis],
    *,
    endpoint: str | None = None,
    variant: str | None = None,
    sets: dict[str, Any] | None = None,
    require: Require = "expectations",
    margin: str | None = None,
    workers: int | None = None,
    on_done: Callable[[int], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    executor: Executor | None = None,
) -> Sweep:
    """Every grid point of one variant through the simulator. On SIGINT/SIGTERM raises ``SweepInterrupted`` whose
    ``sweep`` holds the finished points, marked ``partial``."""
    _, name, jobs, labels = prepare_labelled(scenario_path, endpoint, variant, sets or {}, axes, require, margin)
    try:
        points = run_jobs(jobs, workers if workers is not None else default_workers(), on_done, timeout_s, executor)
    except SweepInterrupted as stop:
        stop.sweep = Sweep(str(scenario_path), name, axes, require, stop.points, dict(sets or {}), partial=True)
        stop.sweep.labels = labels
        raise
    return Sweep(str(scenario_path), name, axes, require, points, dict(sets or {}), labels=labels)


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"--find-max {key}: value {value!r} is not a number")
    return float(value)


def find_max_in_grid(sweep: Sweep, key: str) -> list[dict[str, Any]]:
    """Per combination of the other axes: the largest value of ``key`` that passes, and whether passing was monotone."""
    if key not in [a.key for a in sweep.axes]:
        raise UserError(f"--find-max {key}: not a --grid key (grid keys: {', '.join(a.key for a in sweep.axes) or 'none'})")
    groups: dict[str, list[Point]] = {}
    others: dict[str, dict[str, Any]] = {}
    for point in sweep.points:
        rest = {k: v for k, v in point.settings.items() if k != key}
        label = repr(sorted(rest.items()))
        groups.setdefault(label, []).append(point)
        others[label] = rest
    out = []
    for label, points in groups.items():
        ordered = sorted(points, key=lambda p: _number(p.settings[key], key))
        passing = [p for p in ordered if p.passed]
        best = passing[-1].settings[key] if passing else None
        failing_below = [
            p.settings[key]
            for p in ordered
            if not p.passed and passing and _number(p.settings[key], key) < _number(best, key)
        ]
        out.append(
            {
                "key": key,
                "others": others[label],
                "max_passing": best,
                "method": "grid",
                "monotone": not failing_below,
                "failing_below_max": failing_below,
            }
        )
    return out


def bisect_max(passes_at: Callable[[int], bool], lo: int, hi: int) -> tuple[int | None, int]:
    """The largest integer in [lo, hi] that passes, assuming every value below a passing one passes; and how many
    values were evaluated. None when even ``lo`` fails."""
    if lo > hi:
        raise UserError(f"--between {lo}:{hi}: the low end is above the high end")
    evaluated = 1
    if not passes_at(lo):
        return None, evaluated
    evaluated += 1
    if passes_at(hi):
        return hi, evaluated
    good, bad = lo, hi
    while bad - good > 1:
        middle = (good + bad) // 2
        evaluated += 1
        if passes_at(middle):
            good = middle
        else:
            bad = middle
    return good, evaluated


def find_max_by_bisection(
    scenario_path: str,
    key: str,
    lo: int,
    hi: int,
    *,
    axes: list[Axis],
    endpoint: str | None = None,
    variant: str | None = None,
    sets: dict[str, Any] | None = None,
    require: Require = "expectations",
    margin: str | None = None,
) -> Sweep:
    """Bisection over ``key`` in [lo, hi] for every combination of the other axes; every evaluated point is kept.

    Bisection is sequential by nature (each step depends on the last), so it runs in this process.
    """
    if any(a.key == key for a in axes):
        raise UserError(f"--find-max {key}: give either a --grid of its values or --between LO:HI, not both")
    _, name, jobs, labels = prepare_labelled(scenario_path, endpoint, variant, sets or {}, axes, require, margin)
    for value in (lo, hi):
        load_scenario(scenario_path, endpoint).resolve(name, {**(sets or {}), key: value}, origins={key: "--between"})
    evaluated: list[Point] = []
    results = []
    for job in jobs:

        def passes_at(value: int, job: Job = job) -> bool:
            settings = {**job.settings, key: value}
            point = run_jobs([Job(job.scenario, job.endpoint, name, job.sets, settings, require, margin)], 1)[0]
            evaluated.append(point)
            return point.passed

        best, count = bisect_max(passes_at, lo, hi)
        results.append(
            {
                "key": key,
                "others": job.settings,
                "max_passing": best,
                "method": "bisection",
                "range": [lo, hi],
                "evaluated": count,
            }
        )
    sweep = Sweep(str(scenario_path), name, [*axes, Axis(key, (lo, hi))], require, evaluated, dict(sets or {}))
    sweep.find_max = results
    version = load_scenario(scenario_path, endpoint).resolve(name, sets or {}).endpoint.skyrl_version
    sweep.labels = {**labels, **key_labels([key], {version})}
    return sweep


def sweep_table(sweep: Sweep, max_rows: int = 60) -> Any:
    """The terminal table of a sweep: one row per point with its verdict and the numbers that decide between points."""
    from rich.table import Table

    table = Table(
        title=f"sweep of {sweep.scenario} / {sweep.variant} ({len(sweep.points)} points, pass = {sweep.require})",
        title_justify="left",
    )
    keys = [a.key for a in sweep.axes]
    for key in keys:
        table.add_column(key.split(".")[-1] + (" *" if key in sweep.labels else ""), justify="right")
    # a grid that changes the devices a point needs (placement.colocate_all, hardware.devices) shows them: a faster
    # point on more GPUs is not the same deal
    counts = {p.devices for p in sweep.points if p.devices is not None}
    gpus = len(counts) > 1
    columns = ("OOM", "verdict", "done", *(("GPUs",) if gpus else ()), "makespan s", "p95 lat s", "p95 wait s", "waste")
    for column in (*columns, "peak GiB"):
        table.add_column(column, justify="right")

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    rows = sweep.points if len(sweep.points) <= max_rows else sweep.points[:max_rows]
    for p in rows:
        s = p.summary
        table.add_row(
            *[str(p.settings.get(k, "")) for k in keys],
            f"[red]{s['oom_calls']}[/red]" if s.get("oom_calls") else "0",
            VERDICT_CELLS.get(p.verdict, p.verdict),
            f"{s.get('completed')}/{s.get('requests')}",
            *((num(p.devices, "d"),) if gpus else ()),
            num(s.get("makespan_s"), ".2f"),
            num(s.get("latency_p95_s"), ".2f"),
            num(s.get("queue_wait_p95_s"), ".2f"),
            num(s.get("padding_waste"), ".0%"),
            gib(s.get("peak_bytes_max")),
        )
    captions = []
    if len(sweep.points) > max_rows:
        captions.append(f"{len(sweep.points) - max_rows} more points in the JSON")
    captions += [f"* {key}: {text}" for key, text in sorted(sweep.labels.items())]
    if captions:
        table.caption = "; ".join(captions)
    return table


def find_max_lines(sweep: Sweep) -> list[str]:
    """One readable line per find-max answer."""
    lines = []
    for item in sweep.find_max:
        where = ", ".join(f"{k}={v}" for k, v in item["others"].items())
        where = f" (with {where})" if where else ""
        if item["max_passing"] is None:
            lines.append(f"no value of {item['key']} passes{where}")
            continue
        label = f" [{sweep.labels[item['key']]}]" if item["key"] in sweep.labels else ""
        line = f"largest {item['key']}{label} that passes{where}: {item['max_passing']} ({item['method']}"
        if item["method"] == "bisection":
            line += f" over {item['range'][0]}..{item['range'][1]}, {item['evaluated']} runs"
        line += ")"
        if not item.get("monotone", True):
            line += f"; note: smaller values fail too: {item['failing_below_max']}"
        lines.append(line)
    return lines


def add_parser(subparsers: Any) -> None:
    """``skyrl-sim sweep``: its arguments (registered through ``skyrl_sim_commands``)."""
    sweep = subparsers.add_parser("sweep", help="run every combination of a settings grid on the simulator, in parallel")
    sweep.add_argument("scenario", help="scenario YAML file")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...", help="an axis (repeatable)")
    sweep.add_argument("--variant", help="the variant to sweep (default: the first)")
    sweep.add_argument("--endpoint", help="endpoint name or path, replacing the scenario's")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="fixed override for every point")
    sweep.add_argument("--json", metavar="PATH", help="write the sweep as JSON")
    sweep.add_argument("--plots", metavar="DIR", help="write the heatmap PNG into DIR")
    sweep.add_argument(
        "--metric",
        default="latency_p95_s",
        choices=["latency_p95_s", "makespan_s", "queue_wait_p95_s", "padding_waste", "peak_bytes_max"],
        help="the number the heatmap colours",
    )
    sweep.add_argument("--jobs", type=int, default=None, metavar="N", help="worker processes (default: CPU count)")
    sweep.add_argument(
        "--require",
        default="expectations",
        choices=["expectations", "completed"],
        help="a point passes (PASS, as in check) when it meets the variant's expectations, or when every request "
        "completes without OOM; either way no call may be AT RISK",
    )
    sweep.add_argument(
        "--executor", choices=EXECUTORS, default="local", help="where points run: local processes (default) or Ray tasks"
    )
    sweep.add_argument("--address", metavar="ADDR", help="with --executor ray: an existing Ray cluster (default: local)")
    sweep.add_argument(
        "--margin", metavar="GiB|%", help="headroom a call needs to PASS: GiB or %% of its peak (default: the memory band)"
    )
    sweep.add_argument("--find-max", metavar="KEY", help="report the largest value of numeric KEY that passes")
    sweep.add_argument("--between", metavar="LO:HI", help="with --find-max: bisect KEY over integers LO..HI")
    sweep.add_argument("--force", action="store_true", help=f"run a grid of more than {MAX_GRID_POINTS:,} points")
    sweep.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    """Every grid combination through the simulator in worker processes; table, JSON, heatmap, find-max."""
    args.jobs = check_jobs(args.jobs, args.address)
    check_outputs([Output("--json", args.json), Output("--plots", args.plots, "dir", stdout=False)], scenario_inputs(args))
    axes = parse_grid(args.grid)
    sets = parse_sets(args.set)
    parse_margin(args.margin, DEFAULT_BAND)  # a bad --margin is an error before any point runs
    common: dict[str, Any] = dict(
        endpoint=args.endpoint, variant=args.variant, sets=sets, require=args.require, margin=args.margin
    )
    if args.between and not args.find_max:
        raise UserError("--between LO:HI needs --find-max KEY")
    if args.address and args.executor != "ray":
        raise UserError("--address needs --executor ray")
    check_grid_size(axes, args.force)
    if args.find_max and args.between:
        lo, hi = parse_between(args.between)
        result = find_max_by_bisection(args.scenario, args.find_max, lo, hi, axes=axes, **common)
    else:
        if not axes:
            raise UserError("sweep needs at least one --grid KEY=V1,V2,... (or --find-max KEY --between LO:HI)")
        if args.find_max and args.find_max not in [a.key for a in axes]:
            raise UserError(f"--find-max {args.find_max}: give its values with --grid, or a range with --between LO:HI")
        total = grid_size(axes)
        executor = make_executor(
            args.executor, args.jobs or default_workers(), args.address, on_crash=crashed_point
        )
        try:
            with progress(console, f"sweeping {total} points on {args.executor}", total) as advance:
                result = run_sweep(
                    args.scenario, axes, workers=args.jobs, on_done=advance, executor=executor, **common
                )
        except SweepInterrupted as stop:
            return sweep_interrupted(stop, args, console)
        if args.find_max:
            result.find_max = find_max_in_grid(result, args.find_max)
    console.print(sweep_table(result))
    for line in find_max_lines(result):
        console.print(f"[bold]{line}[/bold]")
    if args.json:
        result.write(args.json)
    if args.plots:
        from skyrl_sim.reports.plots import plot_sweep_heatmap

        paths = plot_sweep_heatmap(result, Path(args.plots) / "heatmap.png", metric=args.metric)
        console.print(f"heatmap: {', '.join(map(str, paths))}")
    if args.find_max:
        return 0 if all(item["max_passing"] is not None for item in result.find_max) else 1
    return 0


def grid_size(axes: Sequence[Axis]) -> int:
    total = 1
    for axis in axes:
        total *= len(axis.values)
    return total


def check_grid_size(axes: Sequence[Axis], force: bool) -> None:
    """A grid over ``MAX_GRID_POINTS`` needs ``--force``; over ``MAX_FORCED_GRID_POINTS`` it is refused, before any
    point is built (each is kept in memory and in the JSON)."""
    total = grid_size(axes)
    if total > MAX_FORCED_GRID_POINTS:
        raise UserError(
            f"--grid: {total:,} points, over the limit of {MAX_FORCED_GRID_POINTS:,} even with --force; "
            "sweep fewer values, or split the grid into several sweeps"
        )
    if total > MAX_GRID_POINTS and not force:
        raise UserError(f"--grid: {total:,} points, over the limit of {MAX_GRID_POINTS:,}; pass --force to run them")


INTEGER = re.compile(r"-?[0-9]{1,18}")


def parse_between(text: str) -> tuple[int, int]:
    """``--between LO:HI``: two integers of at most 18 ASCII digits."""
    lo, sep, hi = text.partition(":")
    if not sep or not INTEGER.fullmatch(lo.strip()) or not INTEGER.fullmatch(hi.strip()):
        raise UserError(f"--between '{text}': expected two integers LO:HI (at most 18 digits each)")
    return int(lo), int(hi)


def sweep_interrupted(stop: Any, args: argparse.Namespace, console: Console) -> int:
    """A signal stopped the sweep: show and write the points that finished (marked partial); exit 128 + signal."""
    if stop.sweep is not None:
        console.print(sweep_table(stop.sweep))
        if args.json:
            stop.sweep.write(args.json)
    where = f"; partial results in {args.json}" if args.json and stop.sweep is not None else ""
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"sweep stopped by signal {stop.signum}: {len(stop.points)} of {stop.total} points finished{where}"
    )
    return stop.exit_code

"""The ``skyrl-sim`` command line: run, check, plugins (and the commands other modules add).

Exit codes: 0 success, 1 an expectation or tolerance not met, 2 bad input (printed as one paragraph, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console

from skyrl_sim.errors import UserError
from skyrl_sim.expectations import unmet
from skyrl_sim.host import PluginHost
from skyrl_sim.progress import progress
from skyrl_sim.report import print_run, variants_table, verdict_line
from skyrl_sim.result import RunResult, write_results
from skyrl_sim.scenario import ScenarioFile, load_scenario, parse_value

LOG_WIDTH = 160
Command = Callable[[argparse.Namespace, Console], int]


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set '{item}': expected KEY=VALUE (for example engine.cap_aware_padding=true)")
        key, value = item.split("=", 1)
        out[key.strip()] = parse_value(value)
    return out


def parse_options(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--option '{item}': expected KEY=VALUE")
        key, value = item.split("=", 1)
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


def run_variants(
    host: PluginHost, args: argparse.Namespace, backend: str, default_all: bool, console: Console | None = None
) -> tuple[ScenarioFile, list[RunResult]]:
    scenario = load_scenario(args.scenario, args.endpoint)
    sets = parse_sets(args.set)
    options = parse_options(getattr(args, "option", []) or [])
    results = []
    names = selected_variants(scenario, args, default_all)
    with progress(console or Console(stderr=True), f"running {len(names)} variants", len(names)) as advance:
        for name in names:
            variant = scenario.resolve(name, sets)
            results.append(host.run(variant, backend, options))
            advance(1)
    return scenario, results


def write_reports(console: Console, results: list[RunResult], args: argparse.Namespace) -> None:
    """``--trace PATH`` and ``--plots DIR``: views of the results, written after the run."""
    if getattr(args, "trace", None):
        from skyrl_sim.trace import write_trace

        console.print(f"trace: {write_trace(results, args.trace)} (open in https://ui.perfetto.dev)")
    if getattr(args, "plots", None):
        from skyrl_sim.plots import write_plots

        with progress(console, "writing plots", 1):
            paths = write_plots(results, args.plots)
        console.print(f"plots: {len(paths)} PNGs in {args.plots}")


def add_scenario_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario YAML file")
    parser.add_argument("--variant", action="append", help="variant to run (repeatable)")
    parser.add_argument("--all-variants", action="store_true", help="run every variant")
    parser.add_argument("--endpoint", help="endpoint name (scenarios/endpoints/NAME.yaml) or path, replacing the scenario's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (dotted key)")
    parser.add_argument("--json", metavar="PATH", help="write the RunResult(s) as JSON")
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON of the run(s)")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots (memory, Gantt, latency CDF) into DIR")


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    host = PluginHost()
    _, results = run_variants(host, args, args.backend, default_all=False, console=console)
    for result in results:
        print_run(console, result)
    if len(results) > 1:
        console.print(variants_table(results))
    if args.json:
        write_results(results, args.json)
    write_reports(console, results, args)
    return 0


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    """Every variant on the simulator against its expectations: the pre-deploy check."""
    host = PluginHost()
    scenario, results = run_variants(host, args, args.backend, default_all=True, console=console)
    failing = 0
    for result in results:
        expect = scenario.resolve(result.variant, parse_sets(args.set)).expectations
        problems = unmet(result, expect)
        failing += bool(problems)
        if not args.quiet:
            print_run(console, result)
        if args.explain:
            from skyrl_sim.memory_explain import print_explain

            print_explain(console, result)
        console.print(verdict_line(result, problems))
    if len(results) > 1 and not args.quiet:
        console.print(variants_table(results))
    if args.json:
        write_results(results, args.json)
    write_reports(console, results, args)
    return 1 if failing else 0


def cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    """Every grid combination through the simulator in worker processes; table, JSON, heatmap, find-max."""
    from skyrl_sim import sweep as sweeping

    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: needs at least one worker process")
    axes = sweeping.parse_grid(args.grid)
    sets = parse_sets(args.set)
    common: dict[str, Any] = dict(endpoint=args.endpoint, variant=args.variant, sets=sets, require=args.require)
    if args.between and not args.find_max:
        raise UserError("--between LO:HI needs --find-max KEY")
    if args.find_max and args.between:
        lo, sep, hi = args.between.partition(":")
        if not sep or not lo.strip().lstrip("-").isdigit() or not hi.strip().lstrip("-").isdigit():
            raise UserError(f"--between '{args.between}': expected two integers LO:HI")
        result = sweeping.find_max_by_bisection(args.scenario, args.find_max, int(lo), int(hi), axes=axes, **common)
    else:
        if not axes:
            raise UserError("sweep needs at least one --grid KEY=V1,V2,... (or --find-max KEY --between LO:HI)")
        if args.find_max and args.find_max not in [a.key for a in axes]:
            raise UserError(f"--find-max {args.find_max}: give its values with --grid, or a range with --between LO:HI")
        total = 1
        for axis in axes:
            total *= len(axis.values)
        with progress(console, f"sweeping {total} points", total) as advance:
            result = sweeping.run_sweep(args.scenario, axes, workers=args.jobs, on_done=advance, **common)
        if args.find_max:
            result.find_max = sweeping.find_max_in_grid(result, args.find_max)
    console.print(sweeping.sweep_table(result))
    for line in sweeping.find_max_lines(result):
        console.print(f"[bold]{line}[/bold]")
    if args.json:
        result.write(args.json)
    if args.plots:
        from pathlib import Path

        from skyrl_sim.plots import plot_sweep_heatmap

        Path(args.plots).mkdir(parents=True, exist_ok=True)
        paths = plot_sweep_heatmap(result, Path(args.plots) / "heatmap.png", metric=args.metric)
        console.print(f"heatmap: {', '.join(map(str, paths))}")
    if args.find_max:
        return 0 if all(item["max_passing"] is not None for item in result.find_max) else 1
    return 0


def cmd_plugins(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    host = PluginHost()
    table = Table(title="skyrl-sim plugins", title_justify="left")
    for column in ("plugin", "backends", "padding rules", "source"):
        table.add_column(column)
    for info in host.plugins():
        table.add_row(info.name, ", ".join(info.backends), ", ".join(info.padding_rules), info.source)
    console.print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyrl-sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a scenario on a backend and print the per-call table")
    add_scenario_args(run)
    run.add_argument("--backend", default="sim", help="backend name (see `skyrl-sim plugins`)")
    run.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend option")
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check", help="run every variant and check its expectations (exit 1 when one is unmet)")
    add_scenario_args(check)
    check.add_argument("--backend", default="sim", help=argparse.SUPPRESS)
    check.add_argument("--quiet", action="store_true", help="verdict lines only")
    check.add_argument("--explain", action="store_true", help="memory timeline of each call that ran out of memory")
    check.set_defaults(func=cmd_check)

    sweep = sub.add_parser("sweep", help="run every combination of a settings grid on the simulator, in parallel")
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
        help="a point passes when it meets the variant's expectations, or when every request completes without OOM",
    )
    sweep.add_argument("--find-max", metavar="KEY", help="report the largest value of numeric KEY that passes")
    sweep.add_argument("--between", metavar="LO:HI", help="with --find-max: bisect KEY over integers LO..HI")
    sweep.set_defaults(func=cmd_sweep)

    plugins = sub.add_parser("plugins", help="list loaded plugins, what they provide and where they came from")
    plugins.set_defaults(func=cmd_plugins)

    from skyrl_sim import calibrate, compare, importer, replay  # their commands live beside their logic

    compare.add_parser(sub)
    calibrate.add_parser(sub)
    importer.add_parser(sub)
    replay.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Logs and CI (no terminal, no COLUMNS) get wide tables instead of rich's 80-column default.
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    console = Console(highlight=False, width=None if wide else LOG_WIDTH)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args, console))
    except UserError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]error:[/red] {exc}", markup=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``skyrl-sim compare``: run a scenario on two backends (or one against a saved RunResult) and compare the runs call
by call (``results.comparison``; its tables and plots: ``reports.comparison``). Exit 1 when the scenario's
tolerances are exceeded.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from skyrl_sim.commands.cli_args import parse_options, parse_sets, scenario_inputs, selected_variants
from skyrl_sim.errors import UserError
from skyrl_sim.reports.comparison import print_comparison, write_plots
from skyrl_sim.reports.progress import tracking
from skyrl_sim.results.comparison import (
    Comparison,
    VariantComparison,
    compare_runs,
    parse_tolerance,
    validate_tolerances,
)
from skyrl_sim.results.outputs import Output, check_outputs, safe_name
from skyrl_sim.results.result import RunResult, read_results
from skyrl_sim.schema.scenario import ScenarioFile


def saved_runs(path: str | Path, scenario: ScenarioFile) -> dict[str, RunResult]:
    """The runs of a saved RunResult JSON, by variant; they must be of this scenario."""
    try:
        runs = read_results(path)
    except UserError as exc:
        raise UserError(f"--against {exc}") from None
    for run in runs:
        if run.scenario != scenario.scenario.name:
            raise UserError(
                f"--against {path}: holds a run of scenario '{run.scenario}', "
                f"not '{scenario.scenario.name}' ({scenario.path})"
            )
    return {run.variant: run for run in runs}


def parse_backends(text: str, against: str | None) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if against is not None:
        if len(names) != 1:
            raise UserError(
                f"--backends '{text}': with --against name exactly one live backend (for example --backends sim)"
            )
        return names
    if len(names) != 2:
        raise UserError(f"--backends '{text}': name two backends, A (the model) then B (the reference), like sim,megatron")
    return names


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.results.result import write_results
    from skyrl_sim.schema.scenario import load_scenario

    outputs = [
        Output("--json", args.json),
        Output("--plots", args.plots, "dir", stdout=False),
        Output("--save-runs", args.save_runs, "dir", stdout=False),
    ]
    check_outputs(outputs, [*scenario_inputs(args), ("the saved run (--against)", args.against)])
    scenario = load_scenario(args.scenario, args.endpoint)
    tolerances = dict(scenario.scenario.tolerances)
    validate_tolerances(tolerances, str(scenario.path))
    overrides = {k: parse_tolerance(k, v) for k, v in parse_options(args.tolerance).items()} if args.tolerance else {}
    validate_tolerances(overrides, "--tolerance")
    tolerances.update(overrides)
    backends = parse_backends(args.backends, args.against)
    if args.save_runs and Path(args.save_runs).is_dir():  # the files it will write, known now: none may be an input
        live = backends[:1] if args.against else backends
        check_outputs([Output("--save-runs", saved_run_path(args.save_runs, scenario.scenario.name, b)) for b in live])
    sets = parse_sets(args.set)
    options = parse_options(args.option)
    saved = saved_runs(args.against, scenario) if args.against else {}
    if args.against and not args.variant and not args.all_variants:
        names = [n for n in scenario.variant_names if n in saved]
    else:
        names = selected_variants(scenario, args, default_all=False)
    for name in names:
        if args.against and name not in saved:
            raise UserError(f"--against {args.against}: no run of variant '{name}' (holds: {', '.join(saved) or 'none'})")
    host = getattr(args, "host", None) or PluginHost()
    for backend in backends:
        host.backend(backend)  # an unknown name fails before anything runs
    variants: list[VariantComparison] = []
    runs: dict[str, list[RunResult]] = {b: [] for b in backends}
    for name in names:
        variant = scenario.resolve(name, sets)
        with tracking(f"{name} on {backends[0]}", variant.request_count(), "requests") as requests:
            side_a = host.run(variant, backends[0], options, progress=requests.update)
        runs[backends[0]].append(side_a)
        if args.against:
            side_b = saved[name]
            if side_b.endpoint != variant.endpoint.name:
                raise UserError(
                    f"--against {args.against}: variant '{name}' ran on endpoint '{side_b.endpoint}', "
                    f"this comparison on '{variant.endpoint.name}'"
                )
        else:
            with tracking(f"{name} on {backends[1]}", variant.request_count(), "requests") as requests:
                side_b = host.run(variant, backends[1], options, progress=requests.update)
            runs[backends[1]].append(side_b)
        variants.append(compare_runs(side_a, side_b))
    comparison = Comparison(scenario.scenario.name, variants, tolerances)
    print_comparison(console, comparison, show_requests=not args.quiet)
    if args.json:
        comparison.write(args.json)
    if args.plots:
        for path in write_plots(comparison, args.plots):
            console.print(f"plot: {path}")
    if args.save_runs:
        out = Path(args.save_runs)
        for backend, results in runs.items():
            if results:
                write_results(results, saved_run_path(out, scenario.scenario.name, backend))
    return 1 if comparison.violations() else 0


def saved_run_path(folder: str | Path, scenario: str, backend: str) -> Path:
    """Where ``--save-runs`` writes a backend's runs of a scenario."""
    return Path(folder) / f"{safe_name(scenario)}.{safe_name(backend)}.json"


def add_parser(sub: Any) -> None:
    """``skyrl-sim compare``: registered by the CLI."""
    p = sub.add_parser(
        "compare",
        help="run a scenario on two backends (or one against a saved RunResult) and compare call by call",
        description="Exit 1 when the scenario's tolerances are exceeded, 2 on bad input.",
    )
    p.add_argument("scenario", help="scenario YAML file")
    p.add_argument("--backends", default="sim,megatron", help="A,B: the model then the reference (default sim,megatron)")
    p.add_argument("--against", metavar="RUNRESULT.json", help="compare one live backend (--backends NAME) to a saved run")
    p.add_argument("--variant", action="append", help="variant to compare (repeatable)")
    p.add_argument("--all-variants", action="store_true", help="compare every variant")
    p.add_argument("--endpoint", help="endpoint name or path, replacing the scenario's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (dotted key), both sides")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend option, both sides")
    p.add_argument("--tolerance", action="append", default=[], metavar="METRIC=FRACTION", help="add or replace a tolerance")
    p.add_argument("--json", metavar="PATH", help="write the comparison (schema skyrl-sim/compare/1)")
    p.add_argument("--plots", metavar="DIR", help="write per-variant PNGs of memory and duration per call")
    p.add_argument("--save-runs", metavar="DIR", help="also write each live backend's RunResults as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-request table")
    p.set_defaults(func=cmd_compare)

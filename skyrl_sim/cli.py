"""The ``skyrl-sim`` command line: run, check, plugins (and the commands other modules add).

Exit codes: 0 success, 1 an expectation or tolerance not met, 2 bad input (printed as one paragraph, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console

from skyrl_sim.errors import UserError
from skyrl_sim.expectations import unmet
from skyrl_sim.host import PluginHost
from skyrl_sim.report import print_run, verdict_line
from skyrl_sim.result import RunResult, write_results
from skyrl_sim.scenario import ScenarioFile, load_scenario, parse_value

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
    host: PluginHost, args: argparse.Namespace, backend: str, default_all: bool
) -> tuple[ScenarioFile, list[RunResult]]:
    scenario = load_scenario(args.scenario, args.endpoint)
    sets = parse_sets(args.set)
    options = parse_options(getattr(args, "option", []) or [])
    results = []
    for name in selected_variants(scenario, args, default_all):
        variant = scenario.resolve(name, sets)
        results.append(host.run(variant, backend, options))
    return scenario, results


def add_scenario_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario YAML file")
    parser.add_argument("--variant", action="append", help="variant to run (repeatable)")
    parser.add_argument("--all-variants", action="store_true", help="run every variant")
    parser.add_argument("--endpoint", help="endpoint name (scenarios/endpoints/NAME.yaml) or path, replacing the scenario's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (dotted key)")
    parser.add_argument("--json", metavar="PATH", help="write the RunResult(s) as JSON")


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    host = PluginHost()
    _, results = run_variants(host, args, args.backend, default_all=False)
    for result in results:
        print_run(console, result)
    if args.json:
        write_results(results, args.json)
    return 0


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    """Every variant on the simulator against its expectations: the pre-deploy check."""
    host = PluginHost()
    scenario, results = run_variants(host, args, args.backend, default_all=True)
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
    if args.json:
        write_results(results, args.json)
    return 1 if failing else 0


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

    plugins = sub.add_parser("plugins", help="list loaded plugins, what they provide and where they came from")
    plugins.set_defaults(func=cmd_plugins)

    from skyrl_sim import calibrate, compare  # their commands live beside their logic

    compare.add_parser(sub)
    calibrate.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    console = Console(highlight=False)
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

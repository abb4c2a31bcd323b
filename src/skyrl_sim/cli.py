"""The ``skyrl-sim`` command line: run, check, plugins (and the commands other modules add).

Exit codes: 0 success, 1 an expectation or tolerance not met, 2 bad input (printed as one paragraph, no traceback),
3 an internal error (a bug: the traceback is printed), 130 / 143 stopped by SIGINT / SIGTERM (alike: a sweep or an
advise search writes what finished, marked partial).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from skyrl_sim import __version__
from skyrl_sim.commands.cli_args import parse_options, parse_sets, scenario_inputs, selected_variants
from skyrl_sim.commands.knobs import idle_vllm_notes, modelling_notes
from skyrl_sim.commands.plugin import BUILTIN_COMMANDS, BuiltinCommands
from skyrl_sim.errors import UserError
from skyrl_sim.plugin_host.hookspecs import ReportWriter
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.reports.console import SafeConsole
from skyrl_sim.reports.plugin import BUILTIN_REPORTS, BuiltinReports
from skyrl_sim.reports.progress import set_mode, tracking
from skyrl_sim.reports.report import print_run, variants_table, verdict_line
from skyrl_sim.results.band import DEFAULT_BAND, Margin, parse_margin, validated_endpoints
from skyrl_sim.results.junit import Case, write_junit
from skyrl_sim.results.outputs import GuardedStream, Output, StdoutError, check_outputs
from skyrl_sim.results.result import RunResult, write_results
from skyrl_sim.results.verdict import judge, variant_margin
from skyrl_sim.schema.command_files import command_scope
from skyrl_sim.schema.options import describe_options
from skyrl_sim.schema.quantization import uncounted_quantization_note
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario
from skyrl_sim.schema.skyrl_versions import version_notes
from skyrl_sim.schema.variant import ResolvedVariant

LOG_WIDTH = 160
EXIT_OK, EXIT_FAILED_CHECK, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


@dataclass(frozen=True)
class VariantRun:
    """One variant of a run / check: resolved once, its RunResult, and the wall seconds its run took."""

    variant: ResolvedVariant
    result: RunResult
    wall_s: float


def run_resolved(
    host: PluginHost, args: argparse.Namespace, backend: str, default_all: bool
) -> tuple[ScenarioFile, list[VariantRun]]:
    """Every selected variant, each resolved once, on ``backend``."""
    scenario = load_scenario(args.scenario, args.endpoint)  # first: what it reads is what no output may replace
    check_scenario_outputs(args)
    sets = parse_sets(args.set)
    options = parse_options(getattr(args, "option", []) or [])
    runs = []
    names = selected_variants(scenario, args, default_all)
    for name in names:  # a setting the backend cannot apply is refused before the first variant runs
        host.check_settings(backend, str(scenario.path), name, scenario.scenario.variants[name].set, sets)
    with tracking(f"{scenario.scenario.name}: variants", len(names), "run") as variants:
        for name in names:
            variant = scenario.resolve(name, sets)
            with tracking(f"{name} on {backend}", variant.request_count(), "requests") as requests:
                started = time.perf_counter()
                result = host.run(variant, backend, options, progress=requests.update)
                runs.append(VariantRun(variant, result, time.perf_counter() - started))
            variants.advance(1)
    return scenario, runs


def setting_notes(run: VariantRun) -> list[str]:
    """What ``run`` and ``check`` say under a variant about its settings: each PR #1874 setting its SkyRL version
    lacks (a what-if, in the RunResult's notes), each key that is no SkyRL setting at all (the simulator's
    modelling modes, ``knobs.MODELLING``), a vLLM its SkyRL does not pin, and each vLLM setting given to a run where
    no vLLM starts (``knobs.idle_vllm_notes``)."""
    return [*version_notes(run.result.notes), *printed_only_notes(run)]


def printed_only_notes(run: VariantRun) -> list[str]:
    """The setting notes that are not in the RunResult's own notes (``setting_notes`` less ``version_notes``)."""
    quantized = uncounted_quantization_note(run.variant.endpoint, run.variant.model)
    return [*modelling_notes(run.variant.endpoint), *idle_vllm_notes(run.variant), *([quantized] if quantized else [])]


def check_scenario_outputs(args: argparse.Namespace) -> None:
    """Every output path of run / check (``--json`` and each report writer's), checked together before the run
    starts: each writable, no two the same, none a file the command has read (the scenario, its endpoint, HF config
    and hardware profile, however named), at most one on stdout."""
    outputs = [Output("--json", getattr(args, "json", None))]
    if getattr(args, "junit_xml", None) is not None:
        outputs.append(Output("--junit-xml", args.junit_xml, stdout=False))
    for writer in getattr(args, "report_writers", []):
        target = getattr(args, dest_of(writer.flag), None)
        outputs.append(Output(writer.flag, target, "dir" if writer.target == "dir" else "file", writer.stdout))
    check_outputs(outputs, scenario_inputs(args))


def variant_margins(scenario: ScenarioFile, args: argparse.Namespace, runs: list[VariantRun]) -> dict[str, Margin]:
    """Each variant's margin: ``--margin`` when given, else the memory band of the variant's own endpoint
    (validated, borrowed or default), so a variant that changes tp, the layer spec or the hardware has its own."""
    known = validated_endpoints(scenario.path)
    text = getattr(args, "margin", None)
    return {run.result.variant: variant_margin(run.variant.endpoint, scenario.path, text, known) for run in runs}


def print_bands(console: Console, margins: dict[str, Margin], with_margin: bool) -> None:
    """The band line: once when every variant has the same band, else one line per variant."""
    def line(margin: Margin) -> str:
        return f"{margin.band.describe()}; {margin.describe()}" if with_margin else margin.band.describe()

    if len({margin.band for margin in margins.values()}) == 1:
        console.print(line(next(iter(margins.values()))))
        return
    for name, margin in margins.items():
        console.print(f"{name}: {line(margin)}")


def dest_of(flag: str) -> str:
    """The argparse attribute of a ``--flag-name``."""
    return flag.lstrip("-").replace("-", "_")


def write_reports(console: Console, results: list[RunResult], args: argparse.Namespace) -> None:
    """Every report writer the user asked for (``--trace PATH``, ``--plots DIR``, plugins'), after the run."""
    for writer in getattr(args, "report_writers", []):
        target = getattr(args, dest_of(writer.flag), None)
        if target is None:
            continue
        with tracking(f"writing {writer.flag.lstrip('-')}"):
            line = writer.write(results, target)
        if line:
            console.print(line)


def add_scenario_args(parser: argparse.ArgumentParser, writers: list[ReportWriter]) -> None:
    parser.add_argument("scenario", help="scenario YAML file")
    parser.add_argument("--variant", action="append", help="variant to run (repeatable)")
    parser.add_argument("--all-variants", action="store_true", help="run every variant")
    parser.add_argument("--endpoint", help="endpoint name (scenarios/endpoints/NAME.yaml) or path, replacing the scenario's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (dotted key)")
    parser.add_argument("--json", metavar="PATH", help="write the RunResult(s) as JSON ('-': stdout)")
    for writer in writers:
        stdout = " ('-': stdout)" if writer.stdout else ""
        parser.add_argument(writer.flag, metavar=writer.metavar, help=writer.help + stdout)
    parser.set_defaults(report_writers=writers)


def print_placement(console: Console, runs: list[VariantRun]) -> None:
    """The devices each variant's endpoint takes when vLLM runs on devices of its own (added to the trainer's)."""
    for run in runs:
        line = run.variant.endpoint.placement_line()
        if line:
            console.print(f"  {line}", soft_wrap=True, highlight=False)


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    host: PluginHost = args.host
    scenario, runs = run_resolved(host, args, args.backend, default_all=False)
    results = [run.result for run in runs]
    margins = variant_margins(scenario, args, runs)
    for run in runs:
        result = run.result
        print_run(console, result, margin=margins[result.variant])
        print_placement(console, [run])
        for note in setting_notes(run):
            console.print(f"  note: {note}", soft_wrap=True)
    if margins:
        print_bands(console, margins, with_margin=False)
    if len(results) > 1:
        console.print(variants_table(results, margins))
    if args.json:
        write_results(results, args.json)
    write_reports(console, results, args)
    return 0


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    """Every variant on the simulator against its expectations: the pre-deploy check (``results.verdict``)."""
    parse_margin(args.margin, DEFAULT_BAND)  # a bad --margin is an error before anything runs
    host: PluginHost = args.host
    scenario, runs = run_resolved(host, args, args.backend, default_all=True)
    results = [run.result for run in runs]
    margins = variant_margins(scenario, args, runs)
    if margins:
        print_bands(console, margins, with_margin=True)
    cases = []
    for run in runs:
        result = run.result
        verdict = judge(result, run.variant.expectations, margins[result.variant])
        # what the text prints under the variant and the RunResult's notes do not hold (a modelling mode, a vLLM the
        # SkyRL version does not pin, a vLLM setting of a run without vLLM): the JSON's verdict carries it too
        result.verdict = {**verdict.to_dict(), "setting_notes": printed_only_notes(run)}
        if not args.quiet:
            print_run(console, result, margin=verdict.margin)
            print_placement(console, [run])
            for note in setting_notes(run):
                console.print(f"  note: {note}", soft_wrap=True)
        if args.explain:
            from skyrl_sim.reports.memory_explain import print_explain

            print_explain(console, result)
        line = verdict_line(result, verdict)
        console.print(line, soft_wrap=True)  # one unwrapped line in CI logs
        public = scenario.scenario.public
        miss = public.miss_reason(result.variant) if public is not None else None
        if miss is not None:
            console.print(f"  known miss of {public.report}: {miss}", soft_wrap=True)
        cases.append(Case(result, verdict, Text.from_markup(line).plain, run.wall_s))
    if len(results) > 1 and not args.quiet:
        console.print(variants_table(results, margins))
    if args.json:
        write_results(results, args.json)
    if args.junit_xml:
        write_junit(args.junit_xml, scenario.scenario.name, cases)
    write_reports(console, results, args)
    return 0 if all(case.verdict.passed for case in cases) else 1


def cmd_plugins(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    host: PluginHost = args.host
    table = Table(title="skyrl-sim plugins", title_justify="left")
    for column in ("plugin", "backends", "padding rules", "source"):
        table.add_column(column)
    for info in host.plugins():
        table.add_row(info.name, ", ".join(info.backends), ", ".join(info.padding_rules), info.source)
    console.print(table)
    options = Table(title="backend options (--option KEY=VALUE; any other key is an error)", title_justify="left")
    for column in ("backend", "option", "type", "default", "description"):
        options.add_column(column)
    for backend in sorted(host.backends):
        declared = host.backend_options(backend)
        rows = describe_options(declared.schema)
        for key, kind, default, description in rows:
            options.add_row(backend, key, kind, default, description)
        if not rows:
            options.add_row(backend, "-", "", "", "takes no options")
        if declared.honours is not None:
            options.add_row(backend, "(--set)", "", "", "applies only: " + ", ".join(declared.honours))
    console.print(options)
    return 0


def build_parser(host: PluginHost | None = None) -> argparse.ArgumentParser:
    """The CLI: the built-in commands, then every plugin's (``skyrl_sim_commands``; ``host``'s plugins, or the
    installed ones)."""
    parser = argparse.ArgumentParser(
        prog="skyrl-sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"skyrl-sim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    host = host or PluginHost()
    for plugin, name in ((BuiltinReports(), BUILTIN_REPORTS), (BuiltinCommands(), BUILTIN_COMMANDS)):
        if not host.pm.has_plugin(name):
            host.register(plugin, name, "skyrl_sim (built in)")
    writers = [w for found in reversed(host.hook.skyrl_sim_report_writers()) for w in found]

    run = sub.add_parser("run", help="run a scenario on a backend and print the per-call table")
    add_scenario_args(run, writers)
    run.add_argument("--backend", default="sim", help="backend name (see `skyrl-sim plugins`)")
    run.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend option")
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("check", help="run every variant and check its expectations (exit 1 when one is unmet)")
    add_scenario_args(check, writers)
    check.add_argument("--backend", default="sim", help=argparse.SUPPRESS)
    check.add_argument("--quiet", action="store_true", help="verdict lines only")
    check.add_argument("--explain", action="store_true", help="memory timeline of each call that ran out of memory")
    check.add_argument(
        "--margin", metavar="GiB|%", help="headroom a call needs to PASS: GiB or %% of its peak (default: the memory band)"
    )
    check.add_argument(
        "--junit-xml", metavar="PATH", help="write the verdicts as JUnit XML, one test case per variant (for CI)"
    )
    check.set_defaults(func=cmd_check)

    plugins = sub.add_parser("plugins", help="list loaded plugins, what they provide and where they came from")
    plugins.set_defaults(func=cmd_plugins)

    host.hook.skyrl_sim_commands(subparsers=sub)  # sweep, compare, calibrate, advise, import, replay, ... and plugins'
    for command in sub.choices.values():
        add_progress_args(command)
    parser.set_defaults(host=host)  # every command runs with the host that built its parser
    return parser


def add_progress_args(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` on a command (every command has them; see ``reports.progress``)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--progress",
        dest="progress_mode",
        action="store_const",
        const="always",
        help="show progress on stderr even when it is not a terminal (default: only on a terminal)",
    )
    group.add_argument("--no-progress", dest="progress_mode", action="store_const", const="never", help="no progress")


def main(argv: Sequence[str] | None = None, host: PluginHost | None = None) -> int:
    """The command line; `host` is for tests and embedders (default: a host with every installed plugin)."""
    for stream in (sys.stdout, sys.stderr):  # a name that is not UTF-8 (a file name's raw bytes) prints escaped
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    errors = Console(file=sys.stderr, stderr=True, highlight=False, soft_wrap=True)
    try:
        with command_scope(), sigterm_as_sigint():
            code = _run(argv, host)
        _flush_stdout()
        return code
    except StdoutError as exc:  # closed, full or a broken pipe: one line, and no second error when Python exits
        _print_error(errors, str(exc))
        _silence_stdout()
        return exc.exit_code
    except UserError as exc:
        _print_error(errors, str(exc))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal while exiting must not kill the interpreter
            with contextlib.suppress(ValueError):
                signal.signal(signum, signal.SIG_IGN)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except BrokenPipeError:  # stdout closed early (`| head`) outside the console: as above
        _print_error(errors, "stdout: the reading end of the pipe was closed")
        _silence_stdout()
        return 141
    except Exception as exc:  # a bug, not a user mistake: say so, with the traceback, and exit 3 so CI can tell
        traceback.print_exc(file=sys.stderr)
        errors.print(
            f"[red]internal error:[/red] {type(exc).__name__}: {escape(str(exc))} "
            f"(skyrl-sim {__version__}; please report it with the traceback above)",
            markup=True,
        )
        return EXIT_INTERNAL


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, CI cancellation, ``docker stop``, ``kill``) stops a command as Ctrl-C does: what the
    command holds is released on the way out (a real backend's workers, a temporary output) and it exits 143."""

    signum = signal.SIGTERM


def _terminate(_signum: int, _frame: object) -> None:
    """The first SIGTERM stops the command; another while it releases what it holds (a real backend's workers) is
    ignored, so it cannot cut that short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


@contextlib.contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` for the duration of a command (in the main thread; the commands that keep
    what finished, sweep and advise, install their own handlers while they run). The previous handler comes back
    afterwards (a test or an embedder calls ``main`` in its own process)."""
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is _terminate:
            signal.signal(signal.SIGTERM, previous)


def _run(argv: Sequence[str] | None, host: PluginHost | None) -> int:
    args = build_parser(host).parse_args(argv)
    set_mode(getattr(args, "progress_mode", None))
    if sys.stdout is None:
        raise StdoutError("is closed (the command was started with stdout closed); nothing can be printed")
    # Logs and CI (no terminal, no COLUMNS) get wide tables instead of rich's 80-column default. With an output
    # on stdout (`--json -`), everything else goes to stderr so stdout stays parseable.
    to_stderr = "-" in (getattr(args, "json", None), getattr(args, "trace", None))
    stream = sys.stderr if to_stderr else sys.stdout
    wide = stream.isatty() or "COLUMNS" in os.environ
    console = SafeConsole(
        file=GuardedStream(stream), highlight=False, width=None if wide else LOG_WIDTH, stderr=to_stderr
    )
    return int(args.func(args, console))


def _print_error(errors: Console, message: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr itself may be closed: the exit code still tells
        errors.print(f"[red]error:[/red] {escape(message)}", markup=True)


def _flush_stdout() -> None:
    """What the console left in stdout's buffer, written now so a full or closed stdout is reported, not lost."""
    if sys.stdout is not None:
        GuardedStream(sys.stdout).flush()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's own flush at exit does not fail a second time."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())

"""``skyrl-sim advise``: the fastest configuration that completes a scenario with no OOM and a safe headroom.

The command only reads its flags and reports; the rest has a module of its own:

- ``advise_space``: what is searched (engine, trainer, parallelism and vLLM settings, as axes of values);
- ``advise_search``: how (cap bisection, monotone chains, coordinate descent), and the recommendation;
- ``advise_evaluation``: one simulator run per configuration, in batches on the executors ``sweep`` uses;
- ``advise_report``: the advice, its JSON, its ``--set`` flags, endpoint patch and table.

SIGINT or SIGTERM stops the search as it stops a sweep: the workers end, the configurations that finished are printed
and written to ``--json`` with ``"partial": true``, and the command exits 130 or 143.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from skyrl_sim.commands.advise_evaluation import OBJECTIVES
from skyrl_sim.commands.advise_report import print_advice
from skyrl_sim.commands.advise_search import AdviseInterrupted, advise
from skyrl_sim.commands.cli_args import parse_sets, scenario_inputs
from skyrl_sim.commands.executors import EXECUTORS, RayExecutor, check_jobs, default_workers
from skyrl_sim.errors import UserError
from skyrl_sim.reports.progress import tracking
from skyrl_sim.results.outputs import Output, check_outputs
from skyrl_sim.schema.limits import MAX_DEVICES


def cmd_advise(args: Any, console: Any) -> int:
    """``skyrl-sim advise``: exit 0 with a recommendation, 1 when nothing is safe, 2 on bad input, 128 + signal when
    stopped."""
    args.jobs = check_jobs(args.jobs, args.address)
    check_outputs([Output("--json", args.json), Output("--plots", args.plots, "dir", stdout=False)], scenario_inputs(args))
    if args.address and args.executor != "ray":
        raise UserError("--address needs --executor ray")
    options: dict[str, Any] = dict(
        endpoint=args.endpoint,
        variant=args.variant,
        sets=parse_sets(args.set),
        objective=args.objective,
        margin=args.margin,
        fixed=args.fix,
        workers=args.jobs,
        released_only=args.released_only,
        what_if=args.what_if,
        devices=device_limit(args.devices),
    )
    try:
        with tracking(f"advise {Path(args.scenario).stem}: configurations simulated", None, "runs") as runs:
            options["on_evaluated"] = runs.update
            if args.executor == "ray":
                ray = RayExecutor(address=args.address, num_cpus=args.jobs or default_workers())
                with ray.session():
                    advice = advise(args.scenario, executor=ray, **options)
            else:
                advice = advise(args.scenario, **options)
    except AdviseInterrupted as stop:
        return advise_interrupted(stop, args, console)
    print_advice(console, advice)
    if args.json:
        advice.write(args.json)
        if args.json != "-":
            console.print(f"json: {args.json}")
    if args.plots:
        from skyrl_sim.reports.plots import plot_pareto

        console.print(f"pareto plot: {plot_pareto(advice, Path(args.plots) / 'pareto.png')}")
    return 0 if advice.recommended is not None else 1


def advise_interrupted(stop: AdviseInterrupted, args: Any, console: Any) -> int:
    """A signal stopped the search: show and write the configurations that finished (marked partial); exit 128 +
    signal."""
    print_advice(console, stop.advice)
    if args.json:
        stop.advice.write(args.json)
    where = f"; partial results in {args.json}" if args.json else ""
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"advise stopped by signal {stop.signum}: {len(stop.advice.candidates)} configurations finished{where}"
    )
    return stop.exit_code


def device_limit(text: str | None) -> int | None:
    """``--devices``: a whole number of GPUs from 1 to ``MAX_DEVICES`` (None: the starting configuration's)."""
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or not 1 <= int(text) <= MAX_DEVICES:
        raise UserError(f"--devices {text}: expected a whole number of GPUs from 1 to {MAX_DEVICES}")
    return int(text)


def add_parser(sub: Any) -> None:
    """``skyrl-sim advise``: registered by the CLI."""
    p = sub.add_parser(
        "advise",
        help="search the SkyRL settings of the endpoint's version for the best objective (times the GPUs it needs) with "
        "no OOM and a safe headroom",
        description="Exit 0 with a recommendation, 1 when no configuration is safe, 2 on bad input.",
    )
    p.add_argument("scenario", help="scenario YAML file")
    p.add_argument("--variant", help="the variant whose settings are the starting point (default: the first)")
    p.add_argument("--endpoint", help="endpoint name or path, replacing the scenario's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override kept as given (not searched)")
    p.add_argument(
        "--objective",
        default="makespan",
        choices=list(OBJECTIVES),
        help="what to minimise, times the GPUs a configuration needs (makespan: GPU-seconds)",
    )
    p.add_argument("--margin", metavar="GiB|%", help="headroom a configuration needs: GiB or %% of the peak (default: band)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY", help="keep a setting as it is (repeatable)")
    p.add_argument(
        "--released-only",
        action="store_true",
        help="change only settings that a SkyRL release has (by default: those the endpoint's skyrl_version has; on a "
        "pr1874 endpoint this leaves out the PR's cap and cap-aware padding)",
    )
    p.add_argument(
        "--what-if",
        action="store_true",
        help="also change settings the endpoint's skyrl_version lacks (PR #1874's on 0.4.0), each labelled",
    )
    p.add_argument(
        "--devices",
        metavar="N",
        help="the most GPUs a configuration may need (default: what the starting configuration needs; "
        "placement.colocate_all false needs num_engines x tensor_parallel_size more)",
    )
    p.add_argument("--jobs", type=int, default=None, metavar="N", help="worker processes (default: CPU count)")
    p.add_argument(
        "--executor", choices=EXECUTORS, default="local", help="where configurations run: local processes or Ray tasks"
    )
    p.add_argument("--address", metavar="ADDR", help="with --executor ray: an existing Ray cluster (default: local)")
    p.add_argument("--json", metavar="PATH", help="write the advice (schema skyrl-sim/advise/1)")
    p.add_argument("--plots", metavar="DIR", help="write the Pareto plot (objective against headroom) into DIR")
    p.set_defaults(func=cmd_advise)

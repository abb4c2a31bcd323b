"""``skyrl-sim import``: a SkyRL database's traffic as a scenario file (``trace_import`` reads it). What ``import``
writes is validated as the scenario it is before it is written, so it loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from skyrl_sim.commands.trace_import import (
    add_source_args,
    scenario_of,
    scenario_text,
    source_inputs,
    summary_lines,
    trace_from_args,
)
from skyrl_sim.errors import UserError
from skyrl_sim.reports.progress import tracking
from skyrl_sim.results.outputs import Output, check_outputs, write_atomic
from skyrl_sim.schema.limits import MAX_SCENARIO_BYTES

JSON_HINT_REQUESTS = 100_000
"""Past this many requests, a YAML ``--out`` gets the hint that JSON loads faster."""


def loads_as_written(body: dict[str, Any], out: Path) -> None:
    """The scenario loads and resolves as ``check`` will load it, or the import fails (exit 2) with the reason and
    nothing is written: every row was checked (``traffic.rows``), so this is the guarantee, not the filter."""
    from skyrl_sim.errors import ScenarioError
    from skyrl_sim.schema.scenario import ScenarioFile

    try:
        with tracking(f"checking that {out.name} loads"):
            ScenarioFile(out, raw=body)
    except ScenarioError as exc:
        raise UserError(f"import: the scenario would not load, so {out} was not written: {exc}") from None


def cmd_import(args: argparse.Namespace, console: Console) -> int:
    from skyrl_sim.schema.endpoint_files import load_endpoint, portable_ref

    out = Path(args.out)
    # before the database is read (a week takes a while)
    check_outputs([Output("--out", args.out, stdout=False)], source_inputs(args.source))
    load_endpoint(args.endpoint, out)  # an unknown endpoint fails before the database is read
    trace = trace_from_args(args)
    name = args.name or out.stem
    body = scenario_of(trace, portable_ref(args.endpoint, out), name)  # a path: relative to the written file
    loads_as_written(body, out)
    data = scenario_text(body, out).encode()
    size = len(data)
    if size > MAX_SCENARIO_BYTES:
        raise UserError(
            f"--out {args.out}: the scenario would be {size:,} bytes, over the {MAX_SCENARIO_BYTES:,}-byte limit on "
            "scenario files; import a shorter window (--since/--until) or fewer models (--models)"
        )
    write_atomic(out, data)  # an interrupted import leaves no half-written scenario
    for line in summary_lines(trace):
        console.print(line, markup=False)
    console.print(f"scenario: {args.out} (endpoint {args.endpoint})", markup=False)
    if out.suffix.lower() != ".json" and len(trace.requests) > JSON_HINT_REQUESTS:
        faster = out.with_suffix(".json")
        console.print(f"hint: {len(trace.requests):,} requests load about 10x faster as JSON: --out {faster}")
    return 0


def add_parser(sub: Any) -> None:
    """``skyrl-sim import``: registered by the CLI."""
    p = sub.add_parser(
        "import",
        help="write a SkyRL database's traffic as a scenario file (read-only)",
        description="Exit 2 on bad input, an unreadable database or a changed schema.",
    )
    add_source_args(p)
    p.add_argument(
        "--out", required=True, metavar="SCENARIO.yaml", help="the scenario file to write (JSON if it ends in .json)"
    )
    p.add_argument("--name", help="scenario name (default: the output file's stem)")
    p.set_defaults(func=cmd_import)

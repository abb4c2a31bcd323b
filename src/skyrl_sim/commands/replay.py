"""``skyrl-sim replay``: import a SkyRL database, run its traffic on the simulator, compare with what happened.

The recorded side is a RunResult built from the database: every request with its recorded arrival, completion, status
and failure text (clock: seconds since the first imported request, the simulator's clock too). The comparison is
``compare``'s (``skyrl_sim.results.comparison.compare_runs``, JSON schema ``skyrl-sim/compare/1``), per request: status
agreement and the latency error distribution; plus a ``replay`` section: OOM verdicts per request (the recorded one
read from the failure text in ``result_data``), and which requests the simulator says would fail or be slow that did
not, and the other way round. The database records requests, not backend calls; ``--log SERVICE.LOG`` adds the
calls SkyRL logged (``process_batch_requests``/``process_single_request``, with the request ids where the log
names them) and compares them call by call.

Replaying with the service's own settings is a fidelity check; with ``--set`` overrides it is the what-if.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from skyrl_sim.commands.call_alignment import align_calls
from skyrl_sim.commands.trace_import import (
    ImportedTrace,
    add_source_args,
    scenario_of,
    scenario_text,
    source_inputs,
    trace_from_args,
)
from skyrl_sim.errors import UserError
from skyrl_sim.reports.comparison import calls_table, print_tenants, requests_table, summary_table
from skyrl_sim.reports.progress import tracking
from skyrl_sim.results.comparison import (
    Comparison,
    VariantComparison,
    compare_runs,
    json_finite,
    parse_tolerance,
    validate_tolerances,
)
from skyrl_sim.results.oom_text import is_oom_text
from skyrl_sim.results.outputs import Output, check_outputs, safe_name, write_atomic
from skyrl_sim.results.result import CallRecord, RequestRecord, RunResult
from skyrl_sim.schema.endpoint_files import portable_ref
from skyrl_sim.traffic.service_log import LoggedCall, logged_call_record

RECORDED = "recorded"
DEFAULT_SLOW = 0.5  # a latency more than 50% above the other side's is "slow"
MAX_SLOW = 1e6  # "slow" means more than a million times the other side's latency at most
MAX_CALLS_SHOWN = 200


def recorded_result(trace: ImportedTrace, scenario: str, endpoint: str) -> RunResult:
    """What the service did, as a RunResult: ids are the arrival order (1..N), times relative to the first request."""
    t0 = trace.start_s
    result = RunResult(scenario=scenario, variant="default", backend=RECORDED, endpoint=endpoint)
    records: list[RequestRecord] = []
    for index, request in enumerate(trace.requests, start=1):
        status = request.status if request.status in ("completed", "failed") else "pending"
        records.append(
            RequestRecord(
                id=index,
                type=request.type,
                model_id=request.model_id,
                tokens=sum(request.datums),
                submitted_s=request.created_s - t0,
                completed_s=None if request.completed_s is None else request.completed_s - t0,
                status=status,
                error=request.error,
                client=request.model_id,
                datums=list(request.datums),
                outputs={"service_request_id": request.request_id},
            )
        )
    result.requests = records
    result.notes.append(f"recorded in {trace.info.url}")
    return result


LOG_CLOCK_STEP_S = 900.0
"""A service log's clock differs from its database's by a whole time-zone offset (the log writes local time without a
zone, SkyRL's database UTC): a multiple of 15 minutes."""
def log_clock_offset(logged: list[LoggedCall], by_service: dict[str, RequestRecord], t0: float) -> float:
    """Seconds to subtract from a logged epoch to put it on the record's clock. A call ends just before its requests
    complete, so the log's clock is ahead of the database's by about (call end - completion); that difference is
    rounded to the time-zone step. 0 when no logged call names a recorded request."""
    gaps = []
    for entry in logged:
        done = [r.completed_s for r in (by_service.get(i) for i in entry.ids or []) if r and r.completed_s is not None]
        if done:
            gaps.append(entry.end_epoch - (t0 + max(done)))
    if not gaps:
        return 0.0
    return round(statistics.median(gaps) / LOG_CLOCK_STEP_S) * LOG_CLOCK_STEP_S


def logged_calls(log_path: str, recorded: RunResult, t0: float) -> tuple[list[CallRecord], list[str], list[str]]:
    """The calls SkyRL logged, their request ids mapped to the recorded run's (calls of other requests dropped), on
    the record's clock (``t0``: the epoch of its first request); with the log's lines and notes. Each call's record
    follows the rules of ``logged_call_record``."""
    from skyrl_sim.traffic.service_log import read_service_log

    try:
        logged = read_service_log(log_path)
    except OSError as exc:
        raise UserError(f"--log {log_path}: cannot read the service log: {exc.strerror or exc}") from None
    by_service = {str(r.outputs["service_request_id"]): r for r in recorded.requests}
    offset = log_clock_offset(logged.calls, by_service, t0)
    notes = []
    if offset:
        notes.append(f"log clock: the service log's times are {offset / 3600:+g} h from the database's (time zone)")
    calls: list[CallRecord] = []
    for entry in logged.calls:
        records = [by_service[i] for i in entry.ids or [] if i in by_service]
        if entry.ids is not None and not records:
            continue
        calls.append(logged_call_record(entry, records, len(calls), entry.end_epoch - offset - t0))
    return calls, logged.lines, notes


def align_ids(simulated: RunResult, recorded: RunResult) -> list[str]:
    """Give each simulated request the id of its recorded twin (the k-th request of the same model), so requests are
    compared with themselves even where the simulator's arrival order differs; returns a note when it did."""
    twins: dict[tuple[str, int], int] = {}
    seen: dict[str, int] = {}
    for record in recorded.requests:
        k = seen.get(record.client, 0)
        seen[record.client] = k + 1
        twins[(record.client, k)] = record.id
    mapping: dict[int, int] = {}
    seen.clear()
    for record in sorted(simulated.requests, key=lambda r: r.id):
        k = seen.get(record.client, 0)
        seen[record.client] = k + 1
        mapping[record.id] = twins.get((record.client, k), record.id)
    if all(old == new for old, new in mapping.items()):
        return []
    for record in simulated.requests:
        record.id = mapping[record.id]
    for call in simulated.calls:
        call.request_ids = [mapping.get(i, i) for i in call.request_ids]
    moved = sum(old != new for old, new in mapping.items())
    return [f"arrival order: {moved} requests arrived in another order in the simulator; compared by model and position"]


@dataclass
class ReplayFindings:
    """Per request: OOM verdicts and where the simulator and the record disagree about failing or being slow."""

    oom_simulated: list[int] = field(default_factory=list)
    oom_recorded: list[int] = field(default_factory=list)
    oom_agreement: float = 1.0
    fails_only_in_simulation: list[int] = field(default_factory=list)
    failed_only_in_record: list[int] = field(default_factory=list)
    slow_only_in_simulation: list[int] = field(default_factory=list)
    slow_only_in_record: list[int] = field(default_factory=list)
    slow_threshold: float = DEFAULT_SLOW
    calls_recorded: bool = False
    calls_simulated: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def findings(simulated: RunResult, recorded: RunResult, slow: float) -> ReplayFindings:
    out = ReplayFindings(slow_threshold=slow, calls_simulated=len(simulated.calls))
    sim = {r.id: r for r in simulated.requests}
    agree = 0
    for rec in recorded.requests:
        mine = sim.get(rec.id)
        sim_oom = mine is not None and is_oom_text(mine.error)
        rec_oom = is_oom_text(rec.error)
        if sim_oom:
            out.oom_simulated.append(rec.id)
        if rec_oom:
            out.oom_recorded.append(rec.id)
        agree += sim_oom == rec_oom
        if mine is None:
            continue
        if mine.status == "failed" and rec.status == "completed":
            out.fails_only_in_simulation.append(rec.id)
        elif rec.status == "failed" and mine.status == "completed":
            out.failed_only_in_record.append(rec.id)
        la, lb = mine.latency_s, rec.latency_s
        if mine.status == rec.status == "completed" and la is not None and lb is not None:
            if la > lb * (1 + slow):
                out.slow_only_in_simulation.append(rec.id)
            elif lb > la * (1 + slow):
                out.slow_only_in_record.append(rec.id)
    out.oom_agreement = agree / len(recorded.requests) if recorded.requests else 1.0
    return out


@dataclass
class ReplayComparison(Comparison):
    """compare's comparison, with one OOM agreement: per request. The record knows each request's OOM verdict (its
    failure text); a log's calls rarely say they ran out of memory, and where the two sides cut calls differently
    a per-call figure would count the split, not a verdict."""

    oom_agreement: float = 1.0

    @property
    def summary(self) -> dict[str, Any]:
        return {**super().summary, "oom_agreement": self.oom_agreement}


@dataclass
class Replay:
    """One replay: the runs on both sides, their comparison (compare's) and the replay's own findings."""

    simulated: RunResult
    recorded: RunResult
    comparison: Comparison
    findings: ReplayFindings

    def to_dict(self) -> dict[str, Any]:
        body = self.comparison.to_dict()
        body["replay"] = self.findings.to_dict()
        return body

    def write(self, path: str | Path) -> None:
        write_atomic(path, orjson.dumps(json_finite(self.to_dict()), option=orjson.OPT_INDENT_2))


def replay_trace(
    trace: ImportedTrace,
    endpoint: str,
    name: str = "replay",
    sets: dict[str, Any] | None = None,
    log: str | None = None,
    slow: float = DEFAULT_SLOW,
    scenario_out: str | Path | None = None,
    tolerances: dict[str, float] | None = None,
) -> Replay:
    """Run the imported trace on the simulator and compare it with the record (its calls aligned with the logged
    ones by the requests they hold: ``call_alignment``)."""
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.schema.scenario import ScenarioFile

    path = Path(scenario_out) if scenario_out else Path.cwd() / f"{name} (imported from {trace.source})"
    written = portable_ref(endpoint, path) if scenario_out else endpoint  # a path: relative to the written scenario
    body = scenario_of(trace, written, name)
    scenario = ScenarioFile(path, raw=body)
    if scenario_out:  # written once it is known to load
        write_atomic(scenario_out, scenario_text(body, Path(scenario_out)))
    variant = scenario.resolve("default", sets)
    with tracking(f"{name} on sim", variant.request_count(), "requests") as requests:
        simulated = PluginHost().run(variant, "sim", progress=requests.update)
    recorded = recorded_result(trace, name, variant.endpoint.name)
    notes = align_ids(simulated, recorded)
    calls_recorded = log is not None
    pairs = None
    if log is not None:
        recorded.calls, recorded.log, log_notes = logged_calls(log, recorded, trace.start_s)
        notes += log_notes
        pairs = align_calls(simulated.calls, recorded.calls)
    side_a = simulated
    if not calls_recorded:  # the database has no calls: compare requests only (the simulated calls stay in `simulated`)
        side_a = RunResult(**{**simulated.__dict__, "calls": []})
    variant_cmp: VariantComparison = compare_runs(side_a, recorded, pairs)
    found = findings(simulated, recorded, slow)
    variant_cmp.summary["oom_agreement"] = found.oom_agreement
    comparison = ReplayComparison(name, [variant_cmp], dict(tolerances or {}), oom_agreement=found.oom_agreement)
    found.calls_recorded = calls_recorded
    found.notes = notes + ([] if calls_recorded else ["calls: the database records requests, not calls (see --log)"])
    return Replay(simulated, recorded, comparison, found)


def _ids(ids: list[int], shown: int = 8) -> str:
    if not ids:
        return "none"
    text = ", ".join(map(str, ids[:shown]))
    return text + (f" (+{len(ids) - shown} more)" if len(ids) > shown else "")


def findings_table(found: ReplayFindings, requests: int) -> Table:
    table = Table(title=f"replay: {requests} requests, simulator (A) against the record (B)", title_justify="left")
    table.add_column("finding")
    table.add_column("count", justify="right")
    table.add_column("request ids (recorded order)")
    rows = [
        ("OOM in the simulator", found.oom_simulated),
        ("OOM recorded", found.oom_recorded),
        ("fails in simulation, completed in the record", found.fails_only_in_simulation),
        ("failed in the record, completes in simulation", found.failed_only_in_record),
        (f"slow in simulation (> +{found.slow_threshold:.0%})", found.slow_only_in_simulation),
        (f"slow in the record (> +{found.slow_threshold:.0%})", found.slow_only_in_record),
    ]
    for label, ids in rows:
        table.add_row(label, str(len(ids)), _ids(ids))
    return table


def cmd_replay(args: argparse.Namespace, console: Console) -> int:
    from skyrl_sim.commands.cli_args import parse_options, parse_sets
    from skyrl_sim.commands.trace_import import summary_lines

    if not (math.isfinite(args.slow) and 0 < args.slow <= MAX_SLOW):
        raise UserError(f"--slow {args.slow}: must be a fraction above 0 and at most {MAX_SLOW:g} (0.5 = 50% slower)")
    tolerances = {k: parse_tolerance(k, v) for k, v in parse_options(args.tolerance).items()}
    validate_tolerances(tolerances, "--tolerance")
    # every output is checked before the database is read and the replay runs
    outputs = [
        Output("--json", args.json),
        Output("--scenario-out", args.scenario_out, stdout=False),
        Output("--save-runs", args.save_runs, "dir", stdout=False),
    ]
    if args.save_runs and Path(args.save_runs).is_dir():  # the two files it writes there, known now: no input
        saved = [Output("--save-runs", str(saved_run_path(args.save_runs, args.name, side))) for side in SIDES]
        outputs = [*outputs, *saved]
    check_outputs(outputs, [*source_inputs(args.source), ("the service log", args.log)])
    trace = trace_from_args(args)
    for line in summary_lines(trace):
        console.print(line, markup=False)
    name = args.name or "replay"
    result = replay_trace(
        trace, args.endpoint, name, parse_sets(args.set), args.log, args.slow, args.scenario_out, tolerances
    )
    variant = result.comparison.variants[0]
    if variant.calls and len(variant.calls) <= MAX_CALLS_SHOWN:
        console.print(calls_table(variant))
    elif variant.calls:
        console.print(f"{len(variant.calls)} calls compared (table not shown above {MAX_CALLS_SHOWN}; see --json)")
    if not args.quiet:
        console.print(requests_table(variant))
    print_tenants(console, variant)
    console.print(summary_table([(name, result.comparison.summary)]))
    console.print(findings_table(result.findings, len(result.recorded.requests)))
    for note in result.findings.notes:
        console.print(f"note: {note}")
    problems = result.comparison.violations()
    if problems:
        console.print("[red]FAIL[/red] tolerances exceeded: " + "; ".join(problems))
    elif tolerances:
        console.print("[green]PASS[/green] within tolerances: " + ", ".join(f"{k} {v}" for k, v in tolerances.items()))
    if args.json:
        result.write(args.json)
        console.print(f"comparison: {args.json} (schema skyrl-sim/compare/1, with a 'replay' section)")
    if args.save_runs:
        from skyrl_sim.results.result import write_results

        write_results([result.simulated], saved_run_path(args.save_runs, args.name, "sim"))
        write_results([result.recorded], saved_run_path(args.save_runs, args.name, "recorded"))
    return 1 if problems else 0


SIDES = ("sim", "recorded")


def saved_run_path(folder: str | Path, name: str | None, side: str) -> Path:
    """Where ``--save-runs`` writes one side's run: one file name in the folder, whatever ``--name`` holds."""
    return Path(folder) / f"{safe_name(name or 'replay')}.{side}.json"


def add_parser(sub: Any) -> None:
    """``skyrl-sim replay``: registered by the CLI."""
    p = sub.add_parser(
        "replay",
        help="import a SkyRL database, run it on the simulator and compare with the recorded outcome",
        description="Exit 1 when a --tolerance is not met, 2 on bad input, an unreadable database or a changed schema.",
    )
    add_source_args(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="what-if override (dotted key)")
    p.add_argument("--log", metavar="SERVICE.LOG", help="the service's log: compare its calls too")
    p.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="METRIC=VALUE",
        help="fail (exit 1) when a summary metric misses it (compare's metrics: status_agreement=1, ...)",
    )
    p.add_argument("--slow", type=float, default=DEFAULT_SLOW, metavar="FRACTION", help="latency excess that is 'slow'")
    p.add_argument("--name", help="scenario name (default: replay)")
    p.add_argument("--scenario-out", metavar="PATH", help="also keep the imported scenario file")
    p.add_argument("--json", metavar="PATH", help="write the comparison (skyrl-sim/compare/1 plus 'replay')")
    p.add_argument("--save-runs", metavar="DIR", help="write the simulated and recorded RunResults as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-request table")
    p.set_defaults(func=cmd_replay)

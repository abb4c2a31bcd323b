"""Terminal views of RunResults: the per-call table, the per-variant summary, the verdict line."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from skyrl_sim.reports.tenants import is_multi_tenant, swap_lines, tenancy_line, tenants_table
from skyrl_sim.results.band import Margin, headroom_state
from skyrl_sim.results.result import CallRecord, RunResult
from skyrl_sim.results.tenants import tenancy_summary
from skyrl_sim.results.verdict import FAIL, PASS, Verdict, at_risk_calls, peak_text
from skyrl_sim.units import GIB, format_size, gib


def _ids(ids: list[int]) -> str:
    if len(ids) <= 3:
        return ",".join(map(str, ids))
    return f"{ids[0]}..{ids[-1]} ({len(ids)})"


def _status(call: CallRecord, capacity: int | None = None, margin: Margin | None = None) -> str:
    if call.oom is not None:
        return f"[red]OOM {call.oom.attempted_bytes / GIB:.2f} GiB[/red]"
    if call.error:
        return "[red]failed[/red]"
    if margin is not None and headroom_state(call, capacity, margin) == "at_risk":
        return "[yellow]AT RISK[/yellow]"
    return "[green]ok[/green]"


def calls_table(result: RunResult, max_rows: int = 40, margin: Margin | None = None) -> Table:
    table = Table(
        title=f"{result.scenario} / {result.variant} on {result.backend} ({result.endpoint})", title_justify="left"
    )
    for column in (
        "#",
        "kind",
        "requests",
        "rows",
        "padded",
        "width",
        "mb",
        "start s",
        "dur s",
        "peak GiB",
        "waste",
        "result",
    ):
        table.add_column(column, justify="right" if column not in ("kind", "result", "requests") else "left")
    shown = result.calls if len(result.calls) <= max_rows else result.calls[: max_rows - 5] + result.calls[-5:]
    for i, call in enumerate(shown):
        if len(result.calls) > max_rows and i == max_rows - 5:
            table.add_row("...", f"{len(result.calls) - max_rows} more", *[""] * 10)
        is_pass = call.kind in ("forward_backward", "forward")
        table.add_row(
            str(call.index),
            call.kind,
            _ids(call.request_ids),
            str(call.rows) if is_pass else "",
            str(call.padded_rows) if is_pass else "",
            f"{call.width:,}" if is_pass else "",
            str(call.microbatches) if is_pass else "",
            f"{call.start_s:.2f}",
            f"{call.duration_s:.2f}",
            peak_text(call.peak_bytes, margin),
            f"{call.padding_waste:.0%}" if is_pass else "",
            _status(call, result.capacity_bytes, margin),
        )
    return table


def _ratio(big: int, small: int) -> str:
    return f"{big / small:.1f}x" if small else "-"


def moe_sample_line(request_id: int, moe: dict[str, Any]) -> str:
    """The routed-expert bytes of one sample request (``outputs["moe"]``) on the wire, compact against JSON lists."""
    return (
        f"sample #{request_id}: {moe['samples']} samples, routed experts on the wire {format_size(moe['wire_bytes'])} "
        f"({moe['dtype']} + base64) vs {format_size(moe['json_list_bytes'])} as JSON lists "
        f"({_ratio(moe['json_list_bytes'], moe['wire_bytes'])})"
    )


def moe_line(call: CallRecord) -> str | None:
    """One line of routed-expert replay (R3) bytes for a call that carries ``extra["moe"]``; None otherwise."""
    moe = call.extra.get("moe")
    if not moe:
        return None
    if call.kind == "sample":
        return (
            f"#{call.index} sample: {moe['samples']} samples, routed experts on the wire "
            f"{format_size(moe['wire_bytes'])} ({moe['dtype']} + base64) vs {format_size(moe['json_list_bytes'])} "
            "as JSON lists "
            f"({_ratio(moe['json_list_bytes'], moe['wire_bytes'])})"
        )
    routes = moe["routes"]
    # both hold int32 ids (megatron's replay reads them so): int32-all-layers every layer's, compact the stage's own
    # layers, sliced from the compact ids (``dtype`` on the wire) before the one conversion
    expanded = moe["layout"] == "int32-all-layers"
    layers = f"all {moe['moe_layers']}" if expanded else f"{moe['stage_moe_layers']}/{moe['moe_layers']}"
    line = (
        f"#{call.index} {call.kind}: R3 {moe['layout']}"
        f" (int32 from {moe['dtype']}, {layers} MoE layers per stage, top {moe['top_k']}):"
        f" per micro-batch {format_size(routes['replay_mb_bytes'])}"
        f" + mask {format_size(routes['padding_mask_mb_bytes'])};"
        f" compact {format_size(routes['replay_mb_compact_bytes'])} vs int32-all-layers"
        f" {format_size(routes['replay_mb_int32_all_layers_bytes'])}"
        f" ({_ratio(routes['replay_mb_int32_all_layers_bytes'], routes['replay_mb_compact_bytes'])})"
    )
    if routes["host_wire_bytes"]:
        line += (
            f"; trainer receives {format_size(routes['host_wire_bytes'])}"
            f" vs {format_size(routes['host_json_list_bytes'])} as JSON lists"
        )
    line += f"; router + expert activations {format_size(moe['layer_terms_bytes'])} per MoE layer"
    return line + routing_phrase(moe.get("routing"))


def routing_phrase(routing: dict[str, Any] | None) -> str:
    """Which spread of tokens over the experts the call was priced with (``trainer.moe_routing``)."""
    if not routing:
        return ""
    if routing["spread"] != "skew":
        return f"; routing {routing['spread']} (every expert its share)"
    return (
        f"; routing skewed: the busiest rank priced at {routing['busiest_rank_share']:.3g}x its even share of the "
        f"token-expert pairs, its busiest expert at {routing['busiest_expert_load']:.3g}x"
    )


def summary_line(result: RunResult, margin: Margin | None = None) -> str:
    s = result.summary()
    parts = [
        f"{s['completed']}/{s['requests']} completed",
        f"{s['failed']} failed",
        f"{s['calls']} calls",
        f"{s['oom_calls']} OOM",
        f"makespan {s['makespan_s']:.2f} s",
    ]
    if s["latency_p50_s"] is not None:
        parts.append(f"latency p50 {s['latency_p50_s']:.2f} s / p95 {s['latency_p95_s']:.2f} s")
    if s["queue_wait_p95_s"] is not None:
        parts.append(f"queue wait p95 {s['queue_wait_p95_s']:.2f} s")
    parts.append(f"padding waste {s['padding_waste']:.1%}")
    if "switch_s" in s:  # a device shared with vLLM: its sleeps, wakes, offloads, backloads and syncs
        parts.append(f"switching {s['switch_s']:.2f} s ({s['switch_share']:.0%} of engine time)")
    if s["peak_bytes_max"] is not None and result.capacity_bytes:
        parts.append(f"peak {peak_text(s['peak_bytes_max'], margin)} of {gib(result.capacity_bytes)} GiB")
    return ", ".join(parts)


def variants_table(results: list[RunResult], margin: Margin | dict[str, Margin] | None = None) -> Table:
    """The runs side by side: outcome, the timeline numbers (latency, queue wait, engine busy), padding waste, peak.

    ``margin``: one for every run, or each variant's own (by variant name)."""
    first = results[0]
    table = Table(title=f"{first.scenario}: variants on {first.backend} ({first.endpoint})", title_justify="left")
    columns = ("variant", "done", "OOM", "calls", "makespan s", "p50 lat s", "p95 lat s", "max lat s", "p95 wait s")
    extra = ("at risk",) if margin is not None else ()
    for column in (*columns, *extra, "busy", "waste", "tok/s", "peak GiB"):
        table.add_column(column, justify="left" if column == "variant" else "right")

    def sec(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for result in results:
        s = result.summary()
        own = margin.get(result.variant) if isinstance(margin, dict) else margin
        table.add_row(
            result.variant,
            f"{s['completed']}/{s['requests']}",
            f"[red]{s['oom_calls']}[/red]" if s["oom_calls"] else "0",
            str(s["calls"]),
            sec(s["makespan_s"]),
            sec(s["latency_p50_s"]),
            sec(s["latency_p95_s"]),
            sec(s["latency_max_s"]),
            sec(s["queue_wait_p95_s"]),
            *([_risk_cell(len(at_risk_calls(result, own)) if own is not None else 0)] if margin is not None else []),
            f"{s['engine_busy_fraction']:.0%}",
            f"{s['padding_waste']:.1%}",
            f"{s['tokens_per_s']:,.0f}",
            peak_text(s["peak_bytes_max"], own),
        )
    return table


def _risk_cell(count: int) -> str:
    return f"[yellow]{count}[/yellow]" if count else "0"


def print_run(console: Console, result: RunResult, show_calls: bool = True, margin: Margin | None = None) -> None:
    if show_calls:
        console.print(calls_table(result, margin=margin))
        moe_lines = [line for line in map(moe_line, result.calls) if line]
        if result.inference.get("routed_experts"):  # samples that ran on the sampler carry theirs in their outputs
            moe_lines += [moe_sample_line(r.id, r.outputs["moe"]) for r in result.requests if r.outputs.get("moe")]
        if moe_lines:
            console.print("[bold]routed-expert replay (R3)[/bold]")
            for line in moe_lines:
                console.print(f"  {line}", highlight=False)
    console.print(f"[bold]{result.variant}[/bold]: {summary_line(result, margin)}", soft_wrap=True)
    print_tenants(console, result, show_calls)
    totals = result.totals
    if totals:
        console.print(
            f"  workload: {totals['requests']} forward/forward_backward requests of {len(result.requests)} submitted "
            f"(blockers and other types included), {totals['tokens']:,} tokens; "
            f"unpadded slots (requests x longest) {totals['unpadded_slots']:,}"
        )
    for warning in sequence_failures(result):
        console.print(f"  [yellow]in sequence[/yellow]: {warning}")


def print_tenants(console: Console, result: RunResult, show_calls: bool = True) -> None:
    """A multi-tenant run's per-model table, fairness, swaps and host memory (and, with the calls, each swap)."""
    tenancy = tenancy_summary(result)
    if not is_multi_tenant(tenancy):
        return
    if show_calls:
        lines = swap_lines(result)
        if lines:
            console.print("[bold]adapter swaps[/bold]")
            for line in lines:
                console.print(f"  {line}", highlight=False)
    console.print(tenants_table([(result.backend, tenancy)], f"{result.variant}: per tenant"))
    console.print(f"  {tenancy_line(tenancy)}", highlight=False, soft_wrap=True)


def sequence_failures(result: RunResult) -> list[str]:
    """Calls that fail only because of what earlier calls of the run left on the device: each would fit alone."""
    return [
        f"call {call.index} fails only after earlier calls (they left {gib(call.oom.where.get('carried_bytes') or 0)} "
        "GiB held; alone it fits)"
        for call in result.oom_calls
        if call.oom is not None and call.oom.where.get("fails_only_after_earlier_calls")
    ]


def verdict_line(result: RunResult, verdict: Verdict) -> str:
    """The verdict of one run as one line: FAIL with its unmet expectations and the calls that ran out of memory, AT
    RISK with its calls inside the margin, or PASS with the run's summary (``results.verdict``)."""
    reasons = "; ".join(escape(reason) for reason in verdict.reasons)  # a quoted error may hold [brackets]
    if verdict.status == FAIL:
        return f"[red]FAIL[/red] {result.variant}: " + reasons
    if verdict.status != PASS:
        return f"[yellow]AT RISK[/yellow] {result.variant}: " + reasons
    return f"[green]PASS[/green] {result.variant}: {summary_line(result, verdict.margin)}"

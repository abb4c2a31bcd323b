"""``check --explain``: the memory timeline of each failing call, condensed for a terminal.

The walk's timeline has one row per segment (embedding, each layer's forward, the LM head, each layer's backward) of
the micro-batch that set the peak or failed, and one row per op of the failing segment. Here consecutive layers of
the same phase collapse into ranges, the peak is marked, and the failing segment is printed op by op.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from skyrl_sim.result import RunResult
from skyrl_sim.units import gib


def condensed_rows(timeline: list[dict[str, Any]], keep_ops: int = 12) -> list[dict[str, Any]]:
    """Segment rows merged into runs of consecutive layers per phase; the failing segment's last ops kept as they are."""
    segments = [row for row in timeline if "failed" not in row]
    failing = [row for row in timeline if "failed" in row]
    out: list[dict[str, Any]] = []
    for row in segments:
        last = out[-1] if out else None
        numeric = isinstance(row["layer"], int)
        if last and numeric and last["phase"] == row["phase"] and isinstance(last["last_layer"], int):
            last["last_layer"] = row["layer"]
            last["allocated"] = row["allocated"]
            if row["peak"] > last["peak"]:
                last["peak"], last["op"], last["bytes"] = row["peak"], row["op"], row["bytes"]
            continue
        out.append({**row, "first_layer": row["layer"], "last_layer": row["layer"]})
    for row in failing[-keep_ops:]:
        out.append({**row, "first_layer": row["layer"], "last_layer": row["layer"], "peak": row["allocated"]})
    return out


def explain_table(result: RunResult) -> list[Table]:
    """One table per call that ran out of memory."""
    tables = []
    for call in result.oom_calls:
        assert call.oom is not None
        timeline = (call.memory or {}).get("timeline") or []
        where = call.oom.where
        title = (
            f"{result.variant} call {call.index}: OOM in {where.get('phase')} at layer {where.get('layer')}, "
            f"{where.get('op')} {where.get('shape')} {where.get('dtype')}, tried {gib(call.oom.attempted_bytes)} GiB "
            f"with {gib(call.oom.allocated_bytes or 0)} of {gib(call.oom.capacity_bytes or 0)} GiB allocated"
        )
        table = Table(title=title, title_justify="left")
        for column in ("mb", "phase", "layers", "op at peak / op", "bytes GiB", "peak GiB", "allocated after GiB", ""):
            table.add_column(column, justify="left" if column in ("phase", "layers", "op at peak / op", "") else "right")
        rows = condensed_rows(timeline)
        top = max((r["peak"] for r in rows if "failed" not in r), default=0)
        for row in rows:
            first, last = row["first_layer"], row["last_layer"]
            layers = str(first) if first == last else f"{first}-{last}" if first < last else f"{first}..{last}"
            mark = ""
            if row.get("failed"):
                mark = "[red]FAILED[/red]"
            elif "failed" not in row and row["peak"] == top:
                mark = "[bold]peak[/bold]"
            stage = row.get("stage")
            phase = row["phase"] if not stage or stage == row["phase"] else f"{row['phase']} ({stage})"
            table.add_row(
                str(row.get("microbatch", "")),
                phase,
                layers,
                row["op"],
                gib(row["bytes"]),
                gib(row["peak"]),
                gib(row["allocated"]),
                mark,
            )
        tables.append(table)
    return tables


def print_explain(console: Console, result: RunResult) -> None:
    for table in explain_table(result):
        console.print(table)

"""Terminal views of a run's tenants (``summary["tenancy"]``, defined in ``skyrl_sim.results.tenants``): the
per-model table, the fairness line, the adapter swaps and the host memory of the adapter store, and the calls that
swapped. ``run`` and ``check`` print them for a run with more than one model id; ``compare`` and ``replay`` print the
table with both sides."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from skyrl_sim.results.result import RunResult
from skyrl_sim.units import format_size


def _sec(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def is_multi_tenant(tenancy: dict[str, Any]) -> bool:
    """Whether a run served more than one model id, or swapped adapters at all."""
    return len(tenancy.get("tenants") or {}) > 1 or bool(tenancy.get("swaps"))


def tenants_table(sides: list[tuple[str, dict[str, Any]]], title: str) -> Table:
    """One row per model id: requests, completed, failed, latency p50/p95 and queue wait p95 of each side."""
    table = Table(title=title, title_justify="left")
    table.add_column("model id")
    many = len(sides) > 1
    for label, _ in sides:
        suffix = f" {label}" if many else ""
        for column in ("requests", "done", "failed", "p50 lat s", "p95 lat s", "p95 wait s"):
            table.add_column(column + suffix, justify="right")
    models = list(dict.fromkeys(m for _, tenancy in sides for m in tenancy.get("tenants") or {}))
    for model in models:
        cells: list[str] = [model]
        for _, tenancy in sides:
            row = (tenancy.get("tenants") or {}).get(model)
            if row is None:
                cells += ["-"] * 6
                continue
            cells += [
                str(row["requests"]),
                str(row["completed"]),
                f"[red]{row['failed']}[/red]" if row["failed"] else "0",
                _sec(row["latency_p50_s"]),
                _sec(row["latency_p95_s"]),
                _sec(row["queue_wait_p95_s"]),
            ]
        table.add_row(*cells)
    return table


def fairness_text(tenancy: dict[str, Any]) -> str:
    ratio = tenancy.get("fairness_p95")
    return "fairness: -" if ratio is None else f"fairness: worst tenant's p95 latency is {ratio:.2f}x the best's"


def tenancy_line(tenancy: dict[str, Any]) -> str:
    """Fairness, adapter swaps (count, time, share of engine time) and the adapter store's host memory."""
    parts = [fairness_text(tenancy)]
    parts.append(
        f"{tenancy.get('swaps', 0)} adapter swaps, {tenancy.get('swap_s', 0.0):.3f} s "
        f"({tenancy.get('swap_share_of_engine', 0.0):.2%} of engine time), "
        f"{format_size(tenancy.get('swap_bytes', 0))} moved"
    )
    slot = tenancy.get("slot_bytes")
    if slot is not None:
        peak = format_size(tenancy.get("host_bytes_peak") or 0)
        host = f"host memory per worker: slots {format_size(slot)} each, peak {peak}"
        limit = tenancy.get("host_memory_bytes")
        parts.append(host + (f" of {format_size(limit)}" if limit is not None else " (no limit set)"))
    return "; ".join(parts)


def swap_lines(result: RunResult) -> list[str]:
    """One line per call that swapped adapters: what was saved and restored, the bytes and the time."""
    lines = []
    for call in result.calls:
        swap = call.extra.get("swap")
        if not swap:
            continue
        saved = swap["saved"] if swap["saved"] is not None else "(nothing: live state pristine or unloaded)"
        lines.append(
            f"#{call.index} {call.kind} {call.model_id}: saved {saved}, restored {swap['restored']}, "
            f"{format_size(swap['bytes'])} in {swap['seconds'] * 1e3:.2f} ms"
        )
    return lines

"""The views of a comparison (``results.comparison``): the call-by-call, request and summary tables, the per-tenant and
vLLM tables, the tolerance verdict line, and one PNG per variant of memory and duration per call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from skyrl_sim.reports.tenants import is_multi_tenant, tenancy_line, tenants_table
from skyrl_sim.results.comparison import ERROR_METRICS, STATS, CallDiff, Comparison, VariantComparison
from skyrl_sim.results.outputs import safe_name, write_with
from skyrl_sim.units import format_bytes, pct


def _mark(ok: bool) -> str:
    return "[green]=[/green]" if ok else "[red]≠[/red]"


def _ids(ids: list[int] | None) -> str:
    if ids is None:
        return "-"
    return ",".join(map(str, ids)) if len(ids) <= 3 else f"{ids[0]}..{ids[-1]} ({len(ids)})"


def _shape_text(diff: CallDiff) -> str:
    if diff.shape_equal:
        s = diff.shape_a or {}
        return f"= {s.get('padded_rows', '?')} x {s.get('width', '?')} / {s.get('microbatches', '?')}" if s else "="
    return f"[red]≠[/red] {diff.shape_a} vs {diff.shape_b}"


def _oom_text(d: CallDiff) -> str:
    sides = []
    for present, oom, tried, error in (
        (d.kind_a is not None, d.oom_a, d.attempted_a, d.error_a),
        (d.kind_b is not None, d.oom_b, d.attempted_b, d.error_b),
    ):
        sides.append("-" if not present else (f"OOM {format_bytes(tried)}" if oom else "error" if error else "ok"))
    text = " / ".join(sides)
    if not d.oom_agree:
        return f"[red]{text} ✗[/red]"
    return text + (f" ({pct(d.attempted_error)})" if d.attempted_error is not None else "")


def calls_table(comparison: VariantComparison) -> Table:
    c = comparison
    table = Table(title=f"{c.variant}: {c.backend_a} (A) vs {c.backend_b} (B), call by call", title_justify="left")
    for column in ("#", "kind", "requests", "batch", "shape rows x width / mb", "peak A / B", "err", "OOM A / B (tried)"):
        table.add_column(column)
    table.add_column("dur A / B s", justify="right")
    table.add_column("err", justify="right")
    for d in c.calls:
        duration = "-" if d.duration_a is None or d.duration_b is None else f"{d.duration_a:.3f} / {d.duration_b:.3f}"
        table.add_row(
            str(d.index),
            d.kind_a or d.kind_b or "-",
            _ids(d.request_ids_a) if d.batch_equal else f"{_ids(d.request_ids_a)} | {_ids(d.request_ids_b)}",
            _mark(d.batch_equal),
            _shape_text(d),
            f"{format_bytes(d.peak_a)} / {format_bytes(d.peak_b)}",
            pct(d.peak_error),
            _oom_text(d),
            duration,
            pct(d.duration_error),
        )
    return table


def requests_table(comparison: VariantComparison, worst: int = 10) -> Table:
    """The requests whose latency (or outcome) differs most."""
    ranked = sorted(
        comparison.requests,
        key=lambda r: (r.status_equal, -abs(r.latency_error) if r.latency_error is not None else 0.0),
    )[:worst]
    table = Table(title=f"{comparison.variant}: requests, worst {len(ranked)} by latency error", title_justify="left")
    for column in ("id", "status A/B", "latency A s", "latency B s", "err"):
        table.add_column(column)
    for r in ranked:
        table.add_row(
            str(r.id),
            f"{r.status_a}/{r.status_b}" + ("" if r.status_equal else " [red]✗[/red]"),
            "-" if r.latency_a is None else f"{r.latency_a:.3f}",
            "-" if r.latency_b is None else f"{r.latency_b:.3f}",
            pct(r.latency_error),
        )
    return table


def summary_table(rows: list[tuple[str, dict[str, Any]]]) -> Table:
    """Per variant (and overall): identity, OOM agreement, median / p95 / max absolute error per metric."""
    table = Table(title="summary (absolute errors as median / p95 / max)", title_justify="left")
    table.add_column("metric")
    for name, _ in rows:
        table.add_column(name)
    table.add_row("calls A / B", *[f"{s['calls_a']} / {s['calls_b']}" for _, s in rows])
    table.add_row("calls identical", *[_mark(s["calls_identical"]) for _, s in rows])
    table.add_row("adapter swaps identical", *[_mark(s.get("swaps_identical", True)) for _, s in rows])
    table.add_row("OOM agreement", *[f"{s['oom_agreement']:.0%}" for _, s in rows])
    sites = [s.get("oom_site_agreement") for _, s in rows]
    table.add_row("OOM site agreement", *["-" if v is None else f"{v:.0%}" for v in sites])
    table.add_row("status agreement", *[f"{s['status_agreement']:.0%}" for _, s in rows])
    for metric in ERROR_METRICS:
        cells = [" / ".join(pct(s[f"{metric}_error_{stat}"]) for stat in STATS) for _, s in rows]
        table.add_row(f"{metric.replace('_', ' ')} error", *cells)
    if any("stage_peak_memory_error_max" in s for _, s in rows):
        cells = [" / ".join(pct(s.get(f"stage_peak_memory_error_{stat}")) for stat in STATS) for _, s in rows]
        table.add_row("peak memory per pipeline stage error", *cells)
    return table


def print_tenants(console: Console, variant: VariantComparison) -> None:
    """The per-tenant table of both sides and each side's fairness, swaps and host memory (multi-tenant runs)."""
    a, b = variant.tenancy.get("a") or {}, variant.tenancy.get("b") or {}
    if not (is_multi_tenant(a) or is_multi_tenant(b)):
        return
    sides = [(f"A ({variant.backend_a})", a), (f"B ({variant.backend_b})", b)]
    console.print(tenants_table([("A", a), ("B", b)], f"{variant.variant}: per tenant, A against B"))
    for label, tenancy in sides:
        console.print(f"  {label}: {tenancy_line(tenancy)}", highlight=False, soft_wrap=True)


def inference_table(comparison: VariantComparison) -> Table:
    """The two sides' vLLM numbers (``results.inference``) beside each other."""
    table = Table(title=f"{comparison.variant}: vLLM", title_justify="left")
    table.add_column("metric")
    table.add_column(f"A {comparison.backend_a}")
    table.add_column(f"B {comparison.backend_b}")
    a, b = comparison.inference.get("a") or {}, comparison.inference.get("b") or {}
    for key in (*a, *(k for k in b if k not in a)):
        table.add_row(key.replace("_", " "), str(a.get(key, "-")), str(b.get(key, "-")))
    return table


def print_comparison(console: Console, comparison: Comparison, show_requests: bool = True) -> None:
    for variant in comparison.variants:
        console.print(calls_table(variant))
        if show_requests and variant.requests:
            console.print(requests_table(variant))
        print_tenants(console, variant)
        if variant.inference:
            console.print(inference_table(variant))
    rows = [(v.variant, v.summary) for v in comparison.variants]
    if len(rows) > 1:
        rows.append(("all", comparison.summary))
    console.print(summary_table(rows))
    problems = comparison.violations()
    if problems:
        console.print("[red]FAIL[/red] tolerances exceeded: " + "; ".join(problems))
    elif comparison.tolerances:
        console.print(
            "[green]PASS[/green] within tolerances: " + ", ".join(f"{k} {v}" for k, v in comparison.tolerances.items())
        )


def write_plots(comparison: Comparison, directory: str | Path) -> list[Path]:
    """Per variant, one PNG: peak memory and duration per call, A beside B, OOM calls marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir = Path(directory)
    written: list[Path] = []
    for v in comparison.variants:
        fig, (mem, dur) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
        x = np.arange(len(v.calls))
        width = 0.4
        peak_a = [(d.peak_a or 0) / 2**20 for d in v.calls]
        peak_b = [(d.peak_b or 0) / 2**20 for d in v.calls]
        mem.bar(x - width / 2, peak_a, width, label=f"A {v.backend_a}")
        mem.bar(x + width / 2, peak_b, width, label=f"B {v.backend_b}")
        for d in v.calls:
            if d.oom_a or d.oom_b:
                mem.annotate("OOM", (d.index, max(peak_a[d.index], peak_b[d.index])), ha="center", color="red")
        mem.set_ylabel("peak memory (MiB)")
        mem.legend()
        dur.bar(x - width / 2, [d.duration_a or 0 for d in v.calls], width, label=f"A {v.backend_a}")
        dur.bar(x + width / 2, [d.duration_b or 0 for d in v.calls], width, label=f"B {v.backend_b}")
        dur.set_ylabel("call duration (s)")
        dur.set_xlabel("call")
        dur.xaxis.set_major_locator(MaxNLocator(integer=True))
        dur.legend()
        fig.suptitle(f"{comparison.scenario} / {v.variant}")
        fig.tight_layout()
        path = out_dir / f"{safe_name(comparison.scenario)}-{safe_name(v.variant)}.png"
        write_with(path, lambda temp, fig=fig: fig.savefig(temp, dpi=90))
        plt.close(fig)
        written.append(path)
    return written

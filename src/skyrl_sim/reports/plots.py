"""PNG plots of RunResults (matplotlib, Agg): views of the result data, written by ``--plots DIR``.

- ``memory_<variant>.png``: allocated memory over the ops of one call (the call that ran out of memory, else the one
  with the highest peak) from the memory model's timeline, with the capacity line and the OOM point; when calls carry
  no timeline, each call's peak against the capacity.
- ``gantt_<variant>.png``: the engine's calls over time (coloured by outcome) above every request's life from
  submission to completion, with its completion marked.
- ``latency_cdf.png``: the request latency CDF of each variant, one line per variant.

Every figure has a fixed size in pixels (``FIGSIZE`` at ``DPI``) so reports line up and tests can check it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from skyrl_sim.reports.sampling_plot import plot_sampling  # noqa: E402
from skyrl_sim.results.outputs import safe_name, write_with  # noqa: E402
from skyrl_sim.results.result import CallRecord, RunResult  # noqa: E402
from skyrl_sim.results.timeline import TimelineRow, timeline_of  # noqa: E402
from skyrl_sim.units import GIB  # noqa: E402

DPI = 100
FIGSIZE = (12.0, 6.0)
"""1200 x 600 pixels."""
OK, OOM, ERROR, IDLE = "#2e7d32", "#c62828", "#ef6c00", "#9e9e9e"
KIND_COLOURS = {
    "forward_backward": "#1565c0",
    "forward": "#42a5f5",
    "sample": "#8e24aa",
    "optim_step": "#00897b",
}
GANTT_REQUEST_LINES = 2000
"""Above this many requests the Gantt draws completion points only (lines would be a solid block)."""


def _figure(rows: int = 1, height_ratios: list[float] | None = None) -> tuple[Figure, Any]:
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=FIGSIZE,
        dpi=DPI,
        squeeze=False,
        gridspec_kw={"height_ratios": height_ratios} if height_ratios else None,
    )
    return fig, axes[:, 0]


def _save(fig: Figure, path: Path) -> Path:
    write_with(path, lambda temp: fig.savefig(temp, dpi=DPI))
    plt.close(fig)
    return path


def memory_call(result: RunResult) -> CallRecord | None:
    """The call whose memory is worth a look: the first that ran out of memory, else the one with the highest peak."""
    if result.oom_calls:
        return result.oom_calls[0]
    with_peak = [c for c in result.calls if c.peak_bytes is not None]
    return max(with_peak, key=lambda c: c.peak_bytes or 0) if with_peak else None


CAPACITY_IN_VIEW = 2.0
"""The memory plot's y axis reaches the capacity line when the capacity is at most this many times the highest point
drawn; further above, the axis fits the data (a 23 GiB call under a 138 GiB capacity would be a flat line at the
bottom) and the capacity is written at the top edge with the headroom."""


def memory_axis_top(high_gib: float, capacity_gib: float | None) -> tuple[float, bool]:
    """The top of the memory plot's y axis, and whether the capacity line is inside it."""
    if capacity_gib and capacity_gib <= CAPACITY_IN_VIEW * high_gib:
        return max(high_gib, capacity_gib) * 1.08, True
    return max(high_gib, 1e-9) * 1.15, False


def plot_memory(result: RunResult, path: str | Path) -> Path:
    """Memory over one call's ops, the capacity line and the OOM point (or per-call peaks without a timeline)."""
    return _save(memory_figure(result), Path(path))


def memory_figure(result: RunResult) -> Figure:
    """The memory plot. With a timeline it draws, per row (a segment, or an op of the failing segment), the highest
    bytes the row reached (``TimelineRow.high``: a segment's in-op peak, the table's peak at the call's highest
    point) and the bytes allocated after it; the y axis fits what is drawn (``memory_axis_top``)."""
    fig, (ax,) = _figure()
    call = memory_call(result)
    timeline = timeline_of(call) if call else []
    capacity = result.capacity_bytes
    capacity_gib = capacity / GIB if capacity else None
    if call is not None and timeline:
        made = [row for row in timeline if not row.failed]  # the failed allocation was never made: the X marks it
        allocated = [row.allocated / GIB for row in made]
        highs = [row.high / GIB for row in made]
        xs = range(len(allocated))
        ax.fill_between(xs, allocated, highs, step="mid", color=KIND_COLOURS["forward_backward"], alpha=0.25, lw=0)
        line = KIND_COLOURS["forward_backward"]
        ax.step(xs, highs, where="mid", color=line, lw=1.2, label="highest point within the step")
        ax.plot(xs, allocated, color=IDLE, lw=1.0, label="allocated after the step")
        ax.set_xlabel("step of the call: a layer segment, or an op of the failing segment (memory model's allocation walk)")
        ticks = layer_ticks(timeline)
        ax.set_xticks([i for i, _ in ticks], [label for _, label in ticks], fontsize=7, rotation=30, ha="right")
        high = max(highs, default=0.0)
        need = None
        if call.oom is not None:
            base = (call.oom.allocated_bytes if call.oom.allocated_bytes is not None else timeline[-1].allocated) / GIB
            need = base + call.oom.attempted_bytes / GIB
            high = max(high, need)
        drawn = high
        top, in_view = memory_axis_top(high, capacity_gib)
        if need is not None:
            top = max(top, need * 1.18)  # room above the OOM point for its label
        ax.set_ylim(0, top)
        phases: dict[str, int] = {}
        for i, row in enumerate(timeline):
            phases.setdefault(row.phase, i)
        for phase, start in phases.items():
            if phase and start:
                ax.axvline(start, color=IDLE, lw=0.6, ls=":")
                ax.text(start, top * 0.02, f" {phase}", color=IDLE, fontsize=8, rotation=90, va="bottom")
        peak = f", peak {call.peak_bytes / GIB:.2f} GiB" if call.peak_bytes is not None else ""
        title = f"call {call.index} ({call.kind}, {call.padded_rows} x {call.width:,}){peak}"
        if call.oom is not None and need is not None:
            at = len(timeline) - 1
            ax.scatter([at], [need], color=OOM, marker="X", s=90, zorder=5, label="OOM: would need")
            where = f"{call.oom.where.get('phase', '')} {call.oom.where.get('op', '')}"
            ax.annotate(  # left of the X, at its height: above the allocation curve, which stays below capacity
                f"tried to allocate {call.oom.attempted_bytes / GIB:.2f} GiB\n{where}",
                (at, need),
                textcoords="offset points",
                xytext=(-14, 0),
                va="center",
                ha="right",
                color=OOM,
                fontsize=9,
                bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "edgecolor": OOM, "alpha": 0.9},
            )
    else:
        calls = [c for c in result.calls if c.peak_bytes is not None]
        xs_calls = [c.index for c in calls]
        peaks = [(c.peak_bytes or 0) / GIB for c in calls]
        ax.bar(xs_calls, peaks, color=[OOM if c.oom else OK for c in calls], label="peak")
        oom = [c for c in calls if c.oom is not None]
        needs = [((c.oom.allocated_bytes or c.peak_bytes or 0) + c.oom.attempted_bytes) / GIB for c in oom if c.oom]
        if oom:
            ax.scatter([c.index for c in oom], needs, color=OOM, marker="X", s=90, zorder=5, label="OOM: would need")
        drawn = max([*peaks, *needs], default=0.0)
        top, in_view = memory_axis_top(drawn, capacity_gib)
        ax.set_ylim(0, top)
        ax.set_xlabel("call")
        title = "peak memory per call (no allocation timeline in this result)"
    if capacity_gib and in_view:
        ax.axhline(capacity_gib, color=OOM, ls="--", lw=1.0, label=f"capacity {capacity_gib:.1f} GiB")
    elif capacity_gib:
        ax.annotate(
            f"capacity {capacity_gib:.1f} GiB above this axis ({capacity_gib - drawn:.1f} GiB over the highest point)",
            (0.99, 0.98),
            xycoords="axes fraction",
            ha="right",
            va="top",
            color=OOM,
            fontsize=9,
        )
    ax.set_ylabel("GiB per device")
    ax.set_title(f"{result.scenario} / {result.variant}: memory, {title}")
    ax.legend(loc="lower right", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def layer_ticks(timeline: list[TimelineRow], most: int = 14) -> list[tuple[int, str]]:
    """Tick positions and labels where the walk enters a new (phase, layer), thinned to at most ``most`` ticks."""
    starts: list[tuple[int, str]] = []
    last: tuple[str, str] | None = None
    for i, row in enumerate(timeline):
        phase = row.stage or row.phase or ""
        layer = row.layer
        key = (phase, str(layer))
        if key != last:
            name = f"L{layer}" if isinstance(layer, int) else str(layer)
            starts.append((i, f"{phase[:8]} {name}".strip()))
            last = key
    step = max(1, -(-len(starts) // most))
    return starts[::step]


def _call_colour(call: CallRecord) -> str:
    if call.oom is not None:
        return OOM
    if call.error:
        return ERROR
    return KIND_COLOURS.get(call.kind, IDLE)


def plot_gantt(result: RunResult, path: str | Path) -> Path:
    """The engine's calls over time and every request's life (submission to completion, completion marked)."""
    fig, (engine, requests) = _figure(2, [1, 3])
    lanes = sorted({c.kind for c in result.calls}, key=lambda k: (k not in KIND_COLOURS, k))
    lane_of = {kind: i for i, kind in enumerate(lanes)}
    label_calls = len(result.calls) <= 40
    for call in result.calls:
        # white edges keep back-to-back calls apart (they would merge into one bar)
        engine.barh(
            lane_of[call.kind],
            max(call.duration_s, 1e-9),
            left=call.start_s,
            height=0.7,
            color=_call_colour(call),
            edgecolor="white",
            linewidth=0.8,
        )
        if label_calls:
            engine.text(
                call.start_s + call.duration_s / 2, lane_of[call.kind], f"#{call.index}", ha="center", va="center",
                fontsize=6, color="white", clip_on=True,
            )
    engine.set_yticks(range(len(lanes)), lanes, fontsize=8)
    engine.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
    engine.invert_yaxis()
    engine.set_title(f"{result.scenario} / {result.variant}: engine calls (red: OOM) and requests")
    engine.grid(axis="x", alpha=0.3)
    done = [r for r in result.requests if r.submitted_s is not None and r.completed_s is not None]
    if len(done) <= GANTT_REQUEST_LINES:
        for r in done:
            assert r.submitted_s is not None and r.completed_s is not None
            if r.started_s is not None:
                requests.hlines(r.id, r.submitted_s, r.started_s, color=IDLE, lw=0.8)
                requests.hlines(r.id, r.started_s, r.completed_s, color=KIND_COLOURS["forward_backward"], lw=1.2)
            else:
                requests.hlines(r.id, r.submitted_s, r.completed_s, color=IDLE, lw=0.8)
    for status, colour in (("completed", OK), ("failed", OOM)):
        points = [r for r in done if r.status == status]
        if points:
            requests.scatter(
                [r.completed_s for r in points], [r.id for r in points], color=colour, s=8, zorder=3, label=f"{status}"
            )
    requests.set_xlabel("seconds since the run started")
    requests.set_ylabel("request id")
    requests.invert_yaxis()
    requests.grid(alpha=0.3)
    if done:
        requests.legend(loc="lower left", fontsize=8, title="grey: queued, blue: running", title_fontsize=8)
    requests.sharex(engine)
    fig.tight_layout()
    return _save(fig, Path(path))


def plot_latency_cdf(results: list[RunResult], path: str | Path) -> Path:
    """Latency CDF of the completed requests, one line per run (variant)."""
    fig, (ax,) = _figure()
    runs = [(result, sorted(r.latency_s for r in result.completed if r.latency_s is not None)) for result in results]
    longest = max((lat[-1] for _, lat in runs if lat), default=1.0)
    for result, latencies in runs:
        n = len(result.requests)
        # every line starts at (0, 0) and runs on flat to the longest latency of any run, with a marker per request,
        # so a run with one or two completions (the no-cap drain) is a visible line, not a lone invisible step
        xs = [0.0, *latencies, longest * 1.02]
        ys = [0.0, *[(i + 1) / n for i in range(len(latencies))], len(latencies) / max(n, 1)]
        label = f"{result.variant} ({len(latencies)}/{n} completed)"
        ax.step(xs, ys, where="post", label=label, lw=1.5, marker="o", markersize=3, markevery=list(range(1, len(xs) - 1)))
    ax.set_xlabel("request latency, submitted to completed (s)")
    ax.set_ylabel("fraction of requests completed")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{results[0].scenario if results else ''}: latency CDF per variant (failed requests never reach 1)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=9)
    return _save(fig, Path(path))


def write_plots(results: list[RunResult], directory: str | Path) -> list[Path]:
    """Every plot of the runs into ``directory`` (created); returns the files written."""
    out = Path(directory)  # created by the first plot's write (outputs.atomic_path)
    written: list[Path] = []
    names = [safe_name(r.variant) for r in results]
    if len(set(names)) != len(names):
        names = [f"{i}_{n}" for i, n in enumerate(names)]
    for result, name in zip(results, names, strict=True):
        written.append(plot_memory(result, out / f"memory_{name}.png"))
        written.append(plot_gantt(result, out / f"gantt_{name}.png"))
        if result.inference.get("engines"):
            written.append(plot_sampling(result, out / f"sampling_{name}.png"))
    written.append(plot_latency_cdf(results, out / "latency_cdf.png"))
    return written


HEATMAP_METRICS = {
    "latency_p95_s": "p95 request latency (s)",
    "makespan_s": "makespan (s)",
    "queue_wait_p95_s": "p95 queue wait (s)",
    "padding_waste": "padding waste (fraction)",
    "peak_bytes_max": "peak memory (GiB)",
}


@dataclass
class HeatmapCells:
    """One heatmap facet's cells: the coloured values (NaN where the point failed or has no number) and the text."""

    values: Any
    labels: list[list[str]]
    failed: list[list[bool]]


def heatmap_cells(sweep: Any, metric: str, facet: dict[str, Any]) -> HeatmapCells:
    """The cells of one facet. A failing point (OOM or not passing) is never coloured: its number could be the best
    on the scale (a call that ran out of memory early finishes soonest), so it gets no colour, only its verdict and
    its number as text, and is hatched grey."""
    import numpy as np

    axes = list(sweep.axes)
    x_axis = axes[0] if axes else None
    y_axis = axes[1] if len(axes) > 1 else None
    xs = list(x_axis.values) if x_axis else [""]
    ys = list(y_axis.values) if y_axis else [""]
    grid = np.full((len(ys), len(xs)), np.nan)
    labels = [["" for _ in xs] for _ in ys]
    failed = [[False for _ in xs] for _ in ys]
    for point in sweep.points:
        if any(point.settings.get(k) != v for k, v in facet.items()):
            continue
        i = ys.index(point.settings[y_axis.key]) if y_axis else 0
        j = xs.index(point.settings[x_axis.key]) if x_axis else 0
        raw = point.summary.get(metric)
        value = None if raw is None else (raw / GIB if metric == "peak_bytes_max" else raw)
        text = "-" if value is None else (f"{value:.0%}" if metric == "padding_waste" else f"{value:.3g}")
        verdict = "OOM" if point.oom else ("" if point.passed else point.verdict)  # AT RISK or FAIL
        failed[i][j] = bool(verdict)
        if not verdict and value is not None:
            grid[i, j] = value
        labels[i][j] = f"{verdict}\n{text}" if verdict else text
    return HeatmapCells(grid, labels, failed)


def plot_sweep_heatmap(sweep: Any, path: str | Path, metric: str = "latency_p95_s") -> list[Path]:
    """A heatmap of one summary number over the first two grid axes (one file per combination of any further axes).

    Passing cells are coloured by the number; failing cells (OOM, FAIL) are grey and hatched, outside the colour
    scale, with the verdict and the number as text.
    """
    import numpy as np
    from matplotlib.patches import Rectangle

    if metric not in HEATMAP_METRICS:
        raise ValueError(f"unknown heatmap metric '{metric}' (known: {', '.join(HEATMAP_METRICS)})")
    axes = list(sweep.axes)
    x_axis = axes[0] if axes else None
    y_axis = axes[1] if len(axes) > 1 else None
    rest = axes[2:]
    out = Path(path)
    written: list[Path] = []
    facets = [dict(zip([a.key for a in rest], combo, strict=True)) for combo in _product([a.values for a in rest])]
    for n, facet in enumerate(facets):
        xs = list(x_axis.values) if x_axis else [""]
        ys = list(y_axis.values) if y_axis else [""]
        cells = heatmap_cells(sweep, metric, facet)
        fig, (ax,) = _figure()
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#ffffff")
        image = ax.imshow(np.ma.masked_invalid(cells.values), cmap=cmap, aspect="auto", origin="lower")
        fig.colorbar(image, ax=ax, label=HEATMAP_METRICS[metric] + " (passing points)")
        for i in range(len(ys)):
            for j in range(len(xs)):
                if cells.failed[i][j]:
                    ax.add_patch(
                        Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#d0d0d0", edgecolor="#616161", hatch="///", lw=0)
                    )
                colour = OOM if cells.failed[i][j] else "white"
                ax.text(j, i, cells.labels[i][j], ha="center", va="center", fontsize=8, color=colour, fontweight="bold")
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_yticks(range(len(ys)), [str(y) for y in ys])
        ax.set_xlabel(x_axis.key if x_axis else "")
        ax.set_ylabel(y_axis.key if y_axis else "")
        suffix = ", ".join(f"{k}={v}" for k, v in facet.items())
        ax.set_title(
            f"{Path(sweep.scenario).stem} / {sweep.variant}: {HEATMAP_METRICS[metric]}" + (f" ({suffix})" if suffix else "")
        )
        target = out if len(facets) == 1 else out.with_name(f"{out.stem}_{n}{out.suffix}")
        written.append(_save(fig, target))
    return written


def plot_pareto(advice: Any, path: str | Path) -> Path:
    """``advise``'s configurations: objective against headroom, the Pareto front joined, the margin shaded, the
    recommendation ringed; configurations that ran out of memory (no headroom to plot) stand in a strip at the left."""
    return _save(pareto_figure(advice), Path(path))


def pareto_figure(advice: Any) -> Figure:
    """The Pareto plot. A configuration's margin is its own (the band is a fraction of its peak, so configurations
    with different peaks have different margins): each is shaded from 0 to ``margin_bytes`` at the configuration's
    height, and a point is orange exactly when its verdict (``results.verdict``, the one the report prints) is AT
    RISK: a call inside its own margin, which always leaves the run's headroom inside the shade. With one margin for
    all (``--margin`` in GiB) the shade is one band."""
    fig, (ax,) = _figure()
    objective = advice.objective
    done = [c for c in advice.candidates if c.completes and c.headroom_bytes is not None]
    failed = [c for c in advice.candidates if not c.completes]
    margins = {c.margin_bytes for c in done}
    if len(margins) == 1:
        (margin,) = margins
        ax.axvspan(0, margin / GIB, color=ERROR, alpha=0.15, label=f"inside the margin ({margin / GIB:.2f} GiB)")
    elif done:
        ax.hlines(
            [c.objective(objective) for c in done],
            0,
            [c.margin_bytes / GIB for c in done],
            color=ERROR,
            alpha=0.25,
            lw=7,
            label="inside each configuration's margin (the band at its peak)",
        )
    if done:
        ax.scatter(
            [c.headroom_bytes / GIB for c in done],
            [c.objective(objective) for c in done],
            c=[ERROR if c.at_risk else OK for c in done],
            s=18,
            zorder=3,
            label="completes (orange: AT RISK)",
        )
    front = advice.front
    if front:
        ax.plot(
            [c.headroom_bytes / GIB for c in front],
            [c.objective(objective) for c in front],
            color="#1565c0",
            lw=1.2,
            label="Pareto front",
        )
    left = min([0.0, *[c.headroom_bytes / GIB for c in done]])
    span = max([left, *[c.headroom_bytes / GIB for c in done], *[c.margin_bytes / GIB for c in done]]) - left or 1.0
    strip = left - 0.12 * span
    finite = [c.objective(objective) for c in failed if c.summary.get(advice.objective_key) is not None]
    if failed:
        ax.scatter([strip] * len(finite), finite, marker="x", color=OOM, s=30, label="OOM / failed (no headroom)")
        ax.axvline(left - 0.06 * span, color=IDLE, lw=0.6, ls=":")
    if advice.recommended is not None:
        r = advice.recommended
        ax.scatter(
            [r.headroom_bytes / GIB],
            [r.objective(objective)],
            s=160,
            facecolors="none",
            edgecolors="black",
            zorder=4,
            label="recommended",
        )
    ax.set_xlabel("headroom at the highest peak, GiB (left strip: OOM)")
    ax.set_ylabel(getattr(advice, "objective_label", advice.objective_key))  # what is minimised: the number x GPUs
    ax.set_title(f"{Path(advice.scenario).stem} on {advice.endpoint}: {len(advice.candidates)} configurations")
    ax.legend(loc="best", fontsize=8)
    return fig


def _product(values: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    import itertools

    return list(itertools.product(*values))

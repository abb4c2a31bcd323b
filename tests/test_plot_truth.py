"""Plots show what the tables say: the memory plot draws each step's highest point (the table's peak at the call's
highest), its y axis fits what it draws (the capacity line is drawn when it is near, written at the top when far),
and the Pareto plot shades exactly the margin that makes a configuration AT RISK."""

from __future__ import annotations

import types
from typing import Any

import matplotlib.colors as mcolors
import pytest
from matplotlib.collections import LineCollection, PathCollection

from skyrl_sim.commands.advise_evaluation import Candidate
from skyrl_sim.reports.plots import ERROR, OK, memory_axis_top, memory_call, memory_figure, pareto_figure
from skyrl_sim.units import GIB


def line(ax: Any, label: str) -> Any:
    return next(item for item in ax.get_lines() if item.get_label() == label)


@pytest.fixture(scope="module")
def seed_runs(host) -> dict[str, Any]:
    from project_paths import SCENARIOS
    from skyrl_sim.schema.scenario import load_scenario

    scenario = load_scenario(SCENARIOS / "queue_drain_17.yaml")
    return {name: host.run(scenario.resolve(name), "sim") for name in scenario.variant_names}


def test_the_memory_plot_reaches_the_tables_peak(seed_runs) -> None:
    run = seed_runs["cap-aware"]
    call = memory_call(run)
    fig = memory_figure(run)
    (ax,) = fig.axes
    highest = max(line(ax, "highest point within the step").get_ydata())
    assert highest == pytest.approx(call.peak_bytes / GIB)  # 23.0 GiB, where "allocated after" tops out at 18.8
    assert max(line(ax, "allocated after the step").get_ydata()) < highest
    assert f"{call.peak_bytes / GIB:.2f} GiB" in ax.get_title()


def test_the_memory_axis_fits_the_data_and_says_where_the_capacity_is(seed_runs) -> None:
    run = seed_runs["cap-aware"]
    (ax,) = memory_figure(run).axes
    top = ax.get_ylim()[1]
    capacity = run.capacity_bytes / GIB
    assert memory_call(run).peak_bytes / GIB < top < capacity / 2  # 23 GiB is not flattened under 138 GiB
    assert not any(item.get_label().startswith("capacity") for item in ax.get_lines())
    assert any(f"capacity {capacity:.1f} GiB" in text.get_text() for text in ax.texts)


def test_an_oom_plot_shows_the_capacity_line_and_the_failed_allocation(seed_runs) -> None:
    run = seed_runs["no-cap"]
    (ax,) = memory_figure(run).axes
    capacity = run.capacity_bytes / GIB
    assert any(item.get_label() == f"capacity {capacity:.1f} GiB" for item in ax.get_lines())
    assert ax.get_ylim()[1] > capacity
    highest = max(line(ax, "highest point within the step").get_ydata())
    assert highest == pytest.approx(memory_call(run).peak_bytes / GIB)  # the failed allocation is the X, not a step


@pytest.mark.parametrize(("high", "capacity", "in_view"), [(23.0, 138.0, False), (100.0, 138.0, True), (5.0, None, False)])
def test_memory_axis_top(high: float, capacity: float | None, in_view: bool) -> None:
    top, shown = memory_axis_top(high, capacity)
    assert shown is in_view and top > high and (not shown or top > capacity)


def candidate(peak_gib: float, makespan: float) -> Candidate:
    """A configuration that completes with ``peak_gib`` held on 100 GiB, its margin the 5% band at its peak."""
    summary = {
        "held_bytes_max": int(peak_gib * GIB),
        "requests": 4,
        "completed": 4,
        "failed": 0,
        "oom_calls": 0,
        "makespan_s": makespan,
        "latency_p95_s": makespan,
        "padding_waste": 0.0,
        "peak_bytes_max": int(peak_gib * GIB),
    }
    band = int(0.05 * peak_gib * GIB)
    verdict = "AT RISK" if 100 * GIB - int(peak_gib * GIB) < band else "PASS"  # one call: its headroom is the run's
    return Candidate({"x": peak_gib}, summary, 100 * GIB, band, band, verdict)


def test_the_pareto_shade_is_each_configurations_own_margin() -> None:
    """The recommendation's margin (1 GiB at a 20 GiB peak) is not the margin of a 96 GiB configuration (4.8 GiB):
    with 4 GiB of headroom that one is AT RISK, and the plot shades it so."""
    recommended, tight, roomy = candidate(20, 3.0), candidate(96, 1.0), candidate(50, 2.0)
    advice = types.SimpleNamespace(
        objective="makespan",
        objective_key="makespan_s",
        candidates=[recommended, tight, roomy],
        front=[tight, roomy, recommended],
        recommended=recommended,
        scenario="s.yaml",
        endpoint="e",
    )
    assert tight.at_risk and not recommended.at_risk and not roomy.at_risk
    (ax,) = pareto_figure(advice).axes
    shade = next(c for c in ax.collections if isinstance(c, LineCollection) and "margin" in c.get_label())
    extent = {round(seg[0][1], 6): seg[1][0] for seg in shade.get_segments()}  # objective -> shaded headroom
    points = next(c for c in ax.collections if isinstance(c, PathCollection) and c.get_label().startswith("completes"))
    colours = [mcolors.to_hex(rgba) for rgba in points.get_facecolors()]
    for c, (x, y), colour in zip(advice.candidates, points.get_offsets(), colours, strict=True):
        inside = bool(x < extent[round(y, 6)])
        assert extent[round(y, 6)] == pytest.approx(c.margin_bytes / GIB)
        assert inside is c.at_risk
        assert colour == mcolors.to_hex(ERROR if c.at_risk else OK)


def test_one_margin_for_all_is_one_band() -> None:
    a, b = candidate(20, 3.0), candidate(96, 1.0)
    for c in (a, b):
        c.margin_bytes = 5 * GIB
    advice = types.SimpleNamespace(
        objective="makespan",
        objective_key="makespan_s",
        candidates=[a, b],
        front=[b, a],
        recommended=a,
        scenario="s.yaml",
        endpoint="e",
    )
    (ax,) = pareto_figure(advice).axes
    spans = [p for p in ax.patches if "margin" in p.get_label()]
    assert len(spans) == 1 and spans[0].get_x() == 0 and spans[0].get_width() == pytest.approx(5.0)
    assert b.at_risk and not a.at_risk

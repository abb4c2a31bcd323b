"""The built-in views ``run`` and ``check`` write after a run (``--trace PATH``, ``--plots DIR``), registered through
``skyrl_sim_report_writers`` like any plugin's: the CLI registers this plugin on the host it builds."""

from __future__ import annotations

from pathlib import Path

from skyrl_sim.plugin_host.hookspecs import ReportWriter, hookimpl
from skyrl_sim.results.result import RunResult

BUILTIN_REPORTS = "reports"
"""The name the built-in report writers are registered under."""


def write_trace_view(results: list[RunResult], target: str) -> str:
    from skyrl_sim.reports.trace import write_trace

    written = write_trace(results, target)
    return "" if target == "-" else f"trace: {written} (open in https://ui.perfetto.dev)"


def write_plot_views(results: list[RunResult], target: str) -> str:
    from skyrl_sim.reports.plots import write_plots

    paths = write_plots(results, Path(target))
    return f"plots: {len(paths)} PNGs in {target}"


class BuiltinReports:
    """The trace and the plots."""

    @hookimpl
    def skyrl_sim_report_writers(self) -> list[ReportWriter]:
        trace = "write a Chrome/Perfetto trace JSON of the run(s)"
        plots = "write PNG plots (memory, Gantt, latency CDF) into DIR"
        return [
            ReportWriter("--trace", "PATH", trace, write_trace_view, stdout=True),
            ReportWriter("--plots", "DIR", plots, write_plot_views, target="dir"),
        ]

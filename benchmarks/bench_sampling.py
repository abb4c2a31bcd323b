"""Benchmark: the simulator with samples served by its vLLM model (continuous sampling), 10^4 to 10^6 requests.

Targets (2-core machine): 10^5 sample requests (512-token outputs, ``num_samples`` 4) in at most 10 s; 10^6 mixed
requests (a quarter of them samples) in at most 90 s. Prints one line per workload and size: wall and CPU seconds,
seconds per 1k requests, the run's simulated makespan, vLLM steps and preemptions, peak resident memory, and the
seconds of a fixed pure-Python loop run just before (the machine's speed at that minute).

Workloads, on the seed's endpoint (``qwen3.6-27b-h200-tp4``: Qwen3.6-27B, H200), with ``inference.num_engines``
4 (TP 1 each) and SkyRL's other vLLM defaults:

- ``samples``: 100 clients, each submitting its share of sample requests back to back (0.01 s apart): prompts of
  256 tokens, 512 generated, 4 samples each. The engine admits them as they come; SkyRL's client cap (512 generate
  requests per engine) holds the rest, and the engines' continuous batching does the work;
- ``mixed``: 20 tenants, each repeating forward_backward (1-2 datums of 512-4,096 tokens), forward_backward,
  optim_step, sample (256-token prompt, 256 generated, 4 samples) at seeded times, so a quarter of the requests are
  samples and every sample is drained before the next pass of its iteration.

The endpoint colocates vLLM with the trainer, and a colocated vLLM has no weights until the first
``save_weights_for_sampler`` (SkyRL refuses to wake it): the first ``samples`` client and every ``mixed`` tenant sync
once first (one request more than N for ``samples``; within N for ``mixed``), so every sample is served.

Run: ``.venv/bin/python benchmarks/bench_sampling.py [--workload samples|mixed|both] [SIZES...]`` (default: samples
at 10^4 and 10^5, mixed at 10^5; ``--one WORKLOAD N`` measures one run in this process and prints JSON). Each run is
a fresh process.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "qwen3.6-27b-h200-tp4.yaml")
TARGETS = {("samples", 100_000): 10.0, ("mixed", 1_000_000): 90.0}
INFERENCE = {"inference.num_engines": 4}


def samples_document(total: int) -> dict[str, Any]:
    clients = 100
    return {
        "name": f"bench_samples_{total}",
        "endpoint": ENDPOINT,
        "workload": {
            "clients": [
                {
                    "name": f"c{i}",
                    "model_id": "policy",
                    "submit": {"mode": "back_to_back", "gap_s": 0.01},
                    # vLLM sleeps at level 2 when it starts beside the trainer and has no weights until the first
                    # save_weights_for_sampler (SkyRL refuses to wake it before): the first client syncs once
                    "requests": ([{"type": "save_weights_for_sampler", "checkpoint": "s"}] if i == 0 else [])
                    + [
                        {
                            "type": "sample",
                            "prompt_tokens": 256,
                            "max_tokens": 512,
                            "num_samples": 4,
                            "count": total // clients + (1 if i < total % clients else 0),
                        }
                    ],
                }
                for i in range(clients)
            ],
            "result_timeout_s": 2_000_000,
        },
        "variants": {"default": {"set": INFERENCE}},
    }


def mixed_document(total: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    tenants = 20
    clients = []
    for i in range(tenants):
        share = total // tenants + (1 if i < total % tenants else 0)
        requests: list[dict[str, Any]] = []
        times: list[float] = []
        t = rng.uniform(0, 5)
        # the tenant's adapter reaches vLLM once before its samples (a colocated vLLM has no weights until then)
        requests.append({"type": "save_weights_for_sampler", "checkpoint": "s"})
        times.append(round(t, 3))
        t += 1.0
        while len(requests) < share:
            for kind in ("forward_backward", "forward_backward", "optim_step", "sample"):
                if len(requests) == share:
                    break
                if kind == "forward_backward":
                    requests.append({"type": kind, "datums": [rng.randint(512, 4096) for _ in range(rng.randint(1, 2))]})
                elif kind == "sample":
                    requests.append({"type": kind, "prompt_tokens": 256, "max_tokens": 256, "num_samples": 4})
                else:
                    requests.append({"type": kind})
                times.append(round(t, 3))
                t += rng.uniform(2.0, 6.0)
        clients.append(
            {
                "name": f"tenant-{i}",
                "model_id": f"tenant-{i}",
                "submit": {"mode": "at_times", "gap_s": 0.005, "times_s": times},
                "requests": requests,
            }
        )
    return {
        "name": f"bench_mixed_{total}",
        "endpoint": ENDPOINT,
        "workload": {"clients": clients, "result_timeout_s": 2_000_000},
        "variants": {
            "default": {
                "set": {**INFERENCE, "engine.forward_backward_max_request_count": 8, "engine.cap_aware_padding": True}
            }
        },
    }


def interpreter_seconds() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(2_000_000):
        total += i % 7
    return time.perf_counter() - start


def one(workload: str, total: int) -> dict[str, Any]:
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.schema.scenario import load_scenario

    document = samples_document(total) if workload == "samples" else mixed_document(total)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.json"
        path.write_text(json.dumps(document))
        variant = load_scenario(path).resolve("default")
        reference = interpreter_seconds()
        wall, cpu = time.perf_counter(), time.process_time()
        result = PluginHost().run(variant, "sim")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    summary = result.summary()
    engines = result.inference.get("engines", [])
    return {
        "workload": workload,
        "requests": total,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "per_1k_s": round(wall / total * 1000, 4),
        "completed": summary["completed"],
        "makespan_s": round(summary["makespan_s"], 1),
        "vllm_steps": sum(e["steps"] for e in engines),
        "preemptions": sum(e["preemptions"] for e in engines),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "interpreter_seconds": round(reference, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int)
    parser.add_argument("--workload", choices=["samples", "mixed", "both"], default="both")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "N"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]))))
        return
    runs: list[tuple[str, int]] = []
    for workload in ("samples", "mixed") if args.workload == "both" else (args.workload,):
        sizes = args.sizes or ([10_000, 100_000] if workload == "samples" else [100_000])
        runs += [(workload, n) for n in sizes]
    for workload, total in runs:
        out = subprocess.run(
            [sys.executable, __file__, "--one", workload, str(total)], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            print(f"{workload} {total}: failed\n{out.stderr[-2000:]}")
            continue
        line = json.loads(out.stdout.strip().splitlines()[-1])
        target = TARGETS.get((workload, total))
        verdict = "" if target is None else (" MET" if line["wall_s"] <= target else " MISSED") + f" (target {target} s)"
        print(json.dumps(line) + verdict)


if __name__ == "__main__":
    main()

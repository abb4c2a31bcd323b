"""Benchmark: simulator wall time for a synthetic multi-tenant workload of 1k, 5k and 20k requests.

Target: 20,000 requests simulate in under 30 s, and the cost grows linearly with the request count (the seconds per
1,000 requests stay about flat from 1k to 20k). Prints one line per size and the verdicts.

The workload: ``TENANTS`` clients, each its own LoRA model on the seed's Qwen3.6-27B H200 TP-4 endpoint (with the
request-count cap and cap-aware padding, the fix the seed describes), submitting training steps at fixed times: a
forward_backward of 1-4 datums (512-8,192 tokens each), an optim_step after every ``STEP`` of them, and now and then
a save_weights_for_sampler followed by a sample. Arrivals are spread so the engine stays busy without an unbounded
backlog. Lengths come from a seeded RNG: every run simulates the same workload.

Two measurements per size: the full simulator (``host.run`` with the memory walk and the time model), and its core
without the memory walk (``--core``: the engine loop, the futures table, the shape rules and the time model, with a
memory model that returns at once), so a slow memory walk cannot hide how the core scales.

Run: ``.venv/bin/python benchmarks/bench_sim_scale.py [--core] [SIZES...]`` (default 1000 5000 20000).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from skyrl_sim_plugins.sim.backend import SimBackend

from skyrl_sim.costs import MemoryReport
from skyrl_sim.hookspecs import RunContext
from skyrl_sim.host import PluginHost
from skyrl_sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "qwen3.6-27b-h200-tp4.yaml")
TENANTS = 20
STEP = 4
SAMPLE_EVERY = 40
TARGET_20K_S = 30.0
SIZES = (1000, 5000, 20000)
WARMUP = 200


def tenant_requests(rng: random.Random, count: int, name: str) -> tuple[list[dict[str, Any]], list[float]]:
    """``count`` requests of one tenant and their submission times (seconds after the tenant starts)."""
    requests: list[dict[str, Any]] = []
    times: list[float] = []
    t = 0.0
    passes = 0
    while len(requests) < count:
        datums = [rng.randint(512, 8192) for _ in range(rng.randint(1, 4))]
        requests.append({"type": "forward_backward", "datums": datums})
        passes += 1
        t += rng.uniform(40.0, 80.0)
        times.append(t)
        if len(requests) < count and passes % STEP == 0:
            requests.append({"type": "optim_step"})
            times.append(t + 0.01)
        if len(requests) + 1 < count and passes % SAMPLE_EVERY == 0:
            checkpoint = f"{name}-{passes}"
            requests.append({"type": "save_weights_for_sampler", "checkpoint": checkpoint})
            times.append(t + 0.02)
            requests.append({"type": "sample", "checkpoint": checkpoint, "prompt_tokens": 512, "max_tokens": 256})
            times.append(t + 0.03)
    return requests[:count], times[:count]


def scenario_document(total: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    clients = []
    for i in range(TENANTS):
        share = total // TENANTS + (1 if i < total % TENANTS else 0)
        name = f"tenant-{i}"
        requests, times = tenant_requests(rng, share, name)
        clients.append(
            {
                "name": name,
                "model_id": name,
                "start_s": round(rng.uniform(0, 5), 3),
                "submit": {"mode": "at_times", "gap_s": 0.005, "times_s": times},
                "requests": requests,
            }
        )
    return {
        "name": f"multi_tenant_{total}",
        "endpoint": ENDPOINT,
        "workload": {"clients": clients},
        "variants": {
            "capped": {
                "set": {"engine.forward_backward_max_request_count": 8, "engine.cap_aware_padding": True},
                "expect": {"all_completed": True},
            }
        },
    }


class NoMemoryWalk:
    """A memory model that answers at once (for timing the simulator's core alone)."""

    def evaluate(self, shape: Any, endpoint: Any, model: Any, carried: Any = None) -> MemoryReport:
        return MemoryReport(peak_bytes=0)


def run(total: int, host: PluginHost, folder: Path, core: bool = False) -> tuple[float, dict[str, Any]]:
    """Wall seconds of one simulation (the summary gets its CPU seconds too: on a shared machine wall time swings)."""
    path = folder / f"multi_tenant_{total}.yaml"
    path.write_text(yaml.safe_dump(scenario_document(total), sort_keys=False))
    variant = load_scenario(path).resolve("capped")
    start, cpu = time.perf_counter(), time.process_time()
    if core:
        result = SimBackend(memory=NoMemoryWalk()).run(variant, RunContext(host=host, options={}))
    else:
        result = host.run(variant, "sim")
    elapsed = time.perf_counter() - start
    summary = result.summary()
    summary["cpu_s"] = time.process_time() - cpu
    assert summary["requests"] == total, summary
    return elapsed, summary


def main(sizes: tuple[int, ...] = SIZES, core: bool = False) -> int:
    host = PluginHost()
    rows = []
    print("simulator core without the memory walk" if core else "full simulator (memory walk + time model)")
    with tempfile.TemporaryDirectory() as tmp:
        run(WARMUP, host, Path(tmp), core)  # imports, plugin loading and per-endpoint caches stay out of the timings
        for total in sizes:
            elapsed, s = run(total, host, Path(tmp), core)
            rows.append((total, elapsed))
            print(
                f"{total:>6} requests: {elapsed:6.2f} s wall ({elapsed / total * 1000:.2f} s per 1k, "
                f"{s['cpu_s']:.2f} s CPU); "
                f"{s['calls']} calls, {s['completed']} completed, {s['failed']} failed, "
                f"simulated makespan {s['makespan_s']:.0f} s, p95 latency {s['latency_p95_s']:.1f} s",
                flush=True,
            )
    ok = True
    if rows[-1][0] == 20000:
        verdict = rows[-1][1] < TARGET_20K_S
        ok &= verdict
        print(f"20k target < {TARGET_20K_S:.0f} s: {'met' if verdict else 'MISSED'} ({rows[-1][1]:.2f} s)")
    if len(rows) > 1:
        per_k = [elapsed / total * 1000 for total, elapsed in rows]
        growth = per_k[-1] / per_k[0]
        linear = growth < 1.5
        ok &= linear
        shape = "linear" if linear else "SUPERLINEAR"
        print(f"seconds per 1k requests from {rows[0][0]} to {rows[-1][0]}: x{growth:.2f} ({shape})")
    return 0 if ok else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(tuple(int(a) for a in args if a != "--core") or SIZES, core="--core" in args))

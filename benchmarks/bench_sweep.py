"""Benchmark: a 100-point sweep of the seed's 17-request scenario on the simulator, in worker processes.

Target: under 60 s on 2 cores. The grid: 10 request-count caps x 5 micro-batch sizes x cap-aware padding on/off
(100 points of the ``cap-aware`` variant, pass = every request completes with no OOM). Prints the wall time, the
time per point and the find-max answer per micro size.

Run: ``.venv/bin/python benchmarks/bench_sweep.py [JOBS]`` (default: the CPU count).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from skyrl_sim.commands.executors import default_workers
from skyrl_sim.commands.sweep import find_max_in_grid, parse_grid, run_sweep

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = str(ROOT / "scenarios" / "queue_drain_17.yaml")
CAP = "engine.forward_backward_max_request_count"
GRID = [
    f"{CAP}=1,2,3,4,5,6,8,10,12,16",
    "trainer.micro_train_batch_size_per_gpu=1,2,4,8,16",
    "engine.cap_aware_padding=true,false",
]
TARGET_S = 60.0


def main(jobs: int) -> int:
    axes = parse_grid(GRID)
    start = time.perf_counter()
    sweep = run_sweep(SCENARIO, axes, variant="cap-aware", require="completed", workers=jobs)
    elapsed = time.perf_counter() - start
    n = len(sweep.points)
    passing = sum(p.passed for p in sweep.points)
    print(f"{n} points with {jobs} workers: {elapsed:.2f} s wall ({elapsed / n * 1000:.0f} ms per point); {passing} pass")
    for item in find_max_in_grid(sweep, CAP):
        print(f"  largest cap that completes everything with {item['others']}: {item['max_passing']}")
    ok = elapsed < TARGET_S
    print(f"target < {TARGET_S:.0f} s: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else default_workers()))

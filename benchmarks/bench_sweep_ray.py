"""Benchmark: a 200-point sweep of the seed's 193-request drain, on local worker processes and on Ray, same machine.

The grid: 10 request-count caps x 5 micro-batch sizes x cap-aware padding on/off x continuous/serial sampling
(200 points of the ``cap-aware`` variant, pass = every request completes with no OOM). Runs the sweep with the local
executor, then with a local Ray instance of the same number of CPUs (its start and stop included), checks that both
give identical points, and prints both wall times.

Run: ``.venv/bin/python benchmarks/bench_sweep_ray.py [JOBS]`` (default: the CPU count; needs ``.[ray]``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from skyrl_sim.commands.executors import LocalExecutor, RayExecutor, default_workers
from skyrl_sim.commands.sweep import crashed_point, parse_grid, run_sweep

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = str(ROOT / "scenarios" / "queue_drain_193.yaml")
CAP = "engine.forward_backward_max_request_count"
GRID = [
    f"{CAP}=1,2,4,8,16,24,32,48,64,null",
    "trainer.micro_train_batch_size_per_gpu=1,2,4,8,16",
    "engine.cap_aware_padding=true,false",
    "engine.sampling=continuous,serial",
]


def timed(executor: object) -> tuple[float, object]:
    start = time.perf_counter()
    sweep = run_sweep(SCENARIO, parse_grid(GRID), variant="cap-aware", require="completed", executor=executor)
    return time.perf_counter() - start, sweep


def main(jobs: int) -> int:
    local_s, local = timed(LocalExecutor(jobs))
    n = len(local.points)
    print(f"local executor, {jobs} processes: {n} points in {local_s:.2f} s ({local_s / n * 1000:.0f} ms per point)")
    ray_s, on_ray = timed(RayExecutor(num_cpus=jobs, on_crash=crashed_point))
    print(f"ray executor, local instance of {jobs} CPUs: {n} points in {ray_s:.2f} s ({ray_s / n * 1000:.0f} ms per point)")
    same = on_ray.to_dict() == local.to_dict()
    print(f"results identical: {'yes' if same else 'NO'}; {sum(p.passed for p in local.points)} of {n} points pass")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else default_workers()))

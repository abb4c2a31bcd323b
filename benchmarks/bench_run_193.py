"""Benchmark: wall time of ``skyrl-sim run scenarios/queue_drain_193.yaml --all-variants`` (the CLI, end to end).

Target: under 2 s. Runs the command as a user would (a fresh process, output to a pipe) a few times and prints the
best and median wall time, and the in-process time of the three simulations alone for comparison.

Run: ``.venv/bin/python benchmarks/bench_run_193.py``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "queue_drain_193.yaml"
CLI = Path(sys.executable).parent / "skyrl-sim"
RUNS = 3
TARGET_S = 2.0


def main() -> int:
    walls = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run([str(CLI), "run", str(SCENARIO), "--all-variants"], check=True, capture_output=True, timeout=300)
        walls.append(time.perf_counter() - start)
    host = PluginHost()
    scenario = load_scenario(SCENARIO)
    start = time.perf_counter()
    for name in scenario.variant_names:
        host.run(scenario.resolve(name), "sim")
    inner = time.perf_counter() - start
    print(f"skyrl-sim run queue_drain_193 --all-variants: best {min(walls):.2f} s, median {statistics.median(walls):.2f} s")
    print(f"  the three simulations alone, in process: {inner:.2f} s")
    ok = min(walls) < TARGET_S
    print(f"target < {TARGET_S:.0f} s: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

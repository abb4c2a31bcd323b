"""Benchmark: ``skyrl-sim advise`` on the seed's 193-request drain (no-cap settings as the starting point).

Target: under 60 s on 2 cores. Prints the wall time, how many simulator runs the search made (against the size of the
full grid it prunes), the recommendation and its objective beside the scenario's settings and cap 1 + cap-aware.

Run: ``.venv/bin/python benchmarks/bench_advise.py [JOBS]`` (default: the CPU count).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from skyrl_sim.commands.advise_search import advise
from skyrl_sim.commands.advise_space import cap_ladder, pass_requests
from skyrl_sim.commands.executors import default_workers
from skyrl_sim.schema.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = str(ROOT / "scenarios" / "queue_drain_193.yaml")
TARGET_S = 60.0


def main(jobs: int) -> int:
    start = time.perf_counter()
    advice = advise(SCENARIO, workers=jobs)
    elapsed = time.perf_counter() - start
    scenario = load_scenario(SCENARIO)
    grid = len(cap_ladder(pass_requests(scenario.resolve(advice.variant))))
    for axis in advice.axes:
        grid *= len(axis.values)
    print(
        f"advise {Path(SCENARIO).name} ({advice.variant}) with {jobs} workers: {elapsed:.1f} s wall, "
        f"{len(advice.candidates)} simulator runs (the full grid of the same axes: {grid})"
    )
    rows = [("current", advice.baseline), ("cap 1 + cap-aware", advice.reference), ("recommended", advice.recommended)]
    for label, c in rows:
        if c is not None:
            print(f"  {label:18} {c.verdict:8} makespan {c.summary['makespan_s']:8.2f} s  OOM {c.oom_calls}")
    print("  " + " ".join(advice.set_flags()))
    ok = elapsed < TARGET_S
    print(f"target < {TARGET_S:.0f} s: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else default_workers()))

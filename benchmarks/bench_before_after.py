"""Benchmark: the simulator at one size, before and after a change, measured in one run (alternating).

A shared machine's speed swings from minute to minute, so a before/after comparison means little unless both sides
run in the same minutes: this script runs ``bench_sim_scale.py --one SIZE`` from two source trees in turn (each in a
fresh process, each tree's own code on ``PYTHONPATH``), ``--repeat`` times each, and prints every run's CPU seconds
per 1,000 requests, peak resident memory and the fixed-loop reference time, then the medians and the change.

Run: ``.venv/bin/python benchmarks/bench_before_after.py --before /path/to/old/checkout [--after .] [--repeat N]
[--bench bench_sim_scale.py|bench_sampling.py [--workload samples|mixed]] SIZE`` (a checkout of the code before, e.g.
``git worktree add --detach /tmp/before main``; the benchmark script of each tree is the one that runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_one(tree: Path, bench: str, size: int, workload: str) -> dict[str, Any]:
    """One fresh process of ``tree``'s benchmark at ``size``, its own source first on the path, as the benchmark's
    ``--one`` prints it (CPU and wall seconds, peak resident memory, the reference loop's seconds)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    script = tree / "benchmarks" / bench
    which = [workload] if bench == "bench_sampling.py" else []
    done = subprocess.run(
        [sys.executable, str(script), "--one", *which, str(size)], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {bench} {size} failed:\n{done.stderr[-3000:]}")
    one = json.loads(done.stdout.strip().splitlines()[-1])
    one.setdefault("reference_s", one.get("interpreter_seconds", float("nan")))
    return one


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code before the change")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bench", default="bench_sim_scale.py", choices=["bench_sim_scale.py", "bench_sampling.py"])
    parser.add_argument("--workload", default="samples", choices=["samples", "mixed"], help="bench_sampling's")
    parser.add_argument("size", type=int)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for round_ in range(args.repeat):
        for label, tree in (("before", args.before), ("after", args.after)):
            one = run_one(tree.resolve(), args.bench, args.size, args.workload)
            runs[label].append(one)
            print(
                f"round {round_ + 1} {label:>6}: {one['cpu_s']:8.2f} s CPU ({one['cpu_s'] / args.size * 1000:.4f} s "
                f"per 1k), {one['wall_s']:8.2f} s wall, peak RSS {one['peak_rss_gib']:.2f} GiB, reference loop "
                f"{one['reference_s']:.3f} s",
                flush=True,
            )
    cpu = {label: statistics.median(r["cpu_s"] for r in rs) for label, rs in runs.items()}
    rss = {label: statistics.median(r["peak_rss_gib"] for r in rs) for label, rs in runs.items()}
    print(
        f"{args.size} requests, median of {args.repeat}: CPU per 1k {cpu['before'] / args.size * 1000:.4f} s before, "
        f"{cpu['after'] / args.size * 1000:.4f} s after ({(cpu['after'] / cpu['before'] - 1) * 100:+.1f}%); peak RSS "
        f"{rss['before']:.2f} GiB before, {rss['after']:.2f} GiB after ({(rss['after'] / rss['before'] - 1) * 100:+.1f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

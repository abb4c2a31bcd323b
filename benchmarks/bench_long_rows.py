"""Benchmark: eight requests of about 10M tokens (the datum limit) on the tiny CPU endpoint, end to end.

Each row's LM head has about 9,700 log-prob chunks (``logprobs_chunk_size`` 1024), one op each in the memory walk's
graph. Planning those ops scanned every live gradient and every saved tensor at each op, so the walk was quadratic in
the chunks: more than 330 s for this run. It is linear now. Runs the CLI as a user would (a fresh process) on the
endpoint as shipped (the calls run out of memory: walked step by step to name the failing allocation) and with room
for every shape (the calls fit: answered from the micro-batches' effects), and prints each wall time.

Target: each under 30 s on the 2-core machines (the run's own floor is the process start and the imports, ~2 s).

Run: ``.venv/bin/python benchmarks/bench_long_rows.py``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "skyrl-sim"
LENGTHS = [9_900_000, 9_800_000, 9_700_000, 9_600_000, 9_500_000, 9_400_000, 9_300_000, 9_200_000]
TARGET_S = 30.0
CASES = {
    "as shipped (out of memory)": [],
    "room for every shape (fits)": ["--set", "hardware.device_memory_gib=1000000", "--set", "memory_limit_gib=null"],
}


def main() -> int:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "long_rows.yaml"
        scenario.write_text(
            "name: long_rows\n"
            f"endpoint: {ROOT / 'scenarios' / 'endpoints' / 'tiny-cpu-tp1.yaml'}\n"
            "workload:\n  clients:\n    - requests:\n"
            f"        - {{type: forward_backward, lengths: {LENGTHS}}}\n"
        )
        for label, extra in CASES.items():
            start = time.perf_counter()
            subprocess.run([str(CLI), "run", str(scenario), *extra], check=True, capture_output=True, timeout=1800)
            wall = time.perf_counter() - start
            ok &= wall < TARGET_S
            print(f"8 x ~10M tokens on tiny-cpu-tp1, {label}: {wall:.2f} s wall")
    print(f"target < {TARGET_S:.0f} s each: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the simulator's cost on an endpoint whose LM head reads each row's tokens (the real backend's
re-expansion, ``logprob_kernel: vocab_parallel_cross_entropy``: every row's gradient clone in the head's backward is
the row's own size, so rows of different lengths make micro-batch shapes of their own, ``segments.short_rows``).

The workload is the worst case for that key: N forward_backward calls of 1-4 rows of seeded random lengths
(20-900 tokens), one after another, on a CPU endpoint (default ``tiny-cpu-tp2``, TP 2: even a one-row call is short
of its width rounded up to TP), so nearly every multi-row call's rows are a shape never seen before. Prints one JSON
line: requests, wall and CPU seconds of ``host.run`` (the scenario's load not timed), peak resident memory.

    .venv/bin/python benchmarks/bench_row_tokens.py [--endpoint tiny-cpu-tp2] [N]

Before/after a change: run it with each tree's ``src`` first on ``PYTHONPATH`` in the same minutes
(``PYTHONPATH=/path/to/old/src .venv/bin/python benchmarks/bench_row_tokens.py 2000``).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

import yaml

from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent


def workload(n: int, endpoint: str, seed: int = 7) -> dict[str, object]:
    """N forward_backward requests of 1-4 datums of 20-900 tokens, each submitted after the previous one."""
    rng = random.Random(seed)
    requests = [
        {"type": "forward_backward", "datums": [rng.randint(20, 900) for _ in range(rng.randint(1, 4))]} for _ in range(n)
    ]
    return {
        "name": "row_tokens_bench",
        "endpoint": str(ROOT / "scenarios" / "endpoints" / f"{endpoint}.yaml"),
        "workload": {
            "clients": [{"name": "rl", "model_id": "policy", "submit": {"mode": "after_previous"}, "requests": requests}]
        },
        "variants": {"roomy": {"set": {"memory_limit_gib": 64.0}}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", default="tiny-cpu-tp2")
    parser.add_argument("n", type=int, nargs="?", default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row_tokens_bench.yaml"
        path.write_text(yaml.safe_dump(workload(args.n, args.endpoint), sort_keys=False))
        scenario = load_scenario(path)
        variant = scenario.resolve("roomy")
        host = PluginHost()
        wall, cpu = time.perf_counter(), time.process_time()
        result = host.run(variant, "sim")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    done = sum(1 for r in result.requests if r.status == "completed") if hasattr(result.requests[0], "status") else None
    line = {"endpoint": args.endpoint, "requests": args.n, "completed": done, "wall_s": round(wall, 2)}
    line |= {"cpu_s": round(cpu, 2), "peak_rss_gib": round(rss, 2)}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

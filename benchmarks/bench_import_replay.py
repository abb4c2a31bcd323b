"""Benchmark: import and replay a 100,000-request SkyRL database.

Targets: ``skyrl-sim import`` of a 100k-request database in under 30 s (read, decode, write the scenario YAML), and
``skyrl-sim replay`` in under 60 s on the simulator (import, load the scenario, simulate, compare per request).

The database is generated (``skyrl_sim.traffic.synthetic_db``): SkyRL 0.4.0's tables and row shapes, ``TENANTS`` tenants each
creating a model, training (1-4 forward_backward of 1-2 datums of 16-512 tokens with their token lists, then an
optim_step), saving sampler weights and sampling every 4 steps, and unloading at the end; one pass in 50 recorded as
an OOM. Arrivals are exponential, ``GAP_S`` apart on average per tenant, on the tiny CPU endpoint so the simulated
engine keeps up with the arrivals (the benchmark measures the tooling, not a backlog).

Wall and CPU seconds are both printed: on a shared machine the wall time is mostly waiting for a core.

Run: ``.venv/bin/python benchmarks/bench_import_replay.py [REQUESTS]`` (default 100000). The database is cached in
``.sim-cache/`` between runs (generation is not what is measured).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from skyrl_sim.commands.replay import replay_trace
from skyrl_sim.commands.trace_import import dump_scenario, read_trace, scenario_of
from skyrl_sim.traffic.synthetic_db import write_synthetic_db

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "qwen3.6-27b-h200-tp4.yaml")
TENANTS = 8
GAP_S = 12.0
IMPORT_TARGET_S = 30.0
REPLAY_TARGET_S = 60.0


def database(requests: int) -> Path:
    cache = ROOT / ".sim-cache"
    cache.mkdir(exist_ok=True)
    path = cache / f"bench-skyrl-{requests}.db"
    if not path.exists():
        start = time.perf_counter()
        write_synthetic_db(path, requests, tenants=TENANTS, gap_s=GAP_S, oom_every=50)
        print(f"generated {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - start:.1f} s")
    return path


def main(argv: list[str]) -> int:
    requests = int(argv[0]) if argv else 100_000
    db = database(requests)
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu = time.perf_counter(), time.process_time()
        trace = read_trace(str(db))
        out = Path(tmp) / "imported.yaml"
        out.write_text(dump_scenario(scenario_of(trace, ENDPOINT, "bench")))
        imported_s, imported_cpu = time.perf_counter() - start, time.process_time() - cpu
        print(
            f"import: {len(trace.requests)} requests in {imported_s:.1f} s wall, {imported_cpu:.1f} s CPU "
            f"({out.stat().st_size / 2**20:.1f} MiB YAML)"
        )

        start, cpu = time.perf_counter(), time.process_time()
        trace = read_trace(str(db))
        replay = replay_trace(trace, ENDPOINT, "bench")
        replay_s, replay_cpu = time.perf_counter() - start, time.process_time() - cpu
    summary = replay.comparison.summary
    print(
        f"replay: {len(replay.simulated.requests)} requests, {len(replay.simulated.calls)} simulated calls in "
        f"{replay_s:.1f} s wall, {replay_cpu:.1f} s CPU (status agreement {summary['status_agreement']:.1%}, "
        f"OOM agreement {replay.findings.oom_agreement:.1%})"
    )
    ok_import = imported_s < IMPORT_TARGET_S
    ok_replay = replay_s < REPLAY_TARGET_S
    print(f"import < {IMPORT_TARGET_S:.0f} s: {'PASS' if ok_import else 'FAIL'}")
    print(f"replay < {REPLAY_TARGET_S:.0f} s: {'PASS' if ok_replay else 'FAIL'}")
    return 0 if ok_import and ok_replay else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Benchmark: imported traffic that the endpoint cannot keep up with, 50k to 10^6 requests.

A what-if replay ("would last week fit on fewer GPUs?") puts an endpoint under more traffic than it clears, so a
backlog builds behind every model's barrier (its next optim_step). This workload has the shape ``skyrl-sim import``
writes (one client per model with a ``trace``, ``at_times`` arrivals): 8 models, each submitting a forward_backward
of 1-4 datums (100-8,000 tokens) every 0.1-5 s and an optim_step after every 4, on the seed's Qwen3.6-27B H200 TP-4
endpoint with the cap and cap-aware padding. Calls clear far slower than requests arrive: the queue grows to
hundreds of thousands of requests.

Measures, for each size: writing the scenario as JSON and as YAML (not timed), loading and resolving it from each
(``ScenarioFile``), and running the JSON one through the simulator (``host.run``, records spooled past 50,000) with
its RunResult JSON written; prints wall seconds, seconds per 1k requests (it must stay flat: an iteration reads only
the requests it can act on, ``FuturesTable.actionable``) and peak RSS. ``--whole-queue N`` also runs N requests with
the engine reading the whole queue each iteration (the code before ``actionable``), for comparison.

Measured (AMD EPYC 2-core machine, quiet): 50k 2.4 s, 100k 4.0 s, 200k 7.5 s, 10^6 37.1 s wall (0.049 / 0.040 /
0.038 / 0.037 s per 1k: flat), peak RSS 2.15 GiB at 10^6; load + resolve from JSON 0.1 / 0.3 / 0.6 / 3.5 s, from
YAML 1.8 / 3.3 / 7.8 s (about 50 s at 10^6). The engine reading the whole queue each iteration: 50k 4.7 s, 200k
139.0 s (quadratic: each iteration read the whole backlog).

Run: ``.venv/bin/python benchmarks/bench_backlog.py [--whole-queue N] [SIZES...]`` (default 50000 200000); each
size runs in a fresh process.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from skyrl_sim.commands.trace_import import dump_scenario
from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import ScenarioFile

MODELS = 8
STEP = 4
SIZES = (50_000, 200_000)
VARIANT = "capped"


def backlog_document(total: int, seed: int = 0) -> dict[str, Any]:
    """The workload above as the mapping an import writes."""
    rng = random.Random(seed)
    clients = []
    for m in range(MODELS):
        share = total // MODELS + (1 if m < total % MODELS else 0)
        types: list[str] = []
        passes: list[list[int]] = []
        rates: list[float] = []
        times: list[float] = []
        t = 0.0
        for i in range(share):
            t += rng.uniform(0.1, 5.0)
            times.append(round(t, 6))
            if i % (STEP + 1) == STEP:
                types.append("optim_step")
                rates.append(1.0e-4)
            else:
                types.append("forward_backward")
                passes.append([rng.randint(100, 8000) for _ in range(rng.randint(1, 4))])
        trace = {"types": types, "forward_backward": passes, "optim_step": rates}
        name = f"model-{m}"
        submit = {"mode": "at_times", "gap_s": 0, "times_s": times}
        clients.append({"name": name, "model_id": name, "submit": submit, "trace": trace})
    return {
        "name": f"backlog_{total}",
        "endpoint": "qwen3.6-27b-h200-tp4",
        "workload": {"clients": clients},
        "variants": {
            VARIANT: {"set": {"engine.forward_backward_max_request_count": 8, "engine.cap_aware_padding": True}}
        },
    }


def timed_load(path: Path) -> float:
    start = time.perf_counter()
    ScenarioFile(path).resolve(VARIANT)
    return time.perf_counter() - start


def measure(total: int, whole_queue: bool) -> dict[str, Any]:
    """One size in this process: load seconds (JSON, YAML), run seconds, peak RSS."""
    if whole_queue:  # the engine reads every pending request each iteration, as before ``actionable``
        FuturesTable.actionable = FuturesTable.pending  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        document = backlog_document(total)
        as_json, as_yaml = folder / "week.json", folder / "week.yaml"
        as_json.write_bytes(orjson.dumps(document))
        as_yaml.write_text(dump_scenario(document))
        del document
        load_json = timed_load(as_json)
        load_yaml = timed_load(as_yaml) if total <= 200_000 else None  # past that YAML is the slow path we tell users off
        start = time.perf_counter()
        variant = ScenarioFile(as_json).resolve(VARIANT)
        result = PluginHost().run(variant, "sim")
        result.write(folder / "run.json")
        run_s = time.perf_counter() - start
        summary = result.summary()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "total": total,
        "load_json_s": load_json,
        "load_yaml_s": load_yaml,
        "run_s": run_s,
        "peak_rss_gib": peak,
        "calls": summary["calls"],
        "queue_wait_max_s": summary["queue_wait_max_s"],
    }


def fresh(total: int, whole_queue: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", str(total), *(["--whole"] if whole_queue else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"size {total} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(sizes: list[int], whole_queue: int | None) -> int:
    for total in sizes:
        s = fresh(total, False)
        yaml_s = f"{s['load_yaml_s']:.1f} s" if s["load_yaml_s"] is not None else "not measured"
        print(
            f"{total:>8} requests: run {s['run_s']:6.1f} s wall ({s['run_s'] / total * 1000:.3f} s per 1k, JSON written "
            f"included), peak RSS {s['peak_rss_gib']:.2f} GiB, {s['calls']} calls, longest queue wait "
            f"{s['queue_wait_max_s']:,.0f} s; load + resolve: JSON {s['load_json_s']:.1f} s, YAML {yaml_s}",
            flush=True,
        )
    if whole_queue:
        s = fresh(whole_queue, True)
        print(f"{whole_queue:>8} requests, the engine reading the whole queue each iteration: run {s['run_s']:.1f} s")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--one":
        print(json.dumps(measure(int(args[1]), "--whole" in args)))
        raise SystemExit(0)
    whole: int | None = None
    if "--whole-queue" in args:
        at = args.index("--whole-queue")
        try:
            whole = int(args[at + 1])
        except (IndexError, ValueError):
            raise SystemExit("--whole-queue needs a whole number of requests") from None
        del args[at : at + 2]
    try:
        chosen = [int(a) for a in args] or list(SIZES)
    except ValueError:
        raise SystemExit("sizes must be whole numbers of requests") from None
    raise SystemExit(main(chosen, whole))

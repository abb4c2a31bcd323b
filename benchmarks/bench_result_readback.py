"""Benchmark: reading back the RunResult of a long run, the way ``compare --against`` and ``calibrate`` read it.

A 2,000,000-request run (the scenario limit) writes a RunResult of about 2.5 GB, which the whole-file reader refused
(over its 1 GiB limit) and could not have parsed in memory anyway. A file the tool wrote is now read record by
record past 64 MiB (``results/result_stream.py``: requests spooled to a temporary file). For each size this runs the
import-shaped backlog workload of ``bench_backlog.py`` on the simulator in a fresh process and writes its RunResult,
then, in another fresh process, reads it back with ``read_results`` and summarises it; prints the file size, the
read's wall seconds and its peak RSS (the run's own peak beside it).

``--replicate BASE`` simulates only BASE requests and writes their records again and again (ids and times shifted)
up to each size: the same file a run of that size writes, record for record in shape, without its simulation (a
2,000,000-request simulation takes minutes; reading its file back is what is measured here).

Run: ``.venv/bin/python benchmarks/bench_result_readback.py [--replicate BASE] [SIZES...]`` (default 200000; the
issue's case: ``--replicate 20000 2000000``).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backlog import VARIANT, backlog_document  # noqa: E402

SIZES = (200_000,)


def write_run(total: int, folder: Path, base: int = 0) -> dict[str, Any]:
    """Simulate ``total`` requests (or ``base`` of them, replicated up to ``total``) and write their RunResult (in
    this process)."""
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.results.result import write_results
    from skyrl_sim.schema.scenario import ScenarioFile

    scenario = folder / "week.json"
    scenario.write_bytes(orjson.dumps(backlog_document(base or total)))
    start = time.perf_counter()
    result = PluginHost().run(ScenarioFile(scenario).resolve(VARIANT), "sim")
    if base:
        result = replicated(result, total)
    write_results([result], folder / "run.json")
    return {
        "run_s": time.perf_counter() - start,
        "run_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "requests": len(result.requests),
        "calls": len(result.calls),
    }


def replicated(result: Any, total: int) -> Any:
    """The run's records copied until there are ``total`` requests: copy k has ids + k * n and times + k * span (only
    the first copy keeps the calls' memory timelines, as a long run keeps them for its first 1,000 calls)."""
    from dataclasses import replace

    from skyrl_sim.results.record_spool import RecordSpool

    base = list(result.requests)
    n = len(base)
    span = result.makespan_s + 1.0
    spool = RecordSpool()
    calls = []
    copies = -(-total // n)
    for k in range(copies):
        shift = k * span

        def moved(value: float | None, shift: float = shift) -> float | None:
            return None if value is None else value + shift

        for record in base:
            if k * n + record.id > total:
                continue
            spool.add(
                replace(
                    record,
                    id=k * n + record.id,
                    submitted_s=moved(record.submitted_s),
                    started_s=moved(record.started_s),
                    completed_s=moved(record.completed_s),
                )
            )
        for call in result.calls:
            ids = [k * n + i for i in call.request_ids if k * n + i <= total]
            if ids or not call.request_ids:
                calls.append(
                    replace(
                        call,
                        index=len(calls),
                        request_ids=ids,
                        start_s=call.start_s + shift,
                        end_s=call.end_s + shift,
                        extra=dict(call.extra),
                        memory=call.memory if k == 0 or not call.memory else {"breakdown": call.memory.get("breakdown")},
                    )
                )
    return replace(result, requests=spool, calls=calls)


def read_run(folder: Path) -> dict[str, Any]:
    """Read the RunResult back and summarise it (in this process)."""
    from skyrl_sim.results.result import read_results

    start = time.perf_counter()
    (run,) = read_results(folder / "run.json")
    summary = run.summary()
    return {
        "read_s": time.perf_counter() - start,
        "read_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "requests": summary["requests"],
        "calls": summary["calls"],
        "spooled": type(run.requests).__name__,
    }


def fresh(step: str, folder: Path, total: int = 0, base: int = 0) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, step, str(folder), str(total), str(base)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{step} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(sizes: list[int], base: int) -> int:
    for total in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            wrote = fresh("--write", folder, total, base)
            size = (folder / "run.json").stat().st_size
            read = fresh("--read", folder)
        assert (read["requests"], read["calls"]) == (wrote["requests"], wrote["calls"])
        print(
            f"{total:>9} requests, {wrote['calls']:,} calls: RunResult {size / 2**30:.2f} GiB; read back in "
            f"{read['read_s']:.1f} s, peak RSS {read['read_rss_gib']:.2f} GiB (requests as a {read['spooled']}); "
            f"{'writing it' if base else 'the run itself'} {wrote['run_s']:.1f} s, peak RSS {wrote['run_rss_gib']:.2f} GiB"
            + (f" ({base:,} requests simulated, replicated)" if base else ""),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--write":
        print(json.dumps(write_run(int(args[2]), Path(args[1]), int(args[3]))))
        raise SystemExit(0)
    if args and args[0] == "--read":
        print(json.dumps(read_run(Path(args[1]))))
        raise SystemExit(0)
    replicate = 0
    if "--replicate" in args:
        at = args.index("--replicate")
        try:
            replicate = int(args[at + 1])
        except (IndexError, ValueError):
            raise SystemExit("--replicate needs a whole number of requests") from None
        del args[at : at + 2]
    try:
        chosen = [int(a) for a in args] or list(SIZES)
    except ValueError:
        raise SystemExit("sizes must be whole numbers of requests") from None
    raise SystemExit(main(chosen, replicate))

"""Benchmark: how long a sweep takes to stop after SIGTERM to its whole process group (what ``timeout``, CI
cancellation and ``docker stop`` send), and what it keeps.

Target: exit 143 within a second of the signal, with the finished points written and marked partial. Before the fix a
local sweep exited 3 (``BrokenProcessPool``, its workers died of the group's signal) with nothing written, and a sweep
on Ray aborted (exit 134, Ray's C++ failure handler) or, once that was off, waited ~8 s in Ray's shutdown.

For each executor: the exit code, the seconds from the signal to the exit, the points written, and the command's CPU
seconds and peak RSS (its own and its reaped children's, from ``wait4``).

Run: ``.venv/bin/python benchmarks/bench_signal_stop.py [local|ray ...]`` (default: local ray).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = str(ROOT / "scenarios" / "queue_drain_17.yaml")
GRID = [
    "engine.forward_backward_max_request_count=1,2,3,4,5,6,7,8,10,12,14,16",
    "trainer.micro_train_batch_size_per_gpu=1,2,4,8,16",
    "engine.cap_aware_padding=true,false",
    "workload.clients.0.submit.gap_s=0.001,0.002,0.003,0.004",
]
WORK_CPU_S = 4.0
"""CPU seconds the points get before the signal (points finish well under a second each)."""


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid or int(entry.name) == pid or os.getpgid(int(entry.name)) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def one(executor: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sweep.json"
        args = [sys.executable, "-m", "skyrl_sim.cli", "sweep", SCENARIO, "--variant", "cap-aware", "--jobs", "2"]
        args += ["--executor", executor, "--json", str(out)]
        for axis in GRID:
            args += ["--grid", axis]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        started = time.monotonic()
        warm = 20.0 if executor == "ray" else 0.0  # Ray's own processes use CPU before any point runs
        while proc.poll() is None and tree_cpu_s(proc.pid) < WORK_CPU_S + warm:
            time.sleep(0.1)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _, status, usage = os.wait4(proc.pid, 0)
        stopped = time.monotonic() - sent
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        points = json.loads(out.read_text())["points"] if out.exists() else None
        print(
            f"{executor:5}: exit {proc.returncode} {stopped:.2f} s after SIGTERM (ran {sent - started:.0f} s), "
            f"points written: {'none' if points is None else len(points)}, "
            f"CPU {usage.ru_utime + usage.ru_stime:.1f} s, peak RSS {usage.ru_maxrss / 1024:.0f} MiB"
        )
        if proc.returncode != 143:
            print(err[-2000:])


if __name__ == "__main__":
    for name in sys.argv[1:] or ["local", "ray"]:
        one(name)

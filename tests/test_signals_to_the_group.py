"""SIGTERM behaves as SIGINT does, sent the way ``timeout``, CI cancellation and ``docker stop`` send it: to the
command's whole process group, its worker processes included.

A worker that dies of the group's signal used to break the process pool before the parent could act (exit 3,
``BrokenProcessPool``, every finished point lost); Ray's driver aborted on SIGTERM (its C++ failure handler). Now every
long command exits 143 (130 for SIGINT), a sweep or an advise search with the finished points written and marked
partial, on both executors, and nothing it started outlives it. (``tests/test_executors.py`` sends SIGINT and SIGTERM
to a local sweep's and an advise search's group.) The signal is sent once the command has worked a
while (its CPU time, not the wall clock: a loaded machine gives it little of each second), and the bounds tell a
prompt stop from a hang with room for load; the stop itself is measured and reported by
``benchmarks/signal_stop.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from project_paths import SCENARIOS
from test_executors import children_of, cpu_seconds, stop_promptly, tree_cpu_seconds

CLI = [sys.executable, "-m", "skyrl_sim.cli"]
SEED17 = str(SCENARIOS / "queue_drain_17.yaml")
SEED193 = str(SCENARIOS / "queue_drain_193.yaml")
LONG = "workload.clients.0.requests.0.count=5000"  # 965,000 requests: minutes of simulation, stopped long before
GRID = [
    "engine.forward_backward_max_request_count=1,2,3,4,5,6,7,8,10,12,14,16",
    "trainer.micro_train_batch_size_per_gpu=1,2,4,8,16",
    "engine.cap_aware_padding=true,false",
    "workload.clients.0.submit.gap_s=0.001,0.002,0.003,0.004",
]
GRID_POINTS = 12 * 5 * 2 * 4


def start(args: list[str]) -> subprocess.Popen[str]:
    """The command in a session (and process group) of its own, as a shell or CI runner starts a job."""
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_work(proc: subprocess.Popen[str], cpu_s: float, workers: int = 0, timeout_s: float = 300) -> set[int]:
    """Wait until the command (and its descendants) used ``cpu_s`` CPU seconds with at least ``workers`` worker
    processes running; its workers."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        running = children_of(proc.pid)
        seen |= running
        if len(running) >= workers and tree_cpu_seconds(proc.pid) >= cpu_s:
            return seen | children_of(proc.pid)
        time.sleep(0.05)
    proc.kill()
    _, err = proc.communicate()
    raise AssertionError(f"the command ended or never got to work before the signal: {err[-2000:]}")


def test_a_worker_killed_outright_stops_the_sweep_with_its_finished_points(tmp_path):
    """A worker ended by something else (the kernel's OOM killer, a ``kill -9`` of its own) breaks the pool: the sweep
    stops as a signal stops it, with 128 + that signal and the finished points, not exit 3. A worker that gets a
    SIGTERM of its own ignores it (the group's signal is the parent's to act on)."""
    out = tmp_path / "sweep.json"
    args = ["sweep", SEED17, "--variant", "cap-aware", "--jobs", "2", "--json", str(out)]
    for axis in GRID:
        args += ["--grid", axis]
    proc = start(args)
    workers = wait_for_work(proc, cpu_s=3.0, workers=2)
    running = sorted(children_of(proc.pid))
    os.kill(running[0], signal.SIGTERM)  # ignored
    time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    victim = sorted(children_of(proc.pid))[0]
    os.kill(victim, signal.SIGKILL)
    rc = proc.wait(timeout=60)
    _, err = proc.communicate()
    assert rc == 128 + signal.SIGKILL, err[-3000:]
    assert "Traceback" not in err, err
    data = json.loads(out.read_text())
    assert data["partial"] is True and 0 < len(data["points"]) < GRID_POINTS
    time.sleep(0.7)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.parametrize(
    "command",
    [
        ["check", SEED193, "--variant", "cap-aware", "--set", LONG, "--junit-xml", "{out}"],
        ["compare", SEED193, "--variant", "cap-aware", "--backends", "sim,sim", "--set", LONG, "--json", "{out}"],
    ],
    ids=["check", "compare"],
)
def test_sigterm_to_the_group_stops_every_long_command_as_sigint_does(tmp_path, command):
    """One process, no worker: SIGTERM raises where the work is, as Ctrl-C does; exit 143, no traceback, no output
    half-written (no output at all: a run's result is written once it finished)."""
    out = tmp_path / "out"
    proc = start([part.replace("{out}", str(out)) for part in command])
    wait_for_work(proc, cpu_s=2.0)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=60)
    stopped_after = time.monotonic() - sent
    _, err = proc.communicate()
    assert rc == 143, err[-3000:]
    assert "Traceback" not in err, err
    assert stopped_after < 15.0, f"{stopped_after:.1f} s"  # a hang runs to the 60 s wait
    assert not out.exists() and not list(tmp_path.glob(".*")), "an output was half-written"


def test_sigterm_to_the_group_stops_a_sweep_on_ray_with_its_finished_points(tmp_path):
    """Ray's processes are in the command's group too: they die of the signal, and Ray's driver would abort on it
    (exit 134) or wait seconds for the dead instance in its shutdown. The command writes what finished and leaves;
    the reaper ends what is left of the instance."""
    pytest.importorskip("ray")
    out = tmp_path / "sweep.json"
    args = ["sweep", SEED17, "--variant", "cap-aware", "--jobs", "2", "--executor", "ray", "--json", str(out)]
    for axis in GRID:
        args += ["--grid", axis]
    proc = start(args)
    # Ray's own processes start first (seconds of CPU); then points run in Ray workers
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        workers = [pid for pid in children_of(proc.pid) if "ray::" in _cmdline(pid)]
        if workers and cpu_seconds(set(workers)) >= 4.0:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    tree = children_of(proc.pid)
    err = stop_promptly(proc, signal.SIGTERM, 143, set())
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    data = json.loads(out.read_text())
    assert data["partial"] is True and 0 < len(data["points"]) < GRID_POINTS, err[-3000:]
    deadline = time.monotonic() + 30  # the reaper gives each leftover 3 s after SIGTERM
    while [pid for pid in tree if _state(pid) != "Z"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in tree if _state(pid) != "Z"], "Ray's processes outlived the command"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

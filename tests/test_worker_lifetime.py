"""Work never outlives the command: worker processes exit when their parent dies, even by ``kill -9``, and the
processes a local Ray instance leaves behind are ended by the reaper. Every wait here has a timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WAIT_S = 60.0


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopts it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_for(condition, timeout_s: float = WAIT_S) -> bool:  # noqa: ANN001 - a zero-argument predicate
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def pids_in(folder: Path) -> list[int]:
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()]


def test_sweep_workers_exit_when_the_parent_is_killed(tmp_path):
    script = (
        "import os, sys, time\n"
        "from skyrl_sim.commands.executors import LocalExecutor\n"
        "def job(i):\n"
        "    open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n"
        "    time.sleep(600)\n"
        "LocalExecutor(2).map(job, [1, 2])\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    try:
        assert wait_for(lambda: len(pids_in(tmp_path)) == 2), "the workers did not start"
        workers = pids_in(tmp_path)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_for(lambda: not any(running(pid) for pid in workers)), "workers outlived their parent"
    finally:
        parent.kill()
        for pid in pids_in(tmp_path):
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_reaper_ends_what_a_killed_command_left_running(tmp_path):
    """As a local Ray instance's agents would: a child that survives its parent's SIGKILL."""
    marker = tmp_path / "child"
    script = (
        "import subprocess, sys, time\n"
        "from skyrl_sim.commands.reaper import reap_when_gone\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "reap_when_gone()\n"
        f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    child = 0
    try:
        assert wait_for(lambda: marker.exists() and marker.read_text().isdigit()), "the command did not start"
        child = int(marker.read_text())
        assert running(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        assert wait_for(lambda: not running(child)), "the orphan was not reaped"
    finally:
        parent.kill()
        if child and running(child):
            os.kill(child, signal.SIGKILL)


def test_the_reaper_leaves_a_reused_pid_alone(tmp_path):
    """A process whose id matches but whose start time does not is not the one recorded, and is not touched."""
    from skyrl_sim.commands import reaper

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        done = subprocess.Popen([sys.executable, "-c", "pass"])
        done.wait(timeout=60)  # a parent that is already gone
        code = reaper.main([str(done.pid), f"[[{bystander.pid}, 1.0]]"])  # recorded start time: 1970
        assert code == 0 and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=30)

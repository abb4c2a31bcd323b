"""Sweep executors: real SIGINT/SIGTERM on a running ``sweep`` and ``advise``, Ray against local processes, and Ray
staying optional."""

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
from skyrl_sim.commands.executors import Interrupted, LocalExecutor, RayExecutor, stop_signals
from skyrl_sim.commands.sweep import crashed_point, parse_grid, run_sweep

SEED17 = str(SCENARIOS / "queue_drain_17.yaml")
CAP = "engine.forward_backward_max_request_count"
MICRO = "trainer.micro_train_batch_size_per_gpu"
AWARE = "engine.cap_aware_padding"
CLI = [sys.executable, "-m", "skyrl_sim.cli"]


def children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def cpu_seconds(pids: set[int]) -> float:
    """The user and system CPU seconds these processes have used (read from /proc)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_promptly(proc: subprocess.Popen[str], signum: int, code: int, workers: set[int]) -> str:
    """Send ``signum`` to a running command's whole process group, as a terminal's Ctrl-C, ``timeout``, CI
    cancellation and ``docker stop`` do (SIGINT twice: a second Ctrl-C must not deadlock the parent), and check that
    it exits with ``code``, its ``workers`` stopped promptly and none outlives it; its stderr. The command must have
    been started in a session of its own (``start_new_session``), so the group is its and not the test's."""
    assert os.getpgid(proc.pid) == proc.pid, "start the command with start_new_session=True"
    try:
        sent = time.monotonic()
        os.killpg(proc.pid, signum)
        if signum == signal.SIGINT:
            time.sleep(0.05)
            os.killpg(proc.pid, signum)
        while [pid for pid in workers if alive(pid)] and time.monotonic() - sent < 30:
            time.sleep(0.02)
        workers_stopped_after = time.monotonic() - sent
        rc = proc.wait(timeout=30)
        exited_after = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _, err = proc.communicate()
    assert rc == code, err
    # bounds that tell a prompt stop from a hang with margin for a loaded 2-core machine (a hang runs to the 30 s wait)
    assert workers_stopped_after <= 10.0, f"the workers took {workers_stopped_after:.2f} s to stop"
    assert exited_after <= 25.0, f"the command took {exited_after:.2f} s to exit"  # it prints and writes first
    time.sleep(0.2)
    assert not [pid for pid in workers if alive(pid)], "worker processes outlived the command"
    return err


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_sweep_keeps_finished_points_and_leaves_no_children(tmp_path, signum, code):
    out = tmp_path / "sweep.json"
    grid = [f"{CAP}=1,2,3,4,5,6,7,8,10,12,14,16", f"{MICRO}=1,2,4,8,16", f"{AWARE}=true,false"]
    grid.append("engine.sampling=continuous,serial")
    grid.append("workload.clients.0.submit.gap_s=0.001,0.002,0.003,0.004,0.005,0.006")  # long enough to interrupt
    args = [*CLI, "sweep", SEED17, "--variant", "cap-aware", "--jobs", "2", "--json", str(out)]
    for axis in grid:
        args += ["--grid", axis]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(children_of(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        workers = children_of(proc.pid)
        assert len(workers) >= 2, "the sweep's worker processes never started"
        # let some points finish: wait for the workers' CPU time, not the wall clock (a loaded machine gives a
        # worker little of each second; a point of this grid takes well under a second of CPU)
        deadline = time.monotonic() + 300
        while cpu_seconds(children_of(proc.pid)) < 8.0 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, "the sweep finished before the signal: make the grid larger"
        workers |= children_of(proc.pid)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    err = stop_promptly(proc, signum, code, workers)
    data = json.loads(out.read_text())
    assert data["partial"] is True
    total = 12 * 5 * 2 * 2 * 6
    assert 0 < len(data["points"]) < total, err
    assert f"of {total} points finished" in err


def tree_cpu_seconds(pid: int) -> float:
    """The CPU seconds of ``pid``, of the children it has reaped and of its live descendants (read from /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    own = sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime
    return own + cpu_seconds(children_of(pid))


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_advise_keeps_finished_configurations_and_leaves_no_children(tmp_path, signum, code):
    """advise runs its configurations on the sweep's executors, so a signal stops it as it stops a sweep."""
    out = tmp_path / "advice.json"
    scenario = str(SCENARIOS / "queue_drain_193.yaml")
    longer = "workload.clients.0.requests.0.count=200"  # 38,600 requests: each configuration takes a while to run
    args = [*CLI, "advise", scenario, "--variant", "cap-aware", "--set", longer, "--jobs", "2", "--json", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: set[int] = set()
    try:
        # some configurations have finished (CPU time, not the wall clock: a loaded machine gives little of each
        # second) and a batch is running in worker processes
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            running = children_of(proc.pid)
            workers |= running
            if len(running) >= 2 and tree_cpu_seconds(proc.pid) >= 8.0:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "advise finished before the signal: give it a larger search"
        assert len(children_of(proc.pid)) >= 2, "advise's worker processes never ran a batch"
        workers |= children_of(proc.pid)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    err = stop_promptly(proc, signum, code, workers)
    data = json.loads(out.read_text())
    assert data["partial"] is True
    assert data["evaluated"] == len(data["candidates"]) >= 1
    assert all(c["verdict"] in ("PASS", "AT RISK", "FAIL") for c in data["candidates"])
    assert f"{data['evaluated']} configurations finished" in err


@pytest.fixture
def own_stop_handlers():
    """The test process's SIGINT/SIGTERM handlers, put back afterwards (a stopped run leaves them ignored)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def signal_after_the_last(total: int, signum: int):
    """An ``on_done`` that sends ``signum`` to this process when the last job has finished: after the run's last look
    at its stop flag, while it shuts its workers down."""
    finished = 0

    def on_done(count: int) -> None:
        nonlocal finished
        finished += count
        if finished == total:
            os.kill(os.getpid(), signum)

    return on_done


@pytest.mark.parametrize("workers", [1, 2])
def test_a_signal_after_the_last_job_still_stops_the_run_with_every_result(own_stop_handlers, workers):
    jobs = [-3, 2, -1, 0]
    with pytest.raises(Interrupted) as stopped:
        LocalExecutor(workers).map(abs, jobs, signal_after_the_last(len(jobs), signal.SIGTERM))
    assert stopped.value.signum == signal.SIGTERM
    assert stopped.value.results == {0: 3, 1: 2, 2: 1, 3: 0}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the command only reports and writes from here


def test_a_run_inside_a_stoppable_search_hands_a_late_signal_to_the_search(own_stop_handlers):
    """advise runs batches inside its own ``stop_signals``: a signal that lands as a batch's pool shuts down must
    stop the search, not be kept by the batch and ignored (the search would run on to its end)."""
    jobs = [-3, 2, -1, 0]
    with stop_signals(raise_at_once=True) as search:
        with pytest.raises(Interrupted):
            LocalExecutor(2).map(abs, jobs, signal_after_the_last(len(jobs), signal.SIGINT))
        assert search.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # the search is still the one listening
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_local_executor_in_process_gives_results_in_order():
    assert LocalExecutor(1).map(abs, [-3, 2, -1]) == [3, 2, 1]
    assert LocalExecutor(2).map(abs, [-3, 2, -1, 0]) == [3, 2, 1, 0]


def test_the_default_executor_never_imports_ray():
    code = (
        "import sys\n"
        "from skyrl_sim.cli import main\n"
        f"rc = main(['sweep', {SEED17!r}, '--variant', 'cap-aware', '--grid', '{CAP}=1,2', '--jobs', '2'])\n"
        "assert rc == 0, rc\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_a_20_point_sweep_on_ray_equals_the_local_executor(ray_instance):
    axes = parse_grid([f"{CAP}=1,2,4,8,16", f"{MICRO}=4,16", f"{AWARE}=true,false"])
    local = run_sweep(SEED17, axes, variant="cap-aware", require="completed", workers=2)
    on_ray = run_sweep(SEED17, axes, variant="cap-aware", require="completed", executor=RayExecutor(on_crash=crashed_point))
    assert len(on_ray.points) == 20
    assert on_ray.points == local.points
    assert on_ray.to_dict() == local.to_dict()


DEAD_WORKER_SCRIPT = """
import json, os, sys
import ray
from skyrl_sim.commands.executors import RayExecutor
from skyrl_sim.commands.sweep import crashed_point, parse_grid, prepare, run_point

CAP = "engine.forward_backward_max_request_count"

def die_on_cap_3(job):
    # the worker process dies for one point, as a crash or an out-of-memory kill would
    if job.settings.get(CAP) == 3:
        os._exit(1)
    return run_point(job)

_, _, jobs = prepare(sys.argv[1], None, "cap-aware", {}, parse_grid([CAP + "=1,2,3,4"]), "completed")
points = RayExecutor(num_cpus=2, on_crash=crashed_point).map(die_on_cap_3, jobs)  # starts and stops Ray
assert not ray.is_initialized()
print(json.dumps([[p.settings[CAP], p.passed, p.error, p.summary] for p in points]))
"""


def test_advise_on_ray_recommends_what_the_local_executor_recommends(ray_instance):
    from skyrl_sim.commands.advise_search import advise

    tiny = str(SCENARIOS / "queue_drain_17_tiny.yaml")
    local = advise(tiny, variant="no-cap", workers=2, rounds=1)
    on_ray = advise(tiny, variant="no-cap", workers=2, rounds=1, executor=RayExecutor())
    assert local.recommended is not None and on_ray.recommended is not None
    assert on_ray.recommended.settings == local.recommended.settings
    assert on_ray.set_flags() == local.set_flags()
    ran_local = {repr(sorted(c.settings.items())): c.summary for c in local.candidates}
    ran_on_ray = {repr(sorted(c.settings.items())): c.summary for c in on_ray.candidates}
    assert all(ran_on_ray[key] == ran_local[key] for key in ran_on_ray.keys() & ran_local.keys())


def test_a_dead_ray_worker_fails_its_point_not_the_sweep():
    pytest.importorskip("ray")
    # In a session of its own: when a worker dies, Ray's raylet signals process groups, and this test's must not be
    # one of them.
    done = subprocess.run(
        [sys.executable, "-c", DEAD_WORKER_SCRIPT, SEED17],
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    points = json.loads(done.stdout.strip().splitlines()[-1])
    assert [p[0] for p in points] == [1, 2, 3, 4]
    _, passed, error, summary = points[2]
    assert not passed and error and "worker died" in error and summary == {}
    assert points[0][1] and points[0][2] is None
    assert [p[2] for p in points].count(None) == 3


NICENESS_SCRIPT = """
import json, os
from skyrl_sim.commands.executors import RayExecutor

def niceness(_job):
    return os.nice(0)

print(json.dumps([os.nice(0), RayExecutor(num_cpus=1).map(niceness, [0, 1])]))  # starts and stops Ray
"""


def test_a_local_ray_instance_runs_points_at_the_sweeps_own_priority():
    pytest.importorskip("ray")
    # Ray's default runs workers at niceness 15: on a busy machine the sweep would get the CPU last.
    done = subprocess.run(
        [sys.executable, "-c", NICENESS_SCRIPT], capture_output=True, text=True, timeout=300, start_new_session=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    own, workers = json.loads(done.stdout.strip().splitlines()[-1])
    assert workers == [own, own]


def test_address_without_ray_and_an_unknown_executor_are_user_errors(capsys):
    from skyrl_sim.cli import main

    base = ["sweep", SEED17, "--grid", f"{CAP}=1,2"]
    assert main([*base, "--address", "127.0.0.1:6379"]) == 2
    assert "--address needs --executor ray" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--executor", "dask"])
    assert exit_info.value.code == 2
    assert main(["advise", SEED17, "--address", "127.0.0.1:6379"]) == 2
    assert "--address needs --executor ray" in capsys.readouterr().err

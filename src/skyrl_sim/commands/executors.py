"""Where sweep points run: local worker processes (the default) or Ray tasks, both stoppable by a signal.

An executor takes independent jobs and a function that turns one job into its result, and gives the results back in
job order. Two are built in:

- ``LocalExecutor``: a process pool on this machine (in this process for one worker). No Ray import.
- ``RayExecutor``: one Ray task per job, on a local Ray instance (started and stopped here) or on an existing cluster
  (``address``). A task whose worker dies gives that job a failure result made by ``on_crash``; the rest go on.

Workers never outlive the command: each watches its parent and exits within ``PARENT_POLL_S`` of the parent's death,
even a ``kill -9`` that runs no cleanup in the parent; a local Ray instance's processes are ended then by
``commands.reaper``.

Connecting to Ray is bounded: Ray itself retries an unreachable cluster for minutes, inside C++ calls where Python
cannot run a signal handler, so neither a timeout nor SIGTERM would end it. A Ray ``address`` must first accept a TCP
connection and answer the HTTP/2 preface as a gRPC server does (Ray's GCS and Ray Client server are gRPC), each
within ``RAY_CONNECT_TIMEOUT_S``: a closed port, a silent host or another kind of server is one line at once. Then
``ray.init`` itself gets ``RAY_INIT_TIMEOUT_S``, and SIGINT / SIGTERM during it end the command at once (a thread
sees them on the signal wakeup fd, which the C-level handler writes even while the main thread is blocked).

SIGINT and SIGTERM stop a run, sent to the command alone or to its whole process group (a terminal's Ctrl-C,
``timeout``, CI cancellation, ``docker stop``): local workers ignore both, so the signal is the parent's to act on,
and the parent kills them (SIGKILL: a point holds nothing to clean up); every result already finished is kept, and
``Interrupted`` carries them with the signal number, so the caller can write a partial result and exit
``128 + signal`` (130 for SIGINT, 143 for SIGTERM). A second signal during that cleanup is ignored, so it cannot
deadlock the parent. A local worker killed by anything else (the kernel's OOM killer, a ``kill -9`` of its own) stops
the run the same way, with ``128 +`` that worker's signal, rather than losing the finished points.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit

from skyrl_sim.commands.reaper import reap_when_gone
from skyrl_sim.errors import UserError
from skyrl_sim.schema.limits import MAX_JOBS

J = TypeVar("J")
R = TypeVar("R")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 0.5
"""How long the parent waits for a killed worker to be reaped."""
TICK_S = 0.05
"""How often the parent looks for finished jobs and a stop signal."""
EXECUTORS = ("local", "ray")
SUBMIT_WINDOW = 4
"""Jobs per worker handed to the process pool at a time: a million-point sweep holds a few futures, not a million."""
BROKEN_POOL_WAIT_S = 0.2
"""How long a broken pool waits for the parent's own stop signal before it names the signal that killed a worker."""
PARENT_POLL_S = 0.5
"""How often a worker process checks that the command that started it is still alive."""
RAY_CONNECT_TIMEOUT_S = 10.0
"""How long the Ray cluster at ``--address`` has to accept a TCP connection, and then to answer as a gRPC server."""
RAY_INIT_TIMEOUT_S = 120.0
"""How long ``ray.init`` may take (connecting to a cluster, or starting a local instance)."""
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""What an HTTP/2 client sends first (the preface, then an empty SETTINGS frame); a gRPC server answers SETTINGS."""
RAY_DEFAULT_PORTS = {"ray": 10001, "": 6379}
"""The port Ray uses when an address names none: the Ray Client server (``ray://``), the GCS."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or ``taskset`` narrows; else the count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_workers() -> int:
    """Worker processes when ``--jobs`` is not given: one per CPU."""
    return usable_cpus()


def check_jobs(jobs: int | None, address: str | None = None) -> int | None:
    """``--jobs``: at least one worker process, at most ``MAX_JOBS``; the count to use. More than this machine's CPUs
    is capped to them, with a warning on stderr: the points are CPU-bound, so more processes than CPUs only share
    them (and hold more memory). A Ray cluster (``--address``) has CPUs of its own: its count is kept."""
    if jobs is None:
        return None
    if not 1 <= jobs <= MAX_JOBS:
        raise UserError(f"--jobs {jobs}: give 1 to {MAX_JOBS} worker processes")
    cpus = usable_cpus()
    if jobs > cpus and not address:
        sys.stderr.write(f"warning: --jobs {jobs}: this machine has {cpus} CPU(s) to run on; running {cpus} workers\n")
        return cpus
    return jobs


class Interrupted(Exception, Generic[R]):  # noqa: N818 - it is not an error of the run, the user asked for it
    """A stop signal arrived: ``results`` has the finished jobs' results by job index; the rest never finished."""

    def __init__(self, signum: int, results: dict[int, R], total: int) -> None:
        self.signum = signum
        self.results = results
        self.total = total
        super().__init__(f"stopped by {signal.Signals(signum).name} after {len(results)} of {total} points")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Executor(Protocol):
    def map(
        self,
        fn: Callable[[Any], Any],
        jobs: Sequence[Any],
        on_done: Callable[[int], None] | None = None,
        timeout_s: float = 3600.0,
    ) -> list[Any]:
        """``fn(job)`` for every job, results in job order. Raises ``Interrupted`` on SIGINT/SIGTERM."""
        ...


class _StopFlag:
    """Set by SIGINT/SIGTERM while a run is in progress (the first signal wins; later ones are ignored).

    One flag serves every nested ``stop_signals``: a signal that arrives while an inner level is finishing (after its
    last look at the flag, say while its pool shuts down) is still seen by the level around it, instead of being
    kept in a flag nobody reads any more. ``levels`` holds each open level's ``raise_at_once``, innermost last."""

    def __init__(self, raise_at_once: bool) -> None:
        self.signum: int | None = None
        self.levels = [raise_at_once]

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum


_active_flag: _StopFlag | None = None
"""The flag of the outermost ``stop_signals`` open in the main thread (the one whose handlers are installed)."""


@contextmanager
def stop_signals(raise_at_once: bool = False) -> Iterator[_StopFlag]:
    """Catch SIGINT and SIGTERM for the duration (main thread only; elsewhere the flag never sets).

    ``raise_at_once`` is for work that runs in this process: a first signal that arrives while this level is the
    innermost raises ``KeyboardInterrupt`` where the work is, so the caller can stop between points without waiting
    for the current one. A nested level installs no handlers of its own: it shares the outer level's flag, so no
    signal is lost while handlers would be swapped, and the outer level sees a signal an inner level did not act on.
    Once the outermost level ends after a signal, further signals are ignored: the command only reports and writes
    what finished, and a second Ctrl-C must not cut that short."""
    global _active_flag
    if threading.current_thread() is not threading.main_thread():
        yield _StopFlag(raise_at_once)
        return
    if _active_flag is not None:
        flag = _active_flag
        flag.levels.append(raise_at_once)
        try:
            yield flag
        finally:
            flag.levels.pop()
        return
    flag = _StopFlag(raise_at_once)

    def handler(signum: int, frame: Any) -> None:
        first = flag.signum is None
        flag(signum, frame)
        if first and flag.levels[-1]:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    _active_flag = flag
    try:
        yield flag
    finally:
        _active_flag = None
        for s, h in previous.items():
            signal.signal(s, signal.SIG_IGN if flag.signum is not None else h)


def raise_if_stopped(flag: _StopFlag, results: dict[int, Any], total: int) -> None:
    """Raise ``Interrupted`` when a stop signal arrived after the run last looked, even if every job finished: the
    user asked the command to stop, and the levels around this run would otherwise go on."""
    if flag.signum is not None:
        raise Interrupted(flag.signum, results, total)


def watch_parent(parent: int, interval_s: float = PARENT_POLL_S) -> None:
    """Exit this (worker) process as soon as ``parent`` is no longer its parent: the parent died, however it died
    (a SIGKILLed parent runs no cleanup, and its orphaned workers would otherwise run their points to the end).
    A thread polling ``os.getppid``, because ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the worker ends,
    not the process, and the thread that forks a pool's workers need not be the main one."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="skyrl-sim-parent-watch", daemon=True).start()


def _worker_init(parent: int) -> None:
    """Workers leave SIGINT and SIGTERM to the parent (a terminal's Ctrl-C, ``timeout`` and ``docker stop`` signal the
    whole process group: a worker that died of it would break the pool before the parent could keep what finished),
    and exit when the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent)


def _stop_processes(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """SIGKILL every worker (they ignore SIGTERM, and a point holds nothing to clean up) and reap them all, each
    within ``GRACE_S``."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(GRACE_S)


class LocalExecutor:
    """Jobs in worker processes on this machine (forked, so they start cheap), or in this process for one worker."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise UserError(f"--jobs {workers}: needs at least one worker process")
        self.workers = workers

    def map(
        self,
        fn: Callable[[Any], Any],
        jobs: Sequence[Any],
        on_done: Callable[[int], None] | None = None,
        timeout_s: float = 3600.0,
    ) -> list[Any]:
        if self.workers <= 1 or len(jobs) <= 1:
            return self._in_process(fn, jobs, on_done)
        return self._pool(fn, jobs, on_done, timeout_s)

    @staticmethod
    def _in_process(fn: Callable[[Any], Any], jobs: Sequence[Any], on_done: Callable[[int], None] | None) -> list[Any]:
        results: dict[int, Any] = {}
        with stop_signals(raise_at_once=True) as flag:
            try:
                for index, job in enumerate(jobs):
                    results[index] = fn(job)
                    if on_done:
                        on_done(1)
            except KeyboardInterrupt:
                raise Interrupted(flag.signum or signal.SIGINT, results, len(jobs)) from None
            raise_if_stopped(flag, results, len(jobs))
        return [results[i] for i in range(len(jobs))]

    def _pool(
        self, fn: Callable[[Any], Any], jobs: Sequence[Any], on_done: Callable[[int], None] | None, timeout_s: float
    ) -> list[Any]:
        context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        pool = ProcessPoolExecutor(
            max_workers=min(self.workers, len(jobs)),
            mp_context=context,
            initializer=_worker_init,
            initargs=(os.getpid(),),
        )
        futures: dict[Future[Any], int] = {}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        clean = False
        with stop_signals() as flag:
            try:
                queue = iter(enumerate(jobs))
                pending: set[Future[Any]] = set()
                window = self.workers * SUBMIT_WINDOW  # jobs handed to the pool at once, not every one up front
                while True:
                    for i, job in itertools.islice(queue, max(0, window - len(pending))):
                        future = pool.submit(fn, job)
                        futures[future] = i
                        pending.add(future)
                    if not pending:
                        break
                    if flag.signum is not None:
                        raise Interrupted(flag.signum, results, len(jobs))
                    if time.monotonic() > deadline:
                        left = len(jobs) - len(results)
                        raise UserError(f"sweep: {left} of {len(jobs)} points did not finish within {timeout_s:.0f} s")
                    done, pending = wait(pending, timeout=TICK_S, return_when=FIRST_COMPLETED)
                    for future in done:
                        try:
                            result = future.result()  # a point's exception fails the sweep
                        except BrokenProcessPool:
                            raise Interrupted(self._broken_by(pool, flag), results, len(jobs)) from None
                        results[futures.pop(future)] = result
                        if on_done:
                            on_done(1)
                clean = True
            finally:
                if clean:
                    pool.shutdown(wait=True)
                else:
                    # ProcessPoolExecutor has no public way to stop running workers before Python 3.14.
                    processes = list(getattr(pool, "_processes", {}).values())
                    pool.shutdown(wait=False, cancel_futures=True)
                    _stop_processes(processes)
            raise_if_stopped(flag, results, len(jobs))  # a signal while the finished pool shut down
        return [results[i] for i in range(len(jobs))]


    @staticmethod
    def _broken_by(pool: ProcessPoolExecutor, flag: _StopFlag) -> int:
        """The signal that broke the pool: the stop signal the parent got (its handler may run a moment after the
        pool noticed the dead worker, so it is waited for briefly), else the signal that killed a worker."""
        deadline = time.monotonic() + BROKEN_POOL_WAIT_S
        while flag.signum is None and time.monotonic() < deadline:
            time.sleep(TICK_S / 5)
        if flag.signum is not None:
            return flag.signum
        codes = [p.exitcode for p in getattr(pool, "_processes", {}).values()]
        return next((-code for code in codes if code is not None and code < 0), signal.SIGKILL)


class RayExecutor:
    """One Ray task per job: a local Ray instance by default (started here, stopped afterwards), or the cluster at
    ``address``. ``on_crash(job, error_text)`` makes the result of a job whose worker died or raised; without it the
    error fails the run. Ray is imported only here, and only when this executor runs."""

    def __init__(
        self,
        address: str | None = None,
        num_cpus: int | None = None,
        on_crash: Callable[[Any, str], Any] | None = None,
    ) -> None:
        if address:
            ray_endpoint(address)  # a malformed address is refused before any work
        self.address = address
        self.num_cpus = num_cpus
        self.on_crash = on_crash

    def _ray(self) -> Any:
        try:
            import ray
        except ImportError:
            raise UserError("--executor ray: Ray is not installed (pip install 'skyrl-sim[ray]')") from None
        # The driver's C++ failure-signal handler (absl's, installed as ray.init connects) catches SIGTERM and aborts
        # the process (exit 134, the finished points lost); the command handles SIGTERM itself, as it does SIGINT.
        # Ray reads the switch when the driver connects (ray_constants, its environment variable at import).
        with contextlib.suppress(AttributeError, ImportError):
            ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
        return ray

    @contextmanager
    def session(self) -> Iterator[None]:
        """Ray connected for the whole block, for many ``map`` calls (``advise`` runs one configuration at a time, from
        several threads): started here and stopped at the end unless it was already running."""
        ray = self._ray()
        started_here = self._connect(ray)
        stopped: int | None = None
        try:
            yield
        except BaseException as exc:  # Interrupted, AdviseInterrupted: a stop signal
            stopped = getattr(exc, "signum", signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None)
            raise
        finally:
            if started_here:
                self._disconnect(ray, stopped)

    def _disconnect(self, ray: Any, stopped: int | None) -> None:
        """Stop Ray as this executor started it. After a stop signal a local instance is not waited for: Ray's own
        shutdown takes seconds (longer when the signal reached its processes too, as a signal to the process group
        does), and the command must write what finished and exit within a second. The command then leaves without
        Ray's exit handler (``leave_at_exit``), and the reaper ends the instance's processes once it is gone."""
        if stopped is not None and not self.address:
            leave_at_exit(128 + stopped)
            return
        ray.shutdown()

    def _connect(self, ray: Any) -> bool:
        """Start a local Ray instance or connect to ``address``, unless Ray is already initialised; True if here."""
        if ray.is_initialized():
            return False
        options: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            if self.address:
                check_reachable(self.address)
                with bounded_wait(f"the Ray cluster at {self.address}"):
                    ray.init(address=self.address, **options)
            else:
                # Ray's raylet signals a dead worker's whole process group; when a worker has not left the
                # group it was started in (this command's), that signal would stop the sweep itself. Ray runs its
                # workers at niceness 15 by default: on a busy machine the sweep, which is the point of the command,
                # would get the CPU last.
                with bounded_wait("a local Ray instance"):
                    ray.init(
                        num_cpus=self.num_cpus or os.cpu_count() or 1,
                        _system_config={"process_group_cleanup_enabled": False, "worker_niceness": 0},
                        **options,
                    )
                reap_when_gone()  # Ray's agents would outlive this command if it were killed with SIGKILL
        except UserError:
            raise
        except Exception as exc:  # Ray raises plain Exceptions too ("The current node timed out during startup")
            where = f"the cluster at {self.address}" if self.address else "a local Ray instance"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"--executor ray: cannot connect to {where}: {first}") from None
        return True

    def map(
        self,
        fn: Callable[[Any], Any],
        jobs: Sequence[Any],
        on_done: Callable[[int], None] | None = None,
        timeout_s: float = 3600.0,
    ) -> list[Any]:
        ray = self._ray()
        started_here = self._connect(ray)
        results: dict[int, Any] = {}
        refs: dict[Any, int] = {}
        clean = False
        stopped: int | None = None
        try:
            with stop_signals() as flag:
                task = ray.remote(max_retries=0)(fn)
                refs = {task.remote(job): i for i, job in enumerate(jobs)}
                pending = list(refs)
                deadline = time.monotonic() + timeout_s
                while pending:
                    if flag.signum is not None:
                        raise Interrupted(flag.signum, results, len(jobs))
                    if time.monotonic() > deadline:
                        raise UserError(
                            f"sweep: {len(pending)} of {len(jobs)} points did not finish within {timeout_s:.0f} s"
                        )
                    done, pending = ray.wait(pending, num_returns=1, timeout=TICK_S)
                    for ref in done:
                        index = refs[ref]
                        results[index] = self._result(ray, ref, jobs[index])
                        if on_done:
                            on_done(1)
                clean = True
                raise_if_stopped(flag, results, len(jobs))
        except Interrupted as stop:
            stopped = stop.signum
            raise
        finally:
            if not clean:
                for ref in refs:
                    if refs[ref] not in results:
                        ray.cancel(ref, force=True)
            if started_here:
                self._disconnect(ray, stopped)
        return [results[i] for i in range(len(jobs))]

    def _result(self, ray: Any, ref: Any, job: Any) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else None
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None  # the same error the local executor raises
            if self.on_crash is None:
                raise
            return self.on_crash(job, f"{type(cause or exc).__name__}: {cause or exc}")
        except ray.exceptions.RayError as exc:  # the worker process died (crash, kill, out of memory)
            if self.on_crash is None:
                raise
            return self.on_crash(job, f"worker died: {type(exc).__name__}: {str(exc).splitlines()[0]}")


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port a Ray ``--address`` names (``HOST[:PORT]`` for a GCS, ``ray://HOST[:PORT]`` for the Ray
    Client); None for ``auto`` / ``local``, which Ray resolves itself."""
    if address in ("auto", "local"):
        return None
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
    try:
        parts = urlsplit(f"//{rest}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if scheme not in RAY_DEFAULT_PORTS or not host or parts.path not in ("", "/") or any(c.isspace() for c in address):
        raise UserError(f"--address '{address}': expected HOST:PORT, ray://HOST:PORT or auto")
    return host, port or RAY_DEFAULT_PORTS[scheme]


def check_reachable(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """The cluster at ``address`` accepts a TCP connection and answers the HTTP/2 preface with a SETTINGS frame, each
    within ``timeout_s``; or one line naming it."""
    endpoint = ray_endpoint(address)
    if endpoint is None:
        return
    host, port = endpoint
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(HTTP2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
    except TimeoutError:
        raise UserError(
            f"--executor ray: no answer from the Ray cluster at {address} ({host}:{port}) within {timeout_s:g} s"
        ) from None
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise UserError(f"--executor ray: cannot reach the Ray cluster at {address} ({host}:{port}): {reason}") from None
    if len(head) < 9 or head[3] != 4:  # the frame type byte: 4 is SETTINGS
        raise UserError(
            f"--executor ray: {address} ({host}:{port}) answers, but not as a Ray cluster (no gRPC reply); "
            "give the head node's GCS address (HOST:6379) or its Ray Client address (ray://HOST:10001)"
        )


@contextmanager
def bounded_wait(what: str, timeout_s: float = RAY_INIT_TIMEOUT_S) -> Iterator[None]:
    """Run a blocking call that Python cannot interrupt (``ray.init``) with a deadline and working SIGINT / SIGTERM: a
    thread watches the signal wakeup fd (written by the C-level handler at once) and the clock, and ends the process
    with one line (exit 2 for the deadline, 128 + signal for a signal). Nothing has been computed at that point."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
            if done.is_set():
                return
            if not ready:
                _exit_now(f"{what} did not answer within {timeout_s:g} s", 2)
            for signum in os.read(read, 64):
                if signum in STOP_SIGNALS:
                    _exit_now(f"stopped by {signal.Signals(signum).name} while connecting to {what}", 128 + signum)

    watcher = threading.Thread(target=watch, name="skyrl-sim-connect-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        os.write(write, b"\0")  # wake the watcher; it sees `done` and returns
        watcher.join(5)
        os.close(read)
        os.close(write)


def leave_at_exit(code: int) -> None:
    """End the process with ``code`` once the command has returned and Python begins to exit, before Ray's exit
    handler (``atexit`` runs the last registered first) would wait seconds for a local instance that a stop signal
    already ended. Everything the command wrote is flushed first; the reaper ends what is left of the instance."""

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    atexit.register(leave)


def _exit_now(message: str, code: int) -> None:
    """One error line and the process ends (from a thread, while the main thread is blocked in C)."""
    try:
        sys.stderr.write(f"error: --executor ray: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


def make_executor(
    name: str, workers: int, address: str | None = None, on_crash: Callable[[Any, str], Any] | None = None
) -> Executor:
    """The executor a ``--executor NAME`` flag asks for."""
    if name == "local":
        if address:
            raise UserError("--address needs --executor ray")
        return LocalExecutor(workers)
    if name == "ray":
        return RayExecutor(address=address, num_cpus=workers, on_crash=on_crash)
    raise UserError(f"--executor {name}: unknown (choose from {', '.join(EXECUTORS)})")

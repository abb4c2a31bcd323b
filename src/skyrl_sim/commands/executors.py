"""Where sweep points run: local worker processes (the default) or Ray tasks, both stoppable by a signal.

An executor takes independent jobs and a function that turns one job into its result, and gives the results back in
job order. Two are built in:

- ``LocalExecutor``: a process pool on this machine (in this process for one worker). No Ray import.
- ``RayExecutor``: one Ray task per job, on a local Ray instance (started and stopped here) or on an existing cluster
  (``address``). A task whose worker dies gives that job a failure result made by ``on_crash``; the rest go on.

SIGINT and SIGTERM stop a run: the workers are terminated (SIGTERM, then SIGKILL after a grace period), every
result already finished is kept, and ``Interrupted`` carries them with the signal number, so the caller can write a
partial result and exit ``128 + signal`` (130 for SIGINT, 143 for SIGTERM). A second signal during that cleanup is
ignored, so it cannot deadlock the parent.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

from skyrl_sim.errors import UserError

J = TypeVar("J")
R = TypeVar("R")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 0.5
"""How long a worker gets to exit after SIGTERM before it is killed."""
TICK_S = 0.05
"""How often the parent looks for finished jobs and a stop signal."""
EXECUTORS = ("local", "ray")


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
    """Set by SIGINT/SIGTERM while a run is in progress (the first signal wins; later ones are ignored)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum


@contextmanager
def stop_signals(raise_at_once: bool = False) -> Iterator[_StopFlag]:
    """Catch SIGINT and SIGTERM for the duration (main thread only; elsewhere the flag never sets).

    ``raise_at_once`` is for work that runs in this process: the first signal raises ``KeyboardInterrupt`` where the
    work is, so the caller can stop between points without waiting for the current one."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        first = flag.signum is None
        flag(signum, frame)
        if raise_at_once and first:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield flag
    finally:
        # once stopped, the command only reports and writes what finished: a second Ctrl-C must not cut that short
        for s, h in previous.items():
            signal.signal(s, signal.SIG_IGN if flag.signum is not None else h)


def _worker_init() -> None:
    """Workers leave SIGINT to the parent (a terminal's Ctrl-C reaches the whole group) and die on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop_processes(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """SIGTERM every worker, SIGKILL what is still alive after ``GRACE_S``, and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(1.0)


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
        return [results[i] for i in range(len(jobs))]

    def _pool(
        self, fn: Callable[[Any], Any], jobs: Sequence[Any], on_done: Callable[[int], None] | None, timeout_s: float
    ) -> list[Any]:
        context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        pool = ProcessPoolExecutor(max_workers=min(self.workers, len(jobs)), mp_context=context, initializer=_worker_init)
        futures: dict[Future[Any], int] = {}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        clean = False
        with stop_signals() as flag:
            try:
                futures = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
                pending = set(futures)
                while pending:
                    if flag.signum is not None:
                        raise Interrupted(flag.signum, results, len(jobs))
                    if time.monotonic() > deadline:
                        raise UserError(
                            f"sweep: {len(pending)} of {len(jobs)} points did not finish within {timeout_s:.0f} s"
                        )
                    done, pending = wait(pending, timeout=TICK_S, return_when=FIRST_COMPLETED)
                    for future in done:
                        results[futures[future]] = future.result()  # a point's exception fails the sweep, as before
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
        return [results[i] for i in range(len(jobs))]


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
        self.address = address
        self.num_cpus = num_cpus
        self.on_crash = on_crash

    def _ray(self) -> Any:
        try:
            import ray
        except ImportError:
            raise UserError("--executor ray: Ray is not installed (pip install 'skyrl-sim[ray]')") from None
        return ray

    @contextmanager
    def session(self) -> Iterator[None]:
        """Ray connected for the whole block, for many ``map`` calls (``advise`` runs one configuration at a time, from
        several threads): started here and stopped at the end unless it was already running."""
        ray = self._ray()
        started_here = self._connect(ray)
        try:
            yield
        finally:
            if started_here:
                ray.shutdown()

    def _connect(self, ray: Any) -> bool:
        """Start a local Ray instance or connect to ``address``, unless Ray is already initialised; True if here."""
        if ray.is_initialized():
            return False
        options: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            if self.address:
                ray.init(address=self.address, **options)
            else:
                # Ray's raylet signals a dead worker's whole process group; when a worker has not left the
                # group it was started in (this command's), that signal would stop the sweep itself. Ray runs its
                # workers at niceness 15 by default: on a busy machine the sweep, which is the point of the command,
                # would get the CPU last.
                ray.init(
                    num_cpus=self.num_cpus or os.cpu_count() or 1,
                    _system_config={"process_group_cleanup_enabled": False, "worker_niceness": 0},
                    **options,
                )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"the cluster at {self.address}" if self.address else "a local Ray instance"
            raise UserError(f"--executor ray: cannot connect to {where}: {exc}") from None
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
        finally:
            if not clean:
                for ref in refs:
                    if refs[ref] not in results:
                        ray.cancel(ref, force=True)
            if started_here:
                ray.shutdown()
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

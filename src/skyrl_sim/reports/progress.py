"""Progress of anything the CLI does that can run for more than a few seconds: many variants, one long simulated run
(its requests), sweep points, advise's configurations, an import's rows.

Where and when:

- Always on **stderr**, so ``--json -`` on stdout stays pure JSON, and only once the work has taken
  ``SHOW_AFTER_S`` (a fast command draws nothing).
- ``auto`` (the default): a ``rich`` bar when stderr is a terminal, nothing otherwise; ``always`` (``--progress``,
  or ``SKYRL_SIM_PROGRESS=always``): also when stderr is a log or a pipe, as one plain line every
  ``PLAIN_EVERY_S``; ``never`` (``--no-progress``): nothing.
- The bar is transient: it disappears when the work ends, so what is printed afterwards reads the same with or
  without it. Work inside work (a long run inside a check of many variants) is one more line of the same bar.

A tracker is cheap to advance (an integer and, at most ten times a second, a clock read), so the simulator's engine
loop can advance it once per call.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

Mode = Literal["auto", "always", "never"]
MODES: tuple[Mode, ...] = ("auto", "always", "never")
MODE_ENV = "SKYRL_SIM_PROGRESS"
AFTER_ENV = "SKYRL_SIM_PROGRESS_AFTER_S"
SHOW_AFTER_S = 2.0
"""Work shorter than this shows no progress (``SKYRL_SIM_PROGRESS_AFTER_S`` changes it, for tests)."""
PLAIN_EVERY_S = 10.0
"""With ``always`` and no terminal, one line per this many seconds (and one when the work ends)."""

_mode: Mode | None = None
Advance = Callable[..., None]


def set_mode(mode: Mode | None) -> None:
    """The CLI's ``--progress`` / ``--no-progress`` (None: from ``SKYRL_SIM_PROGRESS``, else ``auto``)."""
    global _mode
    _mode = mode


def mode() -> Mode:
    if _mode is not None:
        return _mode
    value = os.environ.get(MODE_ENV, "auto").strip().lower()
    return value if value in MODES else "auto"  # type: ignore[return-value]


def show_after_s() -> float:
    try:
        return max(0.0, float(os.environ.get(AFTER_ENV, SHOW_AFTER_S)))
    except ValueError:
        return SHOW_AFTER_S


def stderr_console() -> Console:
    """Where progress is drawn (a function, so a test can give a terminal of its own)."""
    return Console(stderr=True)


class _Display:
    """The one rich bar of the process: every tracker that is shown is a line of it (rich allows one live display)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bar: Progress | None = None
        self.users = 0

    def add(self, description: str, total: int | None, done: int) -> TaskID:
        with self.lock:
            if self.bar is None:
                self.bar = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=stderr_console(),
                    transient=True,
                )
                self.bar.start()
            self.users += 1
            task = self.bar.add_task(description, total=total, completed=done)
            self.bar.refresh()  # drawn now, not at the next tick of rich's refresh thread
            return task

    def update(self, task: TaskID, done: int) -> None:
        bar = self.bar
        if bar is not None:
            bar.update(task, completed=done)

    def remove(self, task: TaskID) -> None:
        with self.lock:
            if self.bar is None:
                return
            self.bar.remove_task(task)
            self.users -= 1
            if self.users == 0:
                self.bar.stop()
                self.bar = None


_DISPLAY = _Display()


class Tracker:
    """One piece of work: ``advance(n)`` or ``update(done)``; shown once it has run ``show_after_s()``."""

    def __init__(self, description: str, total: int | None, unit: str = "") -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.done = 0
        self.started = time.monotonic()
        self._next_check = self.started
        self._task: TaskID | None = None
        self._stopped = threading.Event()
        self._printed = False
        self._thread: threading.Thread | None = None
        chosen = mode()
        terminal = chosen != "never" and stderr_console().is_terminal
        self._style = "bar" if terminal else "plain" if chosen == "always" else None
        if self._style is not None:
            self._thread = threading.Thread(target=self._watch, name="skyrl-sim-progress", daemon=True)
            self._thread.start()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._refresh()

    def update(self, done: int) -> None:
        self.done = done
        self._refresh()

    def _refresh(self) -> None:
        if self._task is None:
            return
        now = time.monotonic()
        if now >= self._next_check:  # at most ten redraw requests a second, however often the work advances
            self._next_check = now + 0.1
            _DISPLAY.update(self._task, self.done)

    def _line(self) -> str:
        elapsed = time.monotonic() - self.started
        count = f"{self.done:,}" + (f"/{self.total:,}" if self.total else "") + (f" {self.unit}" if self.unit else "")
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        return f"progress: {self.description}: {count}{share}, {elapsed:.0f} s"

    def _watch(self) -> None:
        """Shows the work once it has taken long enough; in plain mode, writes a line now and then."""
        if self._stopped.wait(show_after_s()):
            return
        if self._style == "bar":
            self._task = _DISPLAY.add(self.description, self.total, self.done)
            return
        while True:
            print(self._line(), file=sys.stderr, flush=True)
            self._printed = True
            if self._stopped.wait(PLAIN_EVERY_S):
                return

    def close(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._task is not None:
            _DISPLAY.remove(self._task)
            self._task = None
        elif self._printed:
            print(self._line() + " (done)", file=sys.stderr, flush=True)


@contextmanager
def tracking(description: str, total: int | None = None, unit: str = "") -> Iterator[Tracker]:
    """A ``Tracker`` for the block's work, closed (its line removed) when the block ends, however it ends."""
    tracker = Tracker(description, total, unit)
    try:
        yield tracker
    finally:
        tracker.close()


@contextmanager
def progress(console: Any, description: str, total: int) -> Iterator[Advance]:
    """Yield ``advance(n=1)`` for ``total`` steps (``console`` is not drawn on: progress goes to stderr)."""
    with tracking(description, total) as tracker:
        yield tracker.advance

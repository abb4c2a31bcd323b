"""A progress bar for anything the CLI does that can run longer than a second (variants, sweep points, plots).

It draws on the terminal only (never into a pipe, a file or a test's captured output) and disappears when done,
so the tables printed afterwards read the same with or without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress(console: Console, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; a transient bar of ``total`` steps is shown when the console is a terminal."""
    if not console.is_terminal or total <= 1:
        yield lambda n=1: None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)

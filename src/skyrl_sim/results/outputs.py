"""Every file skyrl-sim writes goes through here: checked before the run, written atomically, named safely.

- ``check_output_file`` / ``check_output_dir`` run before a (possibly long) run starts, so a missing directory, a path
  that is a directory, or a read-only place is one clear error (exit 2) instead of a lost run.
- ``write_atomic`` writes a temporary file in the same directory and ``os.replace``\\ s it over the target: a reader (or
  a ``kill -9`` at any moment) sees the old file or the whole new one, never a truncated one. ``-`` means stdout.
- ``safe_name`` turns a scenario, variant or backend name into one path component (no ``/``, no ``..``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from skyrl_sim.errors import UserError

STDOUT = "-"


def safe_name(text: str) -> str:
    """One file-name-safe path component: anything but letters, digits, ``.``, ``_`` and ``-`` becomes ``_``; leading
    and trailing dots and underscores go (no ``..``, no hidden file); nothing left becomes ``run``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._")[:200] or "run"


def _writable_dir(directory: Path, flag: str, target: str) -> None:
    if not directory.exists():
        raise UserError(f"{flag} '{target}': directory '{directory}' does not exist")
    if not directory.is_dir():
        raise UserError(f"{flag} '{target}': '{directory}' is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"{flag} '{target}': directory '{directory}' is not writable")


def check_output_file(path: str | None, flag: str, allow_stdout: bool = True) -> None:
    """Refuse an output file path that cannot be written, before any work is done."""
    if path is None:
        return
    if path == STDOUT:
        if not allow_stdout:
            raise UserError(f"{flag} '-': this output cannot go to stdout; give a file path")
        return
    if not path.strip():
        raise UserError(f"{flag} '': an empty path; give a file path" + (" or '-' for stdout" if allow_stdout else ""))
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag} '{path}': is a directory; give a file path")
    if target.exists() and not os.access(target, os.W_OK):
        raise UserError(f"{flag} '{path}': the file is read-only")
    _writable_dir(target.parent if str(target.parent) else Path("."), flag, path)


def check_output_dir(path: str | None, flag: str) -> None:
    """Refuse an output directory that cannot be created or written (it may not exist yet; its parent must)."""
    if path is None:
        return
    if not path.strip() or path == STDOUT:
        raise UserError(f"{flag} '{path}': give a directory path")
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise UserError(f"{flag} '{path}': exists and is not a directory")
        _writable_dir(target, flag, path)
        return
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    _writable_dir(parent, flag, path)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path in the target's directory; on success it replaces ``path`` in one step, on error it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp" + target.suffix, dir=target.parent)
    os.close(handle)
    try:
        yield Path(temp)
        with open(temp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_atomic(path: str | Path, data: bytes | str) -> Path | None:
    """Write ``data`` to ``path`` atomically, or to stdout when ``path`` is ``-`` (returns None then)."""
    raw = data.encode() if isinstance(data, str) else data
    if str(path) == STDOUT:
        sys.stdout.flush()
        sys.stdout.buffer.write(raw if raw.endswith(b"\n") else raw + b"\n")
        sys.stdout.buffer.flush()
        return None
    with atomic_path(path) as temp:
        temp.write_bytes(raw)
    return Path(path)


def write_with(path: str | Path, writer: Callable[[Path], object]) -> Path:
    """Let ``writer`` write a temporary file (e.g. ``fig.savefig``), then move it over ``path`` atomically."""
    with atomic_path(path) as temp:
        writer(temp)
    return Path(path)

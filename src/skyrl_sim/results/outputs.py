"""Every file skyrl-sim writes goes through here: checked before the run, written atomically, named safely.

- ``check_outputs`` runs before a (possibly long) run starts, once per command with all of its outputs, so a bad
  output is one clear error (exit 2) instead of a lost run. Each path must fit the file system's name limits
  (``NAME_MAX`` per component, ``PATH_MAX`` in all); an existing file must be a regular file (a symlink counts as the
  file it points to, which is written, the link kept); a directory to write in (or to create) must be one the
  command can create files in, found by creating and removing a probe file there (so ``/proc``, ``/sys`` and
  read-only mounts are refused even for root). No two outputs of one command may be one file (same path after
  symlinks, or the same inode), no output may be one of the command's inputs, and at most one output may be ``-``
  (stdout), which must be open. The inputs are those given and every file the command has read so far
  (``schema.command_files``: an endpoint found by name, an HF config, a hardware profile); a file read later that is
  an output is refused as it is read, and the writer refuses to replace any file the command read.
- ``write_atomic`` / ``write_with`` write a temporary file in the target's directory and ``os.replace`` it over the
  target: a reader (or a ``kill -9`` at any moment) sees the old file or the whole new one, never a truncated one. The
  new file gets the replaced file's permissions, or the umask's (``0666 & ~umask``), as any new file does. ``-`` means
  stdout; a stdout that is closed, full or a broken pipe raises ``StdoutError`` (one line, no traceback).
- ``safe_name`` turns a scenario, variant or backend name into one path component (no ``/``, no ``..``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from skyrl_sim.errors import UserError
from skyrl_sim.schema.command_files import Identity, identity, input_role, inputs_read, note_outputs, note_written, same_file

STDOUT = "-"
DEFAULT_NAME_MAX = 255
DEFAULT_PATH_MAX = 4096


class StdoutError(UserError):
    """Standard output cannot take what the command writes: it is closed, full, or a pipe whose reader left."""

    def __init__(self, reason: str, broken_pipe: bool = False) -> None:
        self.broken_pipe = broken_pipe
        super().__init__(f"stdout: {reason}")

    @property
    def exit_code(self) -> int:
        """141 (128 + SIGPIPE, as a shell tool killed by SIGPIPE) for a broken pipe, 2 otherwise."""
        return 141 if self.broken_pipe else 2


@dataclass(frozen=True)
class Output:
    """One output of a command: the flag that names it, its path (None: not asked for), a file or a directory, and
    whether ``-`` (stdout) may stand for it."""

    flag: str
    path: str | Path | None
    kind: Literal["file", "dir"] = "file"
    stdout: bool = True


def safe_name(text: str) -> str:
    """One file-name-safe path component: anything but letters, digits, ``.``, ``_`` and ``-`` becomes ``_``; leading
    and trailing dots and underscores go (no ``..``, no hidden file); nothing left becomes ``run``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._")[:200] or "run"


# ------------------------------------------------------------------------------------------------ checks


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _nearest_existing(path: Path) -> Path:
    """``path`` itself or the closest ancestor that exists."""
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def _limit(directory: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(directory, name))
    except (OSError, ValueError):
        return default


def _check_lengths(flag: str, given: str, path: Path) -> None:
    """Every component within ``NAME_MAX`` bytes and the whole path within ``PATH_MAX`` (of the file system it would
    be written on)."""
    where = _nearest_existing(path)
    where = where if where.is_dir() else where.parent
    name_max = _limit(where, "PC_NAME_MAX", DEFAULT_NAME_MAX)
    path_max = _limit(where, "PC_PATH_MAX", DEFAULT_PATH_MAX)
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > name_max:
            raise UserError(
                f"{flag} '{given}': a name of {size} bytes is longer than the file system allows ({name_max} bytes)"
            )
    size = len(os.fsencode(str(path)))
    if size >= path_max:
        raise UserError(f"{flag} '{given}': the path is {size} bytes, longer than the file system allows ({path_max})")


def _probe(directory: Path, flag: str, given: str) -> None:
    """The command can create (and remove) a file in ``directory``: tried, since permission bits do not tell (root,
    ``/proc``, read-only mounts)."""
    probe = directory / f".skyrl-sim-probe-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise UserError(f"{flag} '{given}': directory '{directory}' is not writable ({exc.strerror})") from None
    with contextlib.suppress(OSError):
        os.unlink(probe)


def _resolved(path: Path) -> Path:
    """The path with every symlink followed (absolute; a missing tail is kept as given)."""
    return Path(os.path.realpath(path))


def _check_file(flag: str, given: str, path: Path) -> None:
    _check_lengths(flag, given, path.absolute())
    target = _resolved(path)
    if str(given).endswith(os.sep):
        raise UserError(f"{flag} '{given}': names a directory; give a file path")
    try:
        info = os.stat(target)
    except FileNotFoundError:
        info = None
    except OSError as exc:  # a symlink loop, a component that is a file
        raise UserError(f"{flag} '{given}': {exc.strerror}") from None
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            raise UserError(f"{flag} '{given}': is a directory; give a file path")
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{flag} '{given}': is {_kind_of(info.st_mode)}; skyrl-sim replaces only regular files")
        if not os.access(target, os.W_OK):
            raise UserError(f"{flag} '{given}': the file is read-only")
    parent = target.parent
    if not parent.exists():
        raise UserError(f"{flag} '{given}': directory '{parent}' does not exist")
    if not parent.is_dir():
        raise UserError(f"{flag} '{given}': '{parent}' is not a directory")
    _probe(parent, flag, given)


def _check_dir(flag: str, given: str, path: Path) -> None:
    _check_lengths(flag, given, path.absolute())
    target = _resolved(path)
    if target.exists():
        if not target.is_dir():
            raise UserError(f"{flag} '{given}': exists and is not a directory")
        _probe(target, flag, given)
        return
    existing = _nearest_existing(target)
    if not existing.is_dir():
        raise UserError(f"{flag} '{given}': '{existing}' is not a directory")
    _probe(existing, flag, given)


def check_stdout_open() -> None:
    """Standard output must be open for ``-`` (a command started with ``>&-`` has none)."""
    stream = sys.stdout
    try:
        if stream is None:
            raise OSError(errno.EBADF, "closed")
        fileno = stream.fileno()
    except (OSError, ValueError, AttributeError):
        if stream is None:
            raise StdoutError("is closed; nothing can be written to it") from None
        return  # a stream without a file descriptor (a test's capture): writable
    try:
        os.fstat(fileno)
    except OSError:
        raise StdoutError("is closed; nothing can be written to it") from None


def check_outputs(outputs: Iterable[Output], inputs: Iterable[tuple[str, str | Path | None]] = ()) -> None:
    """Check every output of one command before it does any work (see the module docstring); ``inputs`` are
    (description, path) of what the command reads, which no output may replace."""
    given = [o for o in outputs if o.path is not None]
    to_stdout = [o.flag for o in given if str(o.path) == STDOUT]
    if len(to_stdout) > 1:
        raise UserError(f"{' - and '.join(to_stdout)} -: only one output can go to stdout")
    seen: list[tuple[Output, Identity]] = []
    for output in given:
        text = str(output.path)
        if text == STDOUT:
            if not output.stdout or output.kind == "dir":
                what = "a directory" if output.kind == "dir" else "a file"
                raise UserError(f"{output.flag} '-': this output cannot go to stdout; give {what} path")
            check_stdout_open()
            continue
        if not text.strip():
            hint = " or '-' for stdout" if output.stdout else ""
            raise UserError(f"{output.flag} '': an empty path; give a {output.kind} path{hint}")
        if "\x00" in text:
            raise UserError(f"{output.flag}: the path holds a NUL character")
        path = Path(text)
        (_check_dir if output.kind == "dir" else _check_file)(output.flag, text, path)
        found = identity(path)
        for other, other_identity in seen:
            if same_file(found, other_identity):
                raise UserError(
                    f"{other.flag} '{other.path}' and {output.flag} '{text}' are the same path: give each output its own"
                )
        seen.append((output, found))
    read = [(role, path) for role, path in inputs_read()]  # every file read so far, however it was named
    for description, source in [*inputs, *read]:
        if source is None or str(source) in ("", STDOUT):
            continue
        source_identity = identity(Path(source))
        for output, output_identity in seen:
            if same_file(output_identity, source_identity):
                raise UserError(
                    f"{output.flag} '{output.path}' is {description} the command reads; give another output path"
                )
    note_outputs([(output.flag, str(output.path)) for output, _ in seen])  # a file read later is checked as read


def check_output_file(path: str | None, flag: str, allow_stdout: bool = True) -> None:
    """Refuse an output file path that cannot be written, before any work is done (one output; ``check_outputs``
    checks a command's outputs together)."""
    check_outputs([Output(flag, path, "file", allow_stdout)])


def check_output_dir(path: str | None, flag: str) -> None:
    """Refuse an output directory that cannot be created or written (it may not exist yet; an ancestor must)."""
    check_outputs([Output(flag, path, "dir", stdout=False)])


# ------------------------------------------------------------------------------------------------ writing


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells (``/proc/self/status``)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_target(path: Path) -> tuple[Path, int]:
    """Where the bytes of ``path`` go (through a symlink to its target) and the mode the file gets; refuses anything
    that is not a regular file."""
    target = _resolved(path) if path.is_symlink() else path
    try:
        info = os.stat(target)
    except FileNotFoundError:
        return target, 0o666 & ~_umask()
    except OSError as exc:
        raise UserError(f"cannot write '{path}': {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"cannot write '{path}': it is {_kind_of(info.st_mode)}; skyrl-sim replaces only regular files")
    return target, stat.S_IMODE(info.st_mode)


def _temp_name(target: Path) -> str:
    """A hidden temporary name beside ``target`` that keeps its suffix (matplotlib picks the format from it) and fits
    ``NAME_MAX`` whatever the target's length."""
    suffix = ".tmp" + target.suffix[:16]
    name_max = _limit(target.parent, "PC_NAME_MAX", DEFAULT_NAME_MAX)
    room = max(1, name_max - len(suffix.encode()) - 10)
    stem = os.fsencode(target.name)[:room].decode(errors="ignore")
    return f".{stem}.{secrets.token_hex(4)}{suffix}"


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path in the target's directory; on success it replaces ``path`` in one step, on error it is removed.
    An OSError (a full disk, a directory that vanished) becomes a UserError naming ``path``."""
    given = Path(path)
    try:
        given.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write '{path}': cannot create directory '{given.parent}': {exc.strerror}") from None
    target, mode = _write_target(given)
    role = input_role(target)
    if role is not None:  # the last guard: check_outputs and the readers refuse this before any work
        raise UserError(f"cannot write '{path}': it is {role} the command reads; give another output path")
    temp = target.parent / _temp_name(target)
    try:
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise UserError(f"cannot write '{path}': {exc.strerror}") from None
    try:
        yield temp
        with open(temp, "rb+") as written:
            os.fsync(written.fileno())
        os.chmod(temp, mode)
        os.replace(temp, target)
        note_written(target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise UserError(f"cannot write '{path}': {exc.strerror or exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_stdout(raw: bytes) -> None:
    """``raw`` (and a final newline) to standard output, or a ``StdoutError`` saying why it could not be written."""
    stream = sys.stdout
    if stream is None:
        raise StdoutError("is closed; nothing can be written to it")
    try:
        stream.flush()
        stream.buffer.write(raw if raw.endswith(b"\n") else raw + b"\n")
        stream.buffer.flush()
    except BrokenPipeError:
        raise StdoutError("the reading end of the pipe was closed before the output was written", True) from None
    except (OSError, ValueError) as exc:
        raise StdoutError(f"cannot write to it: {getattr(exc, 'strerror', None) or exc}") from None


def write_atomic(path: str | Path, data: bytes | str) -> Path | None:
    """Write ``data`` to ``path`` atomically, or to stdout when ``path`` is ``-`` (returns None then)."""
    raw = data.encode(errors="backslashreplace") if isinstance(data, str) else data
    if str(path) == STDOUT:
        write_stdout(raw)
        return None
    with atomic_path(path) as temp:
        temp.write_bytes(raw)
    return Path(path)


def write_with(path: str | Path, writer: Callable[[Path], object]) -> Path:
    """Let ``writer`` write a temporary file (e.g. ``fig.savefig``), then move it over ``path`` atomically."""
    with atomic_path(path) as temp:
        writer(temp)
    return Path(path)


class GuardedStream:
    """A text stream (the console's stdout) whose write errors become one ``StdoutError`` instead of a traceback: a
    closed pipe (``| head``), a full device (``> /dev/full``)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise StdoutError("the reading end of the pipe was closed", True) from None
        except OSError as exc:
            raise StdoutError(f"cannot write to it: {exc.strerror or exc}") from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise StdoutError("the reading end of the pipe was closed", True) from None
        except OSError as exc:
            raise StdoutError(f"cannot write to it: {exc.strerror or exc}") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

"""The files one command reads and the outputs it will write: no output may replace an input.

A command's inputs are more than its arguments: a scenario names an endpoint (by name or path), an endpoint names an
HF ``config.json`` and a hardware profile (a calibrated profile names its base), ``--set`` and ``--grid`` can name
others, and a command reads a database, a service log or saved RunResults. Every reader notes the file it opens here
(``note_input``: the documents loader, the profile loader, the database and log readers), so the list is complete
however a file was named (a name looked up in ``endpoints/``, a relative or absolute path, ``./x``, a symlink, a hard
link: two paths are one file when they resolve to the same path or the same inode).

The CLI opens one ``command_scope`` per command. Inside it:

- ``results.outputs.check_outputs`` refuses an output that is a file read so far, and registers the outputs;
- a file read after that (a lazily loaded profile, a grid point's HF config) that is a registered output is refused
  as it is read, before anything is written;
- the atomic writer refuses to replace a file read in this command (the last guard), and a file the command itself
  wrote is no input when it reads it back.

Outside a scope (the Python API, tests calling loaders) nothing is recorded and nothing is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from skyrl_sim.errors import UserError

Identity = tuple[str, tuple[int, int] | None]
"""What makes two paths one file: the path with every symlink followed, and (device, inode) when the file exists."""


def identity(path: str | Path) -> Identity:
    """The identity of ``path`` (see ``Identity``); a missing file has no inode."""
    target = os.path.realpath(path)
    try:
        info = os.stat(target)
    except (OSError, ValueError):
        return target, None
    return target, (info.st_dev, info.st_ino)


def same_file(a: Identity, b: Identity) -> bool:
    """One file: the same resolved path, or the same inode (a hard link)."""
    return a[0] == b[0] or (a[1] is not None and a[1] == b[1])


@dataclass
class _Scope:
    """One command's files: what it read (identity -> role), what it will write (flag, path), what it wrote."""

    inputs: dict[Identity, str] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    outputs: list[tuple[str, str, Identity]] = field(default_factory=list)
    written: list[Identity] = field(default_factory=list)


_scope: _Scope | None = None


@contextmanager
def command_scope() -> Iterator[None]:
    """Record the files of one command for its duration (the CLI opens one per command)."""
    global _scope
    outer, _scope = _scope, _Scope()
    try:
        yield
    finally:
        _scope = outer


def note_input(path: str | Path, role: str = "a file") -> None:
    """``path`` is read by the running command as ``role`` ("the endpoint file", "the HF config"): it is recorded, and
    refused when it is one of the command's outputs. Cheap for a path noted before (the profile is asked for per
    call)."""
    scope = _scope
    if scope is None:
        return
    text = os.fspath(path)
    if text in scope.seen:
        return
    scope.seen.add(text)
    found = identity(text)
    if found[1] is None or any(same_file(found, wrote) for wrote in scope.written):
        return  # not there (its reader says so), or written by this command: no input
    scope.inputs.setdefault(found, role)
    for flag, given, output in scope.outputs:
        if same_file(found, output):
            raise UserError(f"{flag} '{given}' is {role} the command reads ({text}); give another output path")


def input_role(path: str | Path) -> str | None:
    """The role of ``path`` when the running command has read it (None: not an input, or no command running)."""
    scope = _scope
    if scope is None:
        return None
    found = identity(path)
    for known, role in scope.inputs.items():
        if same_file(found, known):
            return role
    return None


def inputs_read() -> list[tuple[str, str]]:
    """(role, resolved path) of every file the running command has read so far."""
    scope = _scope
    return [] if scope is None else [(role, known[0]) for known, role in scope.inputs.items()]


def note_outputs(outputs: list[tuple[str, str]]) -> None:
    """The running command's checked outputs (flag, path): a file read after this is refused when it is one."""
    scope = _scope
    if scope is not None:
        scope.outputs.extend((flag, given, identity(given)) for flag, given in outputs)


def note_written(path: str | Path) -> None:
    """The running command wrote ``path``: reading it back later is no input."""
    scope = _scope
    if scope is not None:
        scope.written.append(identity(path))

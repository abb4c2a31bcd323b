"""Reading user documents (YAML and JSON files) safely: one loader for every file skyrl-sim reads.

Every problem becomes a ``ScenarioError`` naming the file and the reason, never a traceback: files that are not regular
files (``/dev/zero``), larger than the size limit, not UTF-8 (binary, UTF-16), YAML with duplicate keys (PyYAML keeps
the last one silently), and nesting deeper than the limit (PyYAML and ``json`` recurse, so deep nesting would raise
``RecursionError``).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import ValidationError

from skyrl_sim.errors import ScenarioError
from skyrl_sim.schema.command_files import note_input
from skyrl_sim.schema.limits import MAX_DOCUMENT_BYTES, MAX_NESTING, MAX_NUMBER_DIGITS


def read_bytes(path: Path, limit: int = MAX_DOCUMENT_BYTES, role: str = "a file") -> bytes:
    """The bytes of a regular file no larger than ``limit``; a ScenarioError otherwise. The file is noted as an input
    of the running command (``role``: what it is to the command), which no output may replace."""
    note_input(path, role)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ScenarioError(str(path), "", f"cannot read file: {kind}")
        if info.st_size > limit:
            raise ScenarioError(str(path), "", f"file is {info.st_size:,} bytes, over the limit of {limit:,}")
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        raise ScenarioError(str(path), "", "no such file") from None
    except OSError as exc:
        raise ScenarioError(str(path), "", f"cannot read file: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ScenarioError(str(path), "", f"file is over the limit of {limit:,} bytes")
    return data


def decode_text(path: Path, data: bytes) -> str:
    """UTF-8 text (a UTF-8 byte-order mark is allowed); binary and UTF-16 files are refused with the reason."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ScenarioError(str(path), "", "file is UTF-16 encoded; save it as UTF-8")
    if b"\x00" in data:
        raise ScenarioError(str(path), "", "file is binary (holds NUL bytes), not a UTF-8 text document")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ScenarioError(str(path), "", f"file is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: 10x faster parsing
_OPENING = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSING = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


class _StrictLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    """A safe loader that refuses duplicate mapping keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (each key may appear once)", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> Any:
        """An integer of more than ``MAX_NUMBER_DIGITS`` digits is refused here, with its line (Python's own limit on
        converting digits, 4,300, would otherwise end in a ValueError)."""
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_NUMBER_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"a number of {digits:,} digits (at most {MAX_NUMBER_DIGITS})", node.start_mark
            )
        return super().construct_yaml_int(node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
# YAML 1.1 (PyYAML) reads ``1e-6`` as a string: a float needs a dot there. YAML 1.2, JSON and every user read it as a
# number, so an exponent without a dot resolves to a float too.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _check_nesting(text: str) -> None:
    """Refuse nesting deeper than ``MAX_NESTING`` from the parser's event stream (flat, so it cannot recurse) before
    the recursive composer sees the document."""
    depth = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, _OPENING):
            depth += 1
            if depth > MAX_NESTING:
                raise yaml.constructor.ConstructorError(
                    None, None, f"nested deeper than {MAX_NESTING} levels", event.start_mark
                )
        elif isinstance(event, _CLOSING):
            depth -= 1


_SURROGATE_ESCAPE = re.compile(r"\\(?:u|U0000)[dD][89a-fA-F]")


def refuse_surrogates(data: Any, text: str, origin: str) -> Any:
    """``data`` parsed from ``text``, unless an escape (``\\ud800``) made a string that is not valid Unicode: a lone
    surrogate cannot be printed or written as UTF-8 or JSON. Walked only when such an escape is in the text (a
    valid pair, an emoji written ``\\ud83d\\ude00``, is one character once parsed and passes)."""
    if not _SURROGATE_ESCAPE.search(text):
        return data
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                reason = f"a string holds a lone surrogate escape: {item!r} is not valid Unicode"
                raise ScenarioError(origin, "", reason) from None
    return data


_REFUSALS = ("duplicate key", "a number of", "nested deeper")
"""Problems of a document that is well-formed YAML but holds something refused (``_StrictLoader``'s)."""


def parse_yaml(text: str, origin: str) -> Any:
    """A YAML document, or a ScenarioError naming ``origin``, the line and the problem."""
    try:
        _check_nesting(text)
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
        return refuse_surrogates(data, text, origin)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        if "nesting depth" in problem:  # libyaml's own, higher limit
            problem = f"nested deeper than {MAX_NESTING} levels"
        refused = problem.startswith(_REFUSALS)
        raise ScenarioError(origin, "", f"{problem}{where}" if refused else f"malformed YAML{where}: {problem}") from None
    except RecursionError:
        raise ScenarioError(origin, "", f"nested deeper than {MAX_NESTING} levels") from None


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _json_depth(text: str) -> int:
    """Nesting depth of valid JSON text: the brackets left once strings are taken out, counted as numpy steps
    (a 1 GiB RunResult or a 10^6-request scenario is tens of millions of values; walking them in Python took
    longer than parsing them)."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def parse_document(text: str, origin: str) -> Any:
    """A YAML document, read by the JSON parser when it is a JSON object: JSON is YAML, and the JSON parser reads a
    10^6-request import (42 MiB) in about a second where PyYAML takes most of a minute. Anything the JSON path
    refuses (not JSON, a duplicate key, too deep) is read as YAML, which gives the answer and the error message every
    YAML file gets, so the two paths cannot disagree about what a file says."""
    if text.lstrip("\ufeff \t\r\n").startswith("{"):
        try:
            data = _json_value(text, refuse_duplicates=True)
        except (ValueError, RecursionError):
            pass
        else:
            if _json_depth(text) <= MAX_NESTING:
                return refuse_surrogates(data, text, origin)
    return parse_yaml(text, origin)


def load_yaml_file(path: Path, limit: int = MAX_DOCUMENT_BYTES, role: str = "a file") -> Any:
    """A YAML (or JSON) file through every check above."""
    return parse_document(decode_text(path, read_bytes(path, limit, role)), str(path))


def _json_value(text: str, refuse_duplicates: bool = False) -> Any:
    """JSON text as Python values; NaN and Infinity (and, if asked, a key twice in one object) raise ValueError."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        mapping = dict(pairs)
        if len(mapping) != len(pairs):
            seen: set[str] = set()
            twice = next(key for key, _ in pairs if key in seen or seen.add(key))
            raise ValueError(f"duplicate key '{twice[:120]}' (each key may appear once)")
        return mapping

    return json.loads(text, parse_constant=constant, object_pairs_hook=unique if refuse_duplicates else None)


def load_json_file(
    path: Path, limit: int = MAX_DOCUMENT_BYTES, role: str = "a file", refuse_duplicates: bool = False
) -> Any:
    """A JSON file through the same checks (size, encoding, nesting); NaN and Infinity are refused."""
    return parse_json(decode_text(path, read_bytes(path, limit, role)), str(path), refuse_duplicates=refuse_duplicates)


def parse_json(text: str, origin: str, limit: int = MAX_DOCUMENT_BYTES, refuse_duplicates: bool = False) -> Any:
    """JSON text (a file's, or a flag's value such as ``--backend-config '{...}'``) with a file's checks: valid
    Unicode, at most ``limit`` bytes, nested at most ``MAX_NESTING`` levels, no NaN or Infinity (and, if asked, no key
    twice in one object, as a scenario file); a ScenarioError naming ``origin`` otherwise."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # an argument's bytes that are not UTF-8 arrive as lone surrogates
        raise ScenarioError(origin, "", f"not UTF-8 text (character {exc.start})") from None
    if size > limit:
        raise ScenarioError(origin, "", f"{size:,} bytes, over the limit of {limit:,}")
    try:
        data = _json_value(text, refuse_duplicates)
    except RecursionError:
        raise ScenarioError(origin, "", f"nested deeper than {MAX_NESTING} levels") from None
    except ValueError as exc:
        raise ScenarioError(origin, "", f"not valid JSON: {exc}") from None
    if _json_depth(text) > MAX_NESTING:
        raise ScenarioError(origin, "", f"nested deeper than {MAX_NESTING} levels")
    return refuse_surrogates(data, text, origin)


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not str(p).startswith("function-after") and p not in ("str", "dict[str,any]")]
    return ".".join(parts)


def validation_error(path: str, prefix: str, exc: ValidationError) -> ScenarioError:
    first = exc.errors()[0]
    key = _format_loc(first["loc"])
    if prefix:
        key = f"{prefix}.{key}" if key else prefix
    reason = first["msg"].removeprefix("Value error, ")  # a validator's own ValueError says what and where
    if first["type"] == "extra_forbidden":
        reason = "unknown key"
    elif first["type"] == "missing":
        reason = "required key is missing"
    more = len(exc.errors()) - 1
    if more:
        reason += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ScenarioError(path, key, reason)


def read_yaml(path: Path, limit: int = MAX_DOCUMENT_BYTES, role: str = "a file") -> dict[str, Any]:
    """A YAML mapping from a file, or a ScenarioError that says what is wrong with it (every limit above applies)."""
    data = load_yaml_file(path, limit, role)
    if not isinstance(data, dict):
        raise ScenarioError(str(path), "", "the file must hold a YAML mapping")
    return data

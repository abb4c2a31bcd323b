"""Dotted-key overrides (a variant's ``set``, ``--set``, ``--grid``): reading a value as YAML would, applying it to a
document copy on write, and reporting an error against the override that caused it.

An override addresses the workload (``workload.clients.0.submit.gap_s``) or, by default, the endpoint
(``engine.cap_aware_padding``, also written ``endpoint.engine.cap_aware_padding``).
"""

from __future__ import annotations

import re
from typing import Any

from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.schema.documents import parse_yaml
from skyrl_sim.schema.limits import MAX_INDEX_DIGITS


def parse_value(text: str, origin: str = "--set") -> Any:
    """A --set value as YAML would read it (numbers, booleans, null, lists); a plain string if it is no YAML value.
    Text that is not valid Unicode (a lone surrogate from undecodable bytes) and YAML that is well-formed but refused
    (a duplicate key, nesting or a number past the limits) are errors. An empty value is an error too: YAML would
    read it as null, which for a limit means "unlimited"; write ``null``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{origin}: the value is not valid UTF-8 text") from None
    if not text.strip():
        raise UserError(f"{origin}: the value is empty; give one (null, where the setting may be unset)")
    try:
        return parse_yaml(text, origin)
    except ScenarioError as exc:
        if not exc.reason.startswith("malformed YAML"):
            raise UserError(f"{origin}: {exc.reason}") from None
        return text


REPLACED_WHOLE: frozenset[str] = frozenset({"model"})
"""Endpoint keys whose mapping is replaced, not merged: ``model`` names one model (``{config: path}`` or ``{preset:
name, ...}``), and a new reference must not keep keys of the old one."""


def merged_section(current: Any, value: Any) -> Any:
    """``value`` merged into ``current`` when both are mappings (recursively: a key ``value`` does not name keeps its
    value), else ``value``. Lists and values replace. Copies only the mappings it changes."""
    if not isinstance(current, dict) or not isinstance(value, dict):
        return value
    out = dict(current)
    for key, item in value.items():
        out[key] = merged_section(current.get(key), item)
    return out


def apply_override(data: dict[str, Any], dotted: str, value: Any, origin: str, merge: bool = True) -> dict[str, Any]:
    """``data`` with ``a.b.c`` (list indices allowed) set to ``value``; the key path must already make sense.

    A mapping set on a section is merged into it (``--set 'trainer={micro_train_batch_size_per_gpu: 8}'`` changes that
    key and keeps the others, as ``--set trainer.micro_train_batch_size_per_gpu=8`` does) unless ``merge`` is false;
    an empty mapping would change nothing and is refused, since it reads as "reset this section".

    Copy on write: the result is a new mapping that copies only the mappings and lists on the key's path and shares
    the rest with ``data``, which is left as it was, so resolving a variant of a 10^6-request workload (or each point
    of a sweep over it) does not copy the workload."""
    if value == {}:
        raise ScenarioError(
            origin, dotted, "an empty mapping changes nothing (a section is merged, not reset): set the keys to change"
        )
    parts = dotted.split(".")
    if not all(parts):
        raise ScenarioError(origin, dotted, "an empty key in the dotted path")
    root = dict(data)
    node: Any = root
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not is_index(part) or int(part) >= len(node):
                raise ScenarioError(origin, dotted, f"'{part}' is not an index of the list at {'.'.join(parts[:i])}")
            key: int | str = int(part)
            child = node[key]
        else:
            key = part
            child = node.get(part, {})
        if not isinstance(child, (dict, list)):
            raise ScenarioError(origin, dotted, f"'{'.'.join(parts[: i + 1])}' is a value, not a section")
        node[key] = child = dict(child) if isinstance(child, dict) else list(child)
        node = child
    last = parts[-1]
    if isinstance(node, list):
        if not is_index(last) or int(last) >= len(node):
            raise ScenarioError(origin, dotted, f"'{last}' is not an index of the list")
        node[int(last)] = merged_section(node[int(last)], value) if merge else value
    else:
        node[last] = merged_section(node.get(last), value) if merge else value
    return root


def is_index(part: str) -> bool:
    """A list index in a key path: ASCII digits only (``str.isdigit`` takes ``²``, which ``int`` refuses), bounded."""
    return part.isascii() and part.isdigit() and len(part) <= MAX_INDEX_DIGITS


def split_override(dotted: str) -> tuple[str, str]:
    """Which document an override addresses: the workload, or (by default) the endpoint."""
    if dotted.startswith("workload."):
        return "workload", dotted[len("workload.") :]
    if dotted.startswith("endpoint."):
        return "endpoint", dotted[len("endpoint.") :]
    return "endpoint", dotted


def blame(
    error: ScenarioError, overrides: list[tuple[str, Any, str]], target: str, prefix: str
) -> ScenarioError:
    """An error whose key an override set is reported against that override's origin (the variant or ``--set``), as
    is an unknown key an override created (``--set trainer.bogus.x=1``). An error of the whole section (keys that must
    agree: ``inference.num_engines`` and ``hardware.devices``; a section's validator refusing one of its keys) names
    its keys in its reason: the last override of one of them is blamed."""
    key = error.key[len(prefix) + 1 :] if prefix and error.key.startswith(prefix + ".") else error.key
    unknown = error.reason == "unknown key"  # an override below an unknown key created it
    for dotted, _, origin in reversed(overrides):
        override_target, override_key = split_override(dotted)
        created = unknown and override_key.startswith(key + ".")
        if override_target == target and (key == override_key or key.startswith(override_key + ".") or created):
            return ScenarioError(origin, dotted, error.reason)
    for dotted, _, origin in reversed(overrides):
        override_target, override_key = split_override(dotted)
        section = key in ("", prefix) or override_key.startswith(key + ".")  # an error of a section holding the key
        named = re.search(rf"(?<![\w.]){re.escape(override_key)}(?![\w])", error.reason)
        if override_target == target and section and named:
            return ScenarioError(origin, dotted, error.reason)
    return error

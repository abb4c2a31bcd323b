"""What ``advise`` searches: the knobs (``commands.knobs.KNOBS``) that the endpoint's SkyRL version lets an operator
set, as axes of values, within a device limit.

- the request-count cap (``CAP``) is searched by bisection, not as an axis, and cap-aware padding is searched on (it
  never pads more rows); both are PR #1874's, in no SkyRL release: ``advise`` changes them only on a version that has
  them, or with ``--what-if`` (then labelled);
- every other knob whose ``values`` apply to the variant is an axis; a knob the mode does not allow (``knobs.searchable``)
  or that a ``--fix``/``--set`` key holds is not searched, and a value that needs more devices than ``--devices`` is
  not tried;
- the simulator's modelling modes (``knobs.MODELLING``: the sampling mode, ...) are never searched.

A configuration is a set of dotted overrides; its *structure* is every setting but the cap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from skyrl_sim.commands.knobs import CAP, CAP_AWARE, KNOBS, Knob, held_off, knob_of, label, searchable
from skyrl_sim.errors import UserError
from skyrl_sim.schema.skyrl_versions import dotted_endpoint_key
from skyrl_sim.schema.variant import ResolvedVariant

__all__ = ["CAP", "CAP_AWARE"]

MODES = ("version", "released", "what-if")
"""What ``advise`` may change (``knobs.searchable``): the version's settings (the default), only released ones
(``--released-only``), or anything, labelled (``--what-if``)."""


@dataclass(frozen=True)
class AxisChoice:
    """One searched setting: its name and its values, each a set of dotted overrides; ordered by memory when
    ``monotone`` (a value that fails makes every later one fail)."""

    name: str
    values: tuple[dict[str, Any], ...]
    monotone: bool = False


def settings_key(settings: dict[str, Any]) -> str:
    """One configuration's identity: its overrides in key order."""
    return repr(sorted(settings.items(), key=lambda kv: kv[0]))


def dotted_get(data: dict[str, Any], dotted: str) -> Any:
    """A dotted key's value in a nested mapping (None when a part is missing)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def pass_requests(variant: ResolvedVariant) -> int:
    """forward_backward/forward requests in the workload: a cap at or above it never cuts a set."""
    count = 0
    for index in range(len(variant.workload.clients)):
        count += sum(1 for p in variant.client_requests(index) if p.spec.type in ("forward_backward", "forward"))
    return max(1, count)


def cap_ladder(n: int) -> list[int | None]:
    """Caps to bisect over: 1, 2, 3, 4, 6, 8, 12, ... below ``n``, then unlimited (None, the same as ``n``)."""
    ladder: list[int] = []
    value = 1
    while value < n:
        ladder.append(value)
        value = value + 1 if value < 4 else (value * 3 // 2 if value & (value - 1) == 0 else value * 4 // 3)
    return [*ladder, None]


def search_axes(
    variant: ResolvedVariant,
    fixed: Sequence[str],
    allowed: Callable[[Knob], bool] = lambda knob: True,
    fits: Callable[[dict[str, Any]], bool] = lambda value: True,
) -> list[AxisChoice]:
    """The structural axes (everything but the cap): each knob with values that applies to the variant, is
    ``allowed`` and holds no ``fixed`` key; of its values, those that ``fits`` (the device limit)."""
    axes = []
    for knob in KNOBS:
        if knob.values is None or not knob.applies(variant) or not allowed(knob):
            continue
        if any(key in fixed for key in knob.skyrl_keys):
            continue
        values = [value for value in knob.values(variant) if fits(value)]
        if values:
            axes.append(AxisChoice(knob.name, tuple(values), knob.monotone))
    return axes


def current_choice(axis: AxisChoice, endpoint: dict[str, Any]) -> int:
    """The index of the endpoint's own value on an axis (0 when none matches)."""
    for i, value in enumerate(axis.values):
        if all(dotted_get(endpoint, k) == v for k, v in value.items()):
            return i
    return 0


def settings_labels(settings: dict[str, Any], version: str) -> dict[str, str]:
    """The footnote of each setting in ``settings`` that needs one on ``version`` (``knobs.label``: a setting the
    version lacks, turned on), of each value that needs more devices (the knob's ``device_cost``), and of each value
    with a cost the time model does not price (its ``unpriced_cost``)."""
    labels = {}
    for key, value in settings.items():
        knob = knob_of(key)
        if knob is not None and knob.without and value == knob.without.get(key):
            continue  # held at "not used": nothing to label
        text = label(key, version)
        if text:
            labels[key] = text
        elif knob is not None and knob.adds_devices(key, value):
            labels[key] = knob.device_cost
        elif knob is not None and knob.unpriced(dotted_endpoint_key(key), value):
            labels[key] = knob.unpriced_cost
    return labels


def changes(settings: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The overrides whose value differs from the base endpoint's."""
    return {k: v for k, v in sorted(settings.items()) if dotted_get(base, k) != v}


def held_sets(sets: dict[str, Any], version: str, mode: str) -> dict[str, Any]:
    """``sets`` with every knob ``mode`` does not allow on ``version`` held at its ``without`` values (no cap, no
    cap-aware padding), so the search keeps them as given; a ``--set`` that turns one on contradicts the mode."""
    out = dict(sets)
    flag = "--released-only" if mode == "released" else "advise"
    for knob in held_off(KNOBS, version, mode):
        for key, off in knob.without.items():
            for given in (key, f"endpoint.{key}"):
                if given in out and out[given] != off:
                    why = label(key, version) or knob.version_label
                    raise UserError(
                        f"{flag}: --set {given}={out[given]} is {why} (--what-if searches it as a labelled what-if)"
                    )
                out.pop(given, None)
            out[key] = off
    return out


def mode_allows(version: str, mode: str) -> Callable[[Knob], bool]:
    """The knobs ``advise`` may change on ``version`` in ``mode``."""
    if mode not in MODES:
        raise UserError(f"advise mode {mode!r}: expected one of {', '.join(MODES)}")
    return lambda knob: searchable(knob, version, mode)


def without_cap(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of a configuration's structure: all but the cap."""
    return {k: v for k, v in settings.items() if k != CAP}

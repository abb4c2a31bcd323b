"""Backend options (``--option KEY=VALUE``) validated against the schema the backend's plugin declares.

One place turns the strings of the command line into a backend's typed settings, so every backend (built in or
third-party) refuses an unknown key or a bad value with the same message: the option, the backend, the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from skyrl_sim.errors import UserError

M = TypeVar("M", bound=BaseModel)


def validate_options(backend: str, schema: type[M], raw: Mapping[str, str]) -> M:
    """``raw`` as an instance of ``schema``; ``UserError`` for a key the schema lacks or a value it refuses."""
    known = sorted(schema.model_fields)
    unknown = sorted(set(raw) - set(known))
    if unknown:
        listed = ", ".join(known) if known else "it takes no options"
        raise UserError(f"--option {unknown[0]}: the {backend} backend has no such option (known: {listed})")
    try:
        options = schema.model_validate(dict(raw))
    except ValidationError as exc:
        error = exc.errors()[0]
        key = str(error["loc"][0]) if error["loc"] else ""
        value = f"={raw[key]}" if key in raw else ""
        raise UserError(f"--option {key}{value}: {error['msg']} (the {backend} backend)") from None
    for key, value in options.model_dump().items():  # every backend's numbers finite, whatever its schema allows
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--option {key}={raw.get(key, value)}: must be a finite number (the {backend} backend)")
    return options


def describe_options(schema: type[BaseModel]) -> list[tuple[str, str, str, str]]:
    """Each option of ``schema`` as (key, type, default, description), for ``skyrl-sim plugins``."""
    rows = []
    for key, info in schema.model_fields.items():
        kind = getattr(info.annotation, "__name__", None) or str(info.annotation).replace("typing.", "")
        default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
        rows.append((key, kind, default, info.description or ""))
    return rows

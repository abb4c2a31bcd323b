"""What an imported request must satisfy to load: the scenario schema's own limits, checked row by row at import.

SkyRL's database holds whatever clients sent (a 20M-token datum, a NaN learning rate, a negative sample count). Such
a row, written into a scenario, would make the file fail to load, or make ``check`` walk a call no model can run. So
``import`` (and ``replay``) check each decoded request against the very types the scenario schema validates a
``trace`` with (``schema.scenario.Tokens``, ``LearningRate``, ``SampleCount``) and report a row that misses them
with its id, as an unreadable row is: skipped, or with ``--strict`` the import fails. The whole window must also fit
the workload's time limit (``MAX_TIME_S``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from skyrl_sim.schema.scenario import PASSES, LearningRate, SampleCount, Tokens

if TYPE_CHECKING:
    from skyrl_sim.commands.importer import TraceRequest

_DATUMS: TypeAdapter[list[int]] = TypeAdapter(list[Tokens])
_TOKENS: TypeAdapter[int] = TypeAdapter(Tokens)
_RATE: TypeAdapter[float] = TypeAdapter(LearningRate)
_SAMPLES: TypeAdapter[int] = TypeAdapter(SampleCount)


def request_problem(request: TraceRequest) -> str | None:
    """Why the request could not be part of a scenario (its value and the limit), or None."""
    checks: list[tuple[str, TypeAdapter[Any], Any]] = []
    if request.type in PASSES:
        checks.append(("datum tokens", _DATUMS, list(request.datums)))
    elif request.type == "optim_step":
        checks.append(("learning_rate", _RATE, request.learning_rate))
    elif request.type == "sample":
        checks += [
            ("prompt tokens", _TOKENS, request.prompt_tokens),
            ("max_tokens", _TOKENS, request.max_tokens),
            ("num_samples", _SAMPLES, request.num_samples),
        ]
    for what, adapter, value in checks:
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = error["loc"][0] if error["loc"] else None
            shown = value[where] if isinstance(value, list) and isinstance(where, int) else value
            return f"{what} {shown!r}: {error['msg'].lower()}"
    return None

"""The boundary between a SkyRL database and skyrl-sim: every value read from a row is parsed here before it is used.

A database is input like a scenario file, and a damaged or hostile one (a text request id, a datum of 10^30 tokens, a
NaN learning rate, a timestamp in year 9999, bytes that are not UTF-8, a gigabyte of JSON in one cell) must give one
reason per row, never a traceback, a hang, or a scenario that then fails to load. So each column and each
``request_data`` is read by a strict pydantic model holding the limits scenario files hold (``schema/limits.py``).

The models read only what the importer uses and ignore SkyRL's other keys; their field names are SkyRL 0.4.0's
(``skyrl/tinker/types.py``: ``ForwardBackwardInput.data[].model_input.chunks[]``, ``OptimStepInput.adam_params``,
``SampleInput.sampling_params.max_tokens``, ``LoadWeightsInput.checkpoint_id``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Annotated, Any, NotRequired

import orjson
from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from skyrl_sim.schema.limits import (
    MAX_LEARNING_RATE,
    MAX_NAME_CHARS,
    MAX_REQUESTS,
    MAX_SAMPLES,
    MAX_TOKENS,
)

MAX_REQUEST_ID = 2**63 - 1
"""A request id is a 64-bit integer (SkyRL's autoincrement primary key)."""
MAX_ERROR_CHARS = 8192
"""A recorded failure text longer than this is cut (with ``...``): a traceback is kept, a megabyte of it is not."""
STATUSES = ("pending", "completed", "failed")
"""SkyRL's ``RequestStatus`` values."""


@dataclass(frozen=True)
class BadRow:
    """A row that cannot be used: which table, which row (its id as stored) and why."""

    table: str
    row_id: str
    reason: str

    def __str__(self) -> str:
        return f"{self.table} row {self.row_id}: {self.reason}"


def row_label(value: Any) -> str:
    """A row's id as a user can find it: an integer as is, anything else as its short repr."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _utf8(text: str) -> str:
    """Text a SQLite file stored as bytes that are not UTF-8 arrives with lone surrogates: refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid UTF-8 text") from None
    return text


def _printable(text: str) -> str:
    _utf8(text)
    if not text.isprintable():
        raise ValueError("holds control characters")
    return text


Text = Annotated[str, AfterValidator(_utf8)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_printable)]
"""A model id or checkpoint name: it becomes a client name and a key of the scenario, and is printed."""


READ = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
"""What skyrl-sim reads of a SkyRL value: the fields it uses, strictly typed and bounded; SkyRL's others are ignored.
The shapes are TypedDicts validated by pydantic: a pass may hold 300,000 datums, and validating dictionaries is
about three times faster than building a model object for each datum, chunk and input."""


@with_config(READ)
class Chunk(TypedDict, total=False):
    """One chunk of a ``ModelInput``: encoded text (its tokens) or an image (its ``expected_tokens``)."""

    type: Annotated[str, Field(max_length=64)]
    tokens: Annotated[list[int], Field(max_length=MAX_TOKENS)]
    expected_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)]


@with_config(READ)
class ModelInput(TypedDict):
    chunks: Annotated[list[Chunk], Field(max_length=MAX_TOKENS)]


@with_config(READ)
class Datum(TypedDict):
    model_input: ModelInput


@with_config(READ)
class PassInput(TypedDict):
    """``ForwardBackwardInput`` (and ``forward``'s): the datums."""

    data: Annotated[list[Datum], Field(min_length=1, max_length=MAX_REQUESTS)]


@with_config(READ)
class AdamParams(TypedDict):
    learning_rate: Annotated[float, Field(gt=0, le=MAX_LEARNING_RATE)]


@with_config(READ)
class OptimStepInput(TypedDict):
    adam_params: AdamParams


@with_config(READ)
class SamplingParams(TypedDict):
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)]


@with_config(READ)
class SampleInput(TypedDict):
    prompt: ModelInput
    sampling_params: SamplingParams
    num_samples: NotRequired[Annotated[int, Field(ge=1, le=MAX_SAMPLES)]]
    checkpoint_id: NotRequired[Annotated[Text | None, Field(max_length=MAX_NAME_CHARS)]]


@with_config(READ)
class SaveWeightsInput(TypedDict):
    """``SaveWeightsInput`` / ``SaveWeightsForSamplerInput``: the checkpoint path (its last component names it)."""

    path: NotRequired[Annotated[Text | None, Field(max_length=MAX_NAME_CHARS)]]


@with_config(READ)
class LoadWeightsInput(TypedDict):
    checkpoint_id: Name


@with_config(READ)
class NoInput(TypedDict):
    """``create_model`` and ``unload_model``: nothing of their input is used."""


REQUEST_DATA: dict[str, TypeAdapter[Any]] = {
    kind: TypeAdapter(shape)
    for kind, shape in (
        ("forward_backward", PassInput),
        ("forward", PassInput),
        ("optim_step", OptimStepInput),
        ("sample", SampleInput),
        ("save_weights_for_sampler", SaveWeightsInput),
        ("save_weights", SaveWeightsInput),
        ("load_weights", LoadWeightsInput),
        ("create_model", NoInput),
        ("unload_model", NoInput),
    )
}
"""The shape of each request type's ``request_data``."""


def token_count(model_input: ModelInput, where: str) -> int:
    """Tokens of a ModelInput (text chunks by their tokens, images by ``expected_tokens``), within ``MAX_TOKENS``."""
    total = 0
    for chunk in model_input["chunks"]:
        if "tokens" in chunk:
            total += len(chunk["tokens"])
        elif "expected_tokens" in chunk:
            total += chunk["expected_tokens"]
        else:
            raise ValueError(f"{where}: a {chunk.get('type', 'chunk')} chunk without tokens or expected_tokens")
    if total > MAX_TOKENS:
        raise ValueError(f"{where}: {total:,} tokens, over the limit of {MAX_TOKENS:,}")
    return total


def reason_of(exc: ValidationError, prefix: str) -> str:
    """The first problem of a validation error as ``key: message`` (and how many more)."""
    first = exc.errors()[0]
    key = ".".join(str(p) for p in (prefix, *first["loc"]) if p != "")
    more = len(exc.errors()) - 1
    message = first["msg"].removeprefix("Value error, ")  # a validator's own ValueError says what and where
    return f"{key}: {message}" + (f" (and {more} more)" if more else "")


def read_request(kind: str, data: Any) -> dict[str, Any]:
    """What a row's ``request_data`` says that a scenario uses, by SkyRL's request type: ``datums`` (token counts) of a
    pass, an optim step's ``learning_rate``, a sample's ``prompt_tokens``, ``max_tokens``, ``num_samples`` and
    ``checkpoint``, the ``checkpoint`` of a save or load. ``ValueError`` with the key and the reason otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"request_data is {type(data).__name__}, not a JSON object")
    try:
        read = REQUEST_DATA[kind].validate_python(data)
    except ValidationError as exc:
        raise ValueError(reason_of(exc, "request_data")) from None
    if kind in ("forward_backward", "forward"):
        datums = []
        for index, datum in enumerate(read["data"]):
            tokens = token_count(datum["model_input"], f"request_data.data.{index}.model_input")
            if tokens < 1:
                raise ValueError(f"request_data.data.{index}: a datum without tokens")
            datums.append(tokens)
        return {"datums": tuple(datums)}
    if kind == "optim_step":
        return {"learning_rate": read["adam_params"]["learning_rate"]}
    if kind == "sample":
        return {
            "prompt_tokens": max(1, token_count(read["prompt"], "request_data.prompt")),
            "max_tokens": read["sampling_params"]["max_tokens"],
            "num_samples": read.get("num_samples", 1),
            "checkpoint": read.get("checkpoint_id") or "",
        }
    if kind in ("save_weights", "save_weights_for_sampler"):
        path = read.get("path")
        return {"checkpoint": PurePosixPath(path).name if path else ""}
    if kind == "load_weights":
        return {"checkpoint": read["checkpoint_id"]}
    return {}


def parse_json(value: Any, column: str) -> Any:
    """A JSON column as Python data: text or bytes parsed (NaN, Infinity, invalid UTF-8 and nesting past 1,024 levels
    are refused by orjson), data a driver already decoded kept as it is."""
    if value is None or isinstance(value, (dict, list, int, float, bool)):
        return value
    if isinstance(value, memoryview):
        value = bytes(value)
    if not isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"{column} is {type(value).__name__}, not JSON text")
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{column} is not valid JSON ({exc})") from None


def parse_timestamp(value: Any, column: str) -> float:
    """A timestamp column as epoch seconds: a datetime (Postgres) or SQLite's ISO text; naive times are UTC (SkyRL
    writes ``datetime.now(timezone.utc)``)."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)  # refuses text that is no time, bytes that were not UTF-8 too
        except ValueError:
            raise ValueError(f"{column} {row_label(value)} is not an ISO 8601 time") from None
    if not isinstance(value, datetime):
        raise ValueError(f"{column} {row_label(value)} is not a timestamp")
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    try:
        return value.timestamp()
    except (OverflowError, ValueError):
        raise ValueError(f"{column} {row_label(value)} is out of range") from None


def parse_request_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"request_id {row_label(value)} is not an integer")
    if not 0 <= value <= MAX_REQUEST_ID:
        raise ValueError(f"request_id {value} is outside 0..2^63-1")
    return value


def enum_text(value: Any, column: str) -> str:
    """An enum column (SkyRL stores the member's name, ``FORWARD_BACKWARD``) as its lower-case value."""
    value = getattr(value, "value", value)
    if not isinstance(value, str):
        raise ValueError(f"{column} {row_label(value)} is not text")
    if len(value) > 64:
        raise ValueError(f"{column} is {len(value):,} characters long (SkyRL's are short names)")
    return value.lower()


def parse_model_id(value: Any) -> str | None:
    """A row's model id; None (and SkyRL's empty id of a base-model sample) for no model."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"model_id {row_label(value)} is not text")
    try:
        return _model_id(value)
    except ValueError as exc:
        raise ValueError(f"model_id {row_label(value)} {exc}") from None


def _model_id(value: str) -> str:
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"is {len(value):,} characters long, over the limit of {MAX_NAME_CHARS:,}")
    return _printable(value)


def failure_text(result_data: Any) -> str:
    """The failure a failed row's ``result_data`` records (SkyRL's ``ErrorResponse.error``), cut to
    ``MAX_ERROR_CHARS``."""
    error = result_data.get("error") if isinstance(result_data, dict) else None
    if not isinstance(error, str) or not error:
        return "failed (no message)"
    return error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 3] + "..."

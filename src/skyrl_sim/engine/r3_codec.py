"""The routed-expert replay (R3) wire codec: expert ids ``[tokens, layers, topk]`` as ``{data, shape, dtype}``.

vLLM returns, per sample, the experts it routed every token to in every MoE layer. SkyRL (PR #1909) ships them to
the trainer compacted: the smallest dtype that holds the largest id (``uint8`` < 256, ``int16`` < 32,768, ``int32``
< 2^31, else an error), the raw C-order bytes base64-encoded, with the shape and the dtype name, inside an orjson
body. The decoder trusts nothing: dtype name, a 3-D non-negative integer shape, the exact byte length, and that the
dtype is the canonical (smallest) one for the ids it carries; anything else is a ``ValueError`` that says what.

The byte-size functions answer the capacity questions without building arrays: what one sample costs on the wire
compacted, what the naive JSON list encoding would cost, and what the old int32-all-layers expansion held.
"""

from __future__ import annotations

import binascii
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

try:  # SIMD base64 (10-20x faster than binascii on a 35k-token sample); binascii gives the same bytes, slower
    import pybase64

    def _b64encode(raw: memoryview) -> str:
        return pybase64.b64encode_as_string(raw)

    def _b64decode(text: str) -> bytes:
        return pybase64.b64decode(text, validate=True)

except ImportError:  # pragma: no cover - exercised only where pybase64 is missing

    def _b64encode(raw: memoryview) -> str:
        return binascii.b2a_base64(raw, newline=False).decode("ascii")

    def _b64decode(text: str) -> bytes:
        return binascii.a2b_base64(text, strict_mode=True)


# Dtype name -> exclusive upper bound of the ids it may carry, smallest first: the canonical order.
DTYPE_LIMITS: dict[str, int] = {"uint8": 2**8, "int16": 2**15, "int32": 2**31}
ITEMSIZE: dict[str, int] = {"uint8": 1, "int16": 2, "int32": 4}
INT32_BYTES = 4
KEYS = ("data", "shape", "dtype")


def smallest_dtype(max_id: int) -> str:
    """The canonical dtype name for ids up to ``max_id`` (inclusive); ValueError past int32."""
    if max_id < 0:
        raise ValueError(f"expert ids must be non-negative, got max id {max_id}")
    for name, limit in DTYPE_LIMITS.items():
        if max_id < limit:
            return name
    raise ValueError(f"expert id {max_id} does not fit in int32 (must be < 2^31)")


def _check_integer_array(routes: np.ndarray) -> None:
    if routes.dtype.kind == "b":
        raise ValueError("routed experts must be integer ids, not booleans")
    if routes.dtype.kind not in "iu":
        raise ValueError(f"routed experts must be an integer array, got dtype {routes.dtype}")
    if routes.ndim != 3:
        raise ValueError(f"routed experts must be 3-D [tokens, layers, topk], got {routes.ndim}-D shape {routes.shape}")


def encode_routes(routes: np.ndarray | Any) -> dict[str, Any]:
    """``{data: base64 of the C-order bytes, shape: [tokens, layers, topk], dtype}`` in the smallest safe dtype."""
    array = np.asarray(routes)
    _check_integer_array(array)
    if array.size == 0 or array.dtype == np.uint8:
        dtype = "uint8"  # nothing to scan: uint8 ids are non-negative and uint8 is the smallest dtype
    else:
        if array.dtype.kind == "i" and int(array.min()) < 0:
            raise ValueError(f"expert ids must be non-negative, found {int(array.min())}")
        dtype = smallest_dtype(int(array.max()))
    raw = np.ascontiguousarray(array, dtype=dtype)
    return {
        "data": _b64encode(memoryview(raw.reshape(-1)).cast("B")),
        "shape": [int(n) for n in array.shape],
        "dtype": dtype,
    }


def _shape(value: Any) -> tuple[int, int, int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"routed experts 'shape' must be a list of 3 integers, got {type(value).__name__}")
    if len(value) != 3:
        raise ValueError(f"routed experts 'shape' must have 3 dimensions [tokens, layers, topk], got {len(value)}")
    for n in value:
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"routed experts 'shape' entries must be integers, got {n!r}")
        if n < 0:
            raise ValueError(f"routed experts 'shape' entries must be non-negative, got {n}")
    return int(value[0]), int(value[1]), int(value[2])


def _canonical_base64(text: str, raw: bytes) -> bool:
    """Whether ``text`` is exactly what the encoder writes for ``raw``: only the last 4-character group can differ
    (unused bits set, as in 'AB=='), so only it is re-encoded."""
    if len(text) != base64_len(len(raw)):
        return False
    tail = len(raw) % 3 or 3
    return not raw or _b64encode(memoryview(raw[-tail:])) == text[-4:]


def decode_routes(payload: Mapping[str, Any]) -> np.ndarray:
    """The ``[tokens, layers, topk]`` array of an encoded payload, after every check; read-only view of the bytes."""
    if not isinstance(payload, Mapping):
        raise ValueError(f"routed experts must be an object with {', '.join(KEYS)}, got {type(payload).__name__}")
    missing = [k for k in KEYS if k not in payload]
    if missing:
        raise ValueError(f"routed experts payload is missing {', '.join(repr(k) for k in missing)}")
    extra = sorted(str(k) for k in payload if k not in KEYS)
    if extra:
        raise ValueError(f"routed experts payload has unknown keys {', '.join(repr(k) for k in extra)}")
    dtype = payload["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_LIMITS:
        raise ValueError(f"routed experts 'dtype' must be one of {', '.join(DTYPE_LIMITS)}, got {dtype!r}")
    shape = _shape(payload["shape"])
    data = payload["data"]
    if not isinstance(data, str):
        raise ValueError(f"routed experts 'data' must be a base64 string, got {type(data).__name__}")
    try:
        raw = _b64decode(data)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"routed experts 'data' is not valid base64: {exc}") from None
    if not _canonical_base64(data, raw):
        raise ValueError("routed experts 'data' is not canonical base64 (unused bits set, or padding not as encoded)")
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if len(raw) != expected:
        raise ValueError(
            f"routed experts 'data' holds {len(raw)} bytes; shape {list(shape)} in {dtype} needs exactly {expected}"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if array.size and dtype != "uint8":  # uint8 can hold neither a negative id nor a smaller dtype's ids
        low = int(array.min())
        if low < 0:
            raise ValueError(f"routed experts hold a negative expert id ({low})")
        canonical = smallest_dtype(int(array.max()))
        if canonical != dtype:
            raise ValueError(
                f"routed experts dtype {dtype} is not canonical: the largest id {int(array.max())} fits {canonical}"
            )
    elif dtype != "uint8":
        raise ValueError(f"routed experts dtype {dtype} is not canonical for an empty array (uint8)")
    return array


def dumps_body(body: Mapping[str, Any]) -> bytes:
    """An HTTP body as orjson writes it (compact; numpy arrays serialised natively)."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def loads_body(body: bytes | str) -> Any:
    """An orjson body back to Python; ValueError (orjson's JSONDecodeError is one) on malformed JSON."""
    return orjson.loads(body)


# --- sizes, without building arrays ---------------------------------------------------------------------------------


def raw_bytes(tokens: int, layers: int, topk: int, dtype: str) -> int:
    """Bytes of the ids as a C-order array in ``dtype``."""
    return tokens * layers * topk * ITEMSIZE[dtype]


def base64_len(nbytes: int) -> int:
    """Characters of the padded base64 encoding of ``nbytes`` bytes (4 per started group of 3)."""
    return 4 * -(-nbytes // 3)


def compact_wire_bytes(tokens: int, layers: int, topk: int, num_experts: int) -> int:
    """Bytes of one encoded payload as orjson writes it: ``{"data":"<base64>","shape":[t,l,k],"dtype":"<name>"}``.

    The dtype is the canonical one for ids up to ``num_experts - 1`` (a sample whose ids are all small could use a
    smaller one; with enough tokens every expert appears, so this is what a capacity planner should count).
    """
    dtype = smallest_dtype(max(0, num_experts - 1)) if tokens * layers * topk else "uint8"
    framing = len('{"data":"","shape":[,,],"dtype":""}') + len(dtype)
    digits = sum(len(str(n)) for n in (tokens, layers, topk))
    return framing + digits + base64_len(raw_bytes(tokens, layers, topk, dtype))


def mean_id_digits(num_experts: int) -> float:
    """Average decimal digits of an id drawn uniformly from ``0 .. num_experts - 1``."""
    total = 0
    low = 0
    width = 1
    while low < num_experts:
        high = min(num_experts, 10**width)
        total += (high - low) * width
        low = high
        width += 1
    return total / num_experts


def json_list_bytes(tokens: int, layers: int, topk: int, num_experts: int) -> int:
    """Bytes of the same ids as nested JSON lists (compact separators), ids spread uniformly over the experts.

    Per id its digits; commas between siblings at every level; one bracket pair per list.
    """
    ids = tokens * layers * topk
    digits = round(ids * mean_id_digits(num_experts)) if ids else 0
    commas = tokens * layers * max(topk - 1, 0) + tokens * max(layers - 1, 0) + max(tokens - 1, 0)
    brackets = 2 * (1 + tokens + tokens * layers)
    return digits + commas + brackets


def json_list_bytes_of(routes: np.ndarray) -> int:
    """Exact bytes of an array's ids as compact nested JSON lists (what ``orjson.dumps(routes.tolist())`` writes)."""
    return len(orjson.dumps(np.asarray(routes).tolist()))


def int32_all_layers_bytes(tokens: int, num_layers: int, topk: int) -> int:
    """The old trainer-side cost: every layer's ids expanded to int32 on every pipeline stage."""
    return tokens * num_layers * topk * INT32_BYTES

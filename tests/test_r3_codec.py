"""Property tests of the routed-expert replay codec: every valid array round-trips, every malformed payload fails."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from skyrl_sim.engine import r3_codec

INT_DTYPES = [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64]
shapes = hnp.array_shapes(min_dims=3, max_dims=3, min_side=0, max_side=6)


@st.composite
def route_arrays(draw: st.DrawFn) -> np.ndarray:
    """Any 3-D integer array of non-negative ids below 2^31, in any integer dtype that holds them."""
    dtype = np.dtype(draw(st.sampled_from(INT_DTYPES)))
    top = min(int(np.iinfo(dtype).max), 2**31 - 1)
    limit = draw(st.sampled_from([v for v in (255, 256, 32767, 32768, 2**31 - 1) if v <= top] or [top]))
    return draw(hnp.arrays(dtype, draw(shapes), elements=st.integers(0, limit)))


def _payload(array: np.ndarray, dtype: str) -> dict:
    raw = np.ascontiguousarray(array, dtype=dtype).tobytes()
    return {"data": base64.b64encode(raw).decode(), "shape": list(array.shape), "dtype": dtype}


@settings(max_examples=300, deadline=None)
@given(route_arrays())
def test_round_trip_any_valid_array(array: np.ndarray) -> None:
    payload = r3_codec.encode_routes(array)
    body = r3_codec.dumps_body({"routed_experts": payload})
    back = r3_codec.decode_routes(r3_codec.loads_body(body)["routed_experts"])
    assert back.shape == array.shape
    assert np.array_equal(back, array)
    expected = "uint8" if array.size == 0 else r3_codec.smallest_dtype(int(array.max()))
    assert payload["dtype"] == expected == str(back.dtype)


@settings(max_examples=200, deadline=None)
@given(route_arrays())
def test_size_functions_match_the_encoder(array: np.ndarray) -> None:
    """The planner's wire size equals what orjson writes when the array's largest id sets the dtype."""
    t, layers, k = array.shape
    experts = int(array.max()) + 1 if array.size else 1
    assert r3_codec.compact_wire_bytes(t, layers, k, experts) == len(orjson.dumps(r3_codec.encode_routes(array)))


@pytest.mark.parametrize(
    ("max_id", "dtype"),
    [(0, "uint8"), (255, "uint8"), (256, "int16"), (32767, "int16"), (32768, "int32"), (2**31 - 1, "int32")],
)
def test_smallest_dtype_boundaries(max_id: int, dtype: str) -> None:
    assert r3_codec.smallest_dtype(max_id) == dtype


def test_ids_past_int32_are_rejected() -> None:
    with pytest.raises(ValueError, match="does not fit in int32"):
        r3_codec.encode_routes(np.full((1, 1, 1), 2**31, dtype=np.int64))


@settings(max_examples=100, deadline=None)
@given(route_arrays().filter(lambda a: a.size > 0), st.integers(1, 7), st.booleans())
def test_wrong_byte_length_is_rejected(array: np.ndarray, delta: int, longer: bool) -> None:
    payload = r3_codec.encode_routes(array)
    raw = base64.b64decode(payload["data"])
    raw = raw + b"\0" * delta if longer else raw[:-delta] if delta <= len(raw) else b""
    payload["data"] = base64.b64encode(raw).decode()
    with pytest.raises(ValueError, match="needs exactly"):
        r3_codec.decode_routes(payload)


@settings(max_examples=100, deadline=None)
@given(route_arrays(), st.sampled_from(["int8", "uint16", "int64", "float32", "bool", "UINT8", "", "uint8 "]))
def test_unknown_dtype_names_are_rejected(array: np.ndarray, name: str) -> None:
    payload = r3_codec.encode_routes(array)
    payload["dtype"] = name
    with pytest.raises(ValueError, match="'dtype' must be one of"):
        r3_codec.decode_routes(payload)


@settings(max_examples=100, deadline=None)
@given(route_arrays().filter(lambda a: a.size > 0), st.data())
def test_non_canonical_dtype_is_rejected(array: np.ndarray, data: st.DataObject) -> None:
    canonical = r3_codec.smallest_dtype(int(array.max()))
    wider = [d for d in r3_codec.DTYPE_LIMITS if r3_codec.ITEMSIZE[d] > r3_codec.ITEMSIZE[canonical]]
    if not wider:
        return  # int32 is already the widest name
    dtype = data.draw(st.sampled_from(wider))
    with pytest.raises(ValueError, match="not canonical"):
        r3_codec.decode_routes(_payload(array, dtype))


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(np.int32, shapes.filter(lambda s: np.prod(s) > 0), elements=st.integers(0, 40000)),
    st.sampled_from(["int16", "int32"]),
    st.integers(-(2**15), -1),
    st.data(),
)
def test_negative_ids_are_rejected(array: np.ndarray, dtype: str, negative: int, data: st.DataObject) -> None:
    index = tuple(data.draw(st.integers(0, n - 1)) for n in array.shape)
    array = array.copy()
    array[index] = negative
    with pytest.raises(ValueError, match="negative"):
        r3_codec.encode_routes(array)
    with pytest.raises(ValueError, match="negative"):
        r3_codec.decode_routes(_payload(array, dtype))


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.bool_, shapes))
def test_bools_are_rejected(array: np.ndarray) -> None:
    with pytest.raises(ValueError, match="not booleans"):
        r3_codec.encode_routes(array)
    payload = _payload(array.astype(np.uint8), "uint8")
    payload["dtype"] = "bool"
    with pytest.raises(ValueError, match="'dtype' must be one of"):
        r3_codec.decode_routes(payload)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=5, max_side=4).filter(lambda s: len(s) != 3)))
def test_wrong_rank_is_rejected(array: np.ndarray) -> None:
    with pytest.raises(ValueError, match="3-D"):
        r3_codec.encode_routes(array)
    with pytest.raises(ValueError, match="3 dimensions"):
        r3_codec.decode_routes(_payload(array, "uint8"))


@settings(max_examples=100, deadline=None)
@given(
    route_arrays(),
    st.integers(0, 2),
    st.one_of(st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.integers(max_value=-1)),
)
def test_non_integer_or_negative_shape_is_rejected(array: np.ndarray, axis: int, bad: object) -> None:
    payload = r3_codec.encode_routes(array)
    payload["shape"][axis] = bad
    with pytest.raises(ValueError, match="'shape' entries must be"):
        r3_codec.decode_routes(payload)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ([1, 2, 3], "must be an object"),
        ({"shape": [1, 1, 1], "dtype": "uint8"}, "missing 'data'"),
        ({"data": "AA==", "shape": "1,1,1", "dtype": "uint8"}, "list of 3 integers"),
        ({"data": 5, "shape": [1, 1, 1], "dtype": "uint8"}, "base64 string"),
        ({"data": "A*==", "shape": [1, 1, 1], "dtype": "uint8"}, "not valid base64"),
        ({"data": "", "shape": [0, 4, 2], "dtype": "int16"}, "not canonical for an empty array"),
    ],
)
def test_malformed_payloads(payload: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        r3_codec.decode_routes(payload)  # type: ignore[arg-type]


def test_float_arrays_are_rejected() -> None:
    with pytest.raises(ValueError, match="integer array"):
        r3_codec.encode_routes(np.zeros((1, 1, 1), dtype=np.float32))


def test_json_list_bytes_by_hand() -> None:
    """2 tokens x 3 layers x 2 experts of 16 (ids 0..15: 10 one-digit + 6 two-digit = 1.375 digits on average)."""
    ids = 2 * 3 * 2
    digits = round(ids * 22 / 16)
    commas = 2 * 3 * 1 + 2 * 2 + 1
    brackets = 2 * (1 + 2 + 6)
    assert r3_codec.json_list_bytes(2, 3, 2, 16) == digits + commas + brackets
    exact = np.array([[[0, 15], [3, 4], [10, 9]], [[1, 2], [12, 5], [6, 14]]])
    two_digit = int((exact >= 10).sum())
    assert r3_codec.json_list_bytes_of(exact) == ids + two_digit + commas + brackets

"""The one byte formatter and the one percent formatter: PyTorch's wording for sizes, one decimal for fractions."""

from __future__ import annotations

import math

import pytest

from skyrl_sim.units import GIB, format_bytes, format_size, gib, pct


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1536, "1.50 KiB"),
        (3 * 2**20, "3.00 MiB"),
        (int(9.08 * GIB), "9.08 GiB"),
        (-1536, "-1.50 KiB"),  # a difference picks its unit by magnitude
    ],
)
def test_sizes_read_as_pytorch_writes_them(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


def test_missing_values_are_a_dash() -> None:
    assert format_bytes(None) == gib(None) == pct(None) == "-"
    assert format_bytes(2048) == "2.00 KiB"
    assert gib(3 * GIB // 2) == "1.50"


@pytest.mark.parametrize(("value", "text"), [(0.034, "3.4%"), (-0.05, "-5.0%"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_percentages(value: float, text: str) -> None:
    assert pct(value) == text

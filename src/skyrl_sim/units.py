"""Units and their text: the one GiB constant, the one table of bytes per dtype, the one byte formatter and the one
percent formatter.

Every report, table, trace and OOM message formats sizes and fractions through these, so the same number reads the same
everywhere (before, a compare table said ``500 B`` where an OOM message said ``500 bytes``, and a calibration table
printed an infinite error as ``inf%`` where compare printed ``inf``).
"""

from __future__ import annotations

import math

GIB = 2**30

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "int64": 8, "int32": 4, "int16": 2, "uint8": 1, "bool": 1}
"""Bytes per element, by the short dtype names of the trainer's settings (``trainer.params_dtype``) and the op graph."""

MODEL_DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element, by the long dtype names vLLM and SkyRL's ``model_dtype`` use."""


def format_size(nbytes: float) -> str:
    """A byte count the way PyTorch's allocator writes it in OOM messages (``512 bytes``, ``1.50 KiB``, ``9.08 GiB``).

    A negative count (a difference) picks its unit by magnitude."""
    size = abs(nbytes)
    if size < 1024:
        return f"{int(nbytes)} bytes"
    if size < 1024**2:
        return f"{nbytes / 1024:.2f} KiB"
    if size < 1024**3:
        return f"{nbytes / 1024**2:.2f} MiB"
    return f"{nbytes / 1024**3:.2f} GiB"


def format_bytes(nbytes: float | None) -> str:
    """``format_size``, with ``-`` for a missing value (a table cell)."""
    return "-" if nbytes is None else format_size(nbytes)


def gib(nbytes: float | None) -> str:
    """A byte count as a bare number of GiB with two decimals (a table column headed GiB); ``-`` when missing."""
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def pct(value: float | None) -> str:
    """A fraction as a percentage with one decimal (``0.034`` -> ``3.4%``); ``-`` when missing, ``inf`` when infinite."""
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.1%}"

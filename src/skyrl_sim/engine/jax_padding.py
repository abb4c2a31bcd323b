"""SkyRL's JAX backend padding as a ``PaddingRule`` (``trainer.strategy: jax``).

The JAX backend (skyrl 0.4.0) runs a forward_backward/forward call as one array: every row is padded to the bucketed
length of the call's longest row, ``round_up_seq_len`` (at most two significant binary digits, at least 32), so its
JIT compiles few shapes. It does not pad rows with copies of row 0: the only row padding is to a multiple of the
FSDP size (``parallelism.dp`` here; 1 on one CPU device). Its rows are the datums' input tokens as sent: unlike
SkyRL-Train it appends no target token, so the width is the bucket of the longest *input* (``shape_call`` hands this
rule the longest row as input + 1).
"""

from __future__ import annotations

from skyrl_sim.engine.shapes import PaddingRule, RowAlignment, round_up
from skyrl_sim.schema.endpoint import Endpoint

MIN_BUCKET = 32


def round_up_seq_len(length: int) -> int:
    """Round up to a value with at most two significant binary digits (8 -> 32, 512 -> 512, 5000 -> 6144)."""
    if length <= MIN_BUCKET:
        return MIN_BUCKET
    top = length.bit_length() - 1
    step = 1 << (top - 1)  # the second significant digit's weight
    return round_up(length, step)


def jax_align_rows(rows: int, endpoint: Endpoint, kind: str) -> RowAlignment:
    """Rows only to a multiple of the FSDP (data-parallel) size."""
    alignment = endpoint.parallelism.dp
    return RowAlignment(round_up(rows, alignment), alignment)


def jax_row_width(longest_row: int, endpoint: Endpoint) -> int:
    """The bucket of the longest input (``longest_row`` counts SkyRL-Train's extra target token; JAX has none)."""
    return round_up_seq_len(longest_row - 1)


JAX = PaddingRule(
    "jax",
    jax_align_rows,
    jax_row_width,
    description="SkyRL JAX backend: every row to round_up_seq_len of the call's longest input; rows to the FSDP size",
)

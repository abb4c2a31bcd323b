"""Width blocks: padded micro-batch widths that the memory walk and the time model evaluate together.

A long run meets most widths of a block, and one vectorised evaluation of a block's lanes costs about as much as a few
dozen single micro-batches, so both models evaluate a whole block on first use and keep it. A block spans
``WIDTH_BLOCK`` consecutive multiples of a step (the TP size: widths are rounded up to it).
"""

from __future__ import annotations

WIDTH_BLOCK = 128
"""Widths in one block, as multiples of the step."""


def block_first(width: int, step: int) -> int:
    """The first multiple (in units of ``step``) of the block that holds ``width``, a multiple of ``step``."""
    return width // (step * WIDTH_BLOCK) * WIDTH_BLOCK

"""Width tiles: padded micro-batch widths that the memory walk and the time model evaluate together.

A long run meets most widths of a tile, and one vectorised evaluation of a tile's lanes costs about as much as a few
dozen single micro-batches, so both models evaluate a whole tile on first use and keep it. A tile spans
``WIDTH_TILE`` consecutive multiples of a step (the TP size: widths are rounded up to it).
"""

from __future__ import annotations

WIDTH_TILE = 128
"""Widths in one tile, as multiples of the step."""


def tile_first(width: int, step: int) -> int:
    """The first multiple (in units of ``step``) of the tile that holds ``width``, a multiple of ``step``."""
    return width // (step * WIDTH_TILE) * WIDTH_TILE

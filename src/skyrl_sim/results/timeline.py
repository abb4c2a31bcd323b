"""A call's memory timeline as typed rows: what plots, traces and ``--explain`` read.

The memory walk records, per call, one row per segment (embedding, each layer's forward, the LM head, each layer's
backward) of the micro-batch that set the peak or failed, then, for a call that ran out of memory, one row per op of
the failing segment up to the allocation that failed. RunResults carry the rows as JSON objects
(``CallRecord.memory["timeline"]``); ``timeline_of`` reads them back as ``TimelineRow``s, so no report looks a field up
by a string key, and a renamed or missing field fails in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skyrl_sim.results.result import CallRecord


@dataclass(frozen=True)
class TimelineRow:
    """One row of a call's memory timeline.

    A segment row (``failed`` is None) holds the op and size of the allocation at which the segment peaks, the bytes
    allocated after the segment, and its ``peak``. An op row (``failed`` is True or False) is one allocation of the
    failing segment: its op and size, the bytes allocated once it is made, and ``stage`` (``recompute`` for the
    recompute part of a backward segment, else the phase).
    """

    microbatch: int
    phase: str
    layer: int | str  # a layer index, or "embedding", "lm_head", "routed_expert_replay", "microbatch_inputs"
    op: str
    bytes: int
    allocated: int
    peak: int | None = None
    stage: str | None = None
    failed: bool | None = None

    @property
    def is_op(self) -> bool:
        """An op row of the failing segment (not a segment row)."""
        return self.failed is not None

    @property
    def high(self) -> int:
        """The highest allocated bytes this row reached: a segment's peak, an op's allocated total."""
        return self.peak if self.peak is not None else self.allocated

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> TimelineRow:
        """A row as the walk records it (``as_dict``'s inverse); unknown keys are an error."""
        return cls(**row)

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of this row: the fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def timeline_of(call: CallRecord) -> list[TimelineRow]:
    """The call's memory timeline (empty when the call kept none)."""
    return [TimelineRow.from_dict(row) for row in (call.memory or {}).get("timeline") or []]

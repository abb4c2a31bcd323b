"""Typed timeline rows: every row the walk records reads back as a TimelineRow and writes back unchanged."""

from __future__ import annotations

import pytest

from project_paths import SCENARIOS
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.reports.memory_explain import condensed_rows
from skyrl_sim.results.timeline import TimelineRow, timeline_of
from skyrl_sim.schema.scenario import load_scenario


@pytest.fixture(scope="module")
def failing_call():
    scenario = load_scenario(SCENARIOS / "queue_drain_17.yaml")
    result = PluginHost().run(scenario.resolve("no-cap"), "sim")
    return next(c for c in result.calls if c.oom is not None)


def test_walk_rows_round_trip_through_the_typed_row(failing_call) -> None:
    raw = failing_call.memory["timeline"]
    rows = timeline_of(failing_call)
    assert [row.as_dict() for row in rows] == raw
    ops = [row for row in rows if row.is_op]
    assert ops and ops[-1].failed and not any(row.failed for row in ops[:-1])  # the failing allocation comes last
    assert all(row.peak is not None for row in rows if not row.is_op)


def test_a_row_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(TypeError):
        TimelineRow.from_dict(
            {"microbatch": 0, "phase": "forward", "layer": 1, "op": "x", "bytes": 1, "allocated": 2, "colour": "red"}
        )


def test_condensed_spans_merge_consecutive_layers_and_keep_the_failing_ops(failing_call) -> None:
    rows = timeline_of(failing_call)
    spans = condensed_rows(rows, keep_ops=3)
    assert [s.op_row for s in spans[-3:]] == [r for r in rows if r.is_op][-3:]
    segments = [s for s in spans if s.op_row is None]
    assert len(segments) < len([r for r in rows if not r.is_op])  # layers of one phase collapsed
    assert max(s.peak for s in segments) == max(r.high for r in rows if not r.is_op)

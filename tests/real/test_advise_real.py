"""``advise`` proven on the real backend (CPU, tiny endpoint): what it recommends for the miniature drain runs with no
OOM and the predicted call shapes; a configuration it rejects fails, or comes within the band, for real."""

from __future__ import annotations

import pytest

from project_paths import SCENARIOS
from skyrl_sim.commands.advise_report import Advice
from skyrl_sim.commands.advise_search import advise
from skyrl_sim.results.band import held_bytes
from skyrl_sim.results.verdict import AT_RISK, FAIL
from skyrl_sim.schema.scenario import load_scenario

pytestmark = pytest.mark.real

TINY = SCENARIOS / "queue_drain_17_tiny.yaml"
SHAPE = ("kind", "request_ids", "rows", "padded_rows", "width", "microbatches")


@pytest.fixture(scope="module")
def advice() -> Advice:
    """The search from the scenario's no-cap settings (its first variant), on the simulator."""
    return advise(str(TINY), variant="no-cap", workers=1)


def shapes(result):
    return [tuple(getattr(c, f) for f in SHAPE) for c in result.calls]


def test_the_recommendation_runs_for_real_with_no_oom_and_the_predicted_shapes(advice, host, tmp_path):
    assert advice.recommended is not None and advice.overrides()
    variant = load_scenario(TINY).resolve("no-cap", advice.overrides())
    real = host.run(variant, "megatron", {"run_dir": str(tmp_path)})
    sim = host.run(variant, "sim")
    assert real.oom_calls == [] and real.failed == []
    assert len(real.completed) == len(real.requests) == 17
    assert shapes(real) == shapes(sim)
    capacity = variant.endpoint.capacity_bytes
    assert max(c.peak_bytes for c in real.calls if c.peak_bytes) < capacity


def test_a_rejected_configuration_fails_or_comes_within_the_band(advice, host, tmp_path):
    """The cheapest configuration the search rejected (FAIL: out of memory, or AT RISK), other than the scenario's own
    settings."""
    rejected = [c for c in advice.candidates if c.verdict in (FAIL, AT_RISK) and c.settings]
    assert rejected
    pick = min(rejected, key=lambda c: (c.summary["calls"], c.summary["makespan_s"]))
    variant = load_scenario(TINY).resolve("no-cap", pick.settings)
    real = host.run(variant, "megatron", {"run_dir": str(tmp_path)})
    capacity = variant.endpoint.capacity_bytes
    held = [h for c in real.calls if c.oom is None and (h := held_bytes(c)) is not None]
    within_band = bool(held) and capacity - max(held) < advice.margin.band.bytes_at(max(held))
    assert real.oom_calls or within_band, (pick.settings, [c.peak_bytes for c in real.calls])

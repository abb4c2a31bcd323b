"""The seed-scale endpoint for one H200 (``seed-scale-h200-tp1``): the simulator's verdicts and attempted sizes on the
seed's 17-request drain, pinned without a GPU, and why its widths are the seed's per-rank shard."""

from __future__ import annotations

import pytest

from project_paths import SCENARIOS
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario

ENDPOINT = "seed-scale-h200-tp1"
GIB = 2**30
# [35,001, 16, 8,704] bf16: the seed's fc1 LoRA-B tensor per TP rank (the seed's call is 3 tokens wider: TP 4 rounding)
FC1_LORA_B = 35_001 * 16 * 8_704 * 2


def run(variant: str, sets: dict[str, object] | None = None) -> RunResult:
    scenario = load_scenario(SCENARIOS / "queue_drain_17.yaml", endpoint=ENDPOINT)
    return PluginHost().run(scenario.resolve(variant, sets or {}), "sim")


def test_no_cap_fails_in_the_backward_recomputing_the_last_layers_lora_fc1() -> None:
    result = run("no-cap")
    assert [c.padded_rows for c in result.calls if c.kind == "forward_backward"] == [16, 16]
    (oom,) = [c.oom for c in result.calls if c.oom]
    assert oom.where["phase"] == "backward" and oom.where["stage"] == "recompute"
    assert oom.where["layer"] == 3 and oom.where["op"] == "mlp.linear_fc1.lora_b"
    assert oom.where["shape"] == [35_001, 16, 8_704] and oom.where["dtype"] == "bf16"
    assert oom.attempted_bytes == FC1_LORA_B
    assert 9.07 < oom.attempted_bytes / GIB < 9.09  # the seed's 9.08 GiB
    assert sum(r.status == "completed" for r in result.requests) == 1


def test_cap_only_fails_the_long_request_alone_and_cap_aware_passes() -> None:
    cap_only = run("cap-only")
    (call,) = [c for c in cap_only.calls if c.oom]
    assert call.rows == 1 and call.padded_rows == 16
    assert call.oom.attempted_bytes == FC1_LORA_B
    assert [r.id for r in cap_only.requests if r.status != "completed"] == [9]
    aware = run("cap-aware")
    assert all(r.status == "completed" for r in aware.requests) and not [c for c in aware.calls if c.oom]
    limit = 67.5 * GIB
    assert max(c.peak_bytes for c in aware.calls if c.peak_bytes) < limit / 4  # far from the limit


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(62.5, "forward"), (64.0, "fused_lm_head_logprob.backward"), (70.5, "mlp.linear_fc1.lora_scale")],
)
def test_the_limit_sits_inside_the_band_that_gives_the_seeds_op(limit: float, expected: str) -> None:
    """Below the band the forward or the fused LM head's backward fails; above it a later op of the backward does: the
    endpoint's 67.5 GiB is neither."""
    (oom,) = [c.oom for c in run("no-cap", {"memory_limit_gib": limit}).calls if c.oom]
    assert expected in (oom.where["phase"], oom.where["op"])


def test_the_seed_models_full_widths_fail_in_the_forward_on_one_gpu() -> None:
    """Why the endpoint takes the seed's per-rank widths: with Qwen3.6-27B's full heads, FFN and vocabulary at TP 1 the
    16-row call fails in the forward's LoRA fc1 (36.3 GiB tensors) even with the whole card."""
    full = {"preset": "seed-shard", "num_attention_heads": 24, "num_kv_heads": 4, "ffn_hidden_size": 17_408}
    full["vocab_size"] = 248_320
    result = run("no-cap", {"model": full, "memory_limit_gib": None})
    (oom,) = [c.oom for c in result.calls if c.oom]
    assert oom.where["phase"] == "forward" and "fc1" in oom.where["op"]
    assert oom.attempted_bytes == 35_001 * 16 * 34_816 * 2

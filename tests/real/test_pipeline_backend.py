"""Pipeline parallelism on the real backend (``tiny-cpu-pp2``: two 1F1B stages on two CPU ranks, gloo): the two
stages train and export the very model one rank trains; an out-of-memory failure on one stage fails the call cleanly
(named by its stage, the other stage never left waiting) and the next call runs; each stage's peak is measured."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml

from project_paths import SCENARIOS
from skyrl_sim.schema.scenario import load_scenario

pytestmark = pytest.mark.real

ENDPOINT = SCENARIOS / "endpoints" / "tiny-cpu-pp2.yaml"
ONE_STAGE = {"parallelism.pp": 1, "hardware.devices": 1}
MEASURED = {"clock": "measured"}


def write_scenario(tmp_path: Path, requests: list[dict], variants: dict | None = None) -> Path:
    body = {
        "name": "pp_small",
        "endpoint": str(ENDPOINT),
        "workload": {
            "clients": [{"name": "c", "model_id": "m", "submit": {"mode": "after_previous"}, "requests": requests}]
        },
        "variants": variants or {"default": {"set": {}}},
    }
    path = tmp_path / "pp_small.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_two_stages_train_and_export_the_model_one_rank_trains(host, tmp_path):
    """The same calls at PP 2 and PP 1: per-datum log-probs and losses agree (before and after an Adam step), and the
    Hugging Face checkpoint joined from the two stages holds the weights the single rank writes."""
    requests = [
        {"type": "forward_backward", "datums": [30, 20, 25, 40, 15]},  # 5 rows: two micro-batches of 4 and 1
        {"type": "optim_step", "learning_rate": 0.01},
        {"type": "forward_backward", "datums": [33, 12]},
        {"type": "save_weights_for_sampler", "checkpoint": "trained"},
    ]
    scenario = load_scenario(write_scenario(tmp_path, requests))
    runs = {}
    for name, sets in (("pp2", {}), ("pp1", ONE_STAGE)):
        run_dir = tmp_path / name
        result = host.run(scenario.resolve("default", sets), "megatron", {"run_dir": str(run_dir)})
        assert [r.status for r in result.requests] == ["completed"] * 4, [r.error for r in result.requests]
        runs[name] = (result, run_dir / "pp_small-default" / "checkpoints" / "m" / "trained")
    (pp2, pp2_dir), (pp1, pp1_dir) = runs["pp2"], runs["pp1"]
    for request_id in (1, 3):
        two, one = pp2.request(request_id), pp1.request(request_id)
        assert two.metrics["num_tokens:sum"] == one.metrics["num_tokens:sum"]
        assert two.metrics["total_loss:sum"] == pytest.approx(one.metrics["total_loss:sum"], rel=1e-5)
        for a, b in zip(two.outputs["logprobs"], one.outputs["logprobs"], strict=True):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    stage_peaks = [c.memory["stage_peaks"] for c in pp2.calls if c.kind == "forward_backward"]
    assert all(len(peaks) == 2 and min(peaks) > 0 for peaks in stage_peaks)
    from safetensors.torch import load_file

    two_weights, one_weights = load_file(pp2_dir / "model.safetensors"), load_file(pp1_dir / "model.safetensors")
    assert sorted(two_weights) == sorted(one_weights)
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def _between_stage_peaks(host, tmp_path, requests: list[dict], sets: dict) -> tuple:
    """The scenario's variant with the tensor limit halfway between the first call's two stage peaks (the walk's),
    its real run and its walk."""
    scenario = load_scenario(write_scenario(tmp_path, requests))
    probe = host.run(scenario.resolve("default", sets), "sim")
    first, last = probe.calls[0].memory["stage_peaks"]
    variant = scenario.resolve("default", {**sets, "memory_limit_gib": (first + last) / 2 / 2**30})
    started = time.monotonic()
    real = host.run(variant, "megatron", {**MEASURED, "call_timeout_s": "600"})
    assert time.monotonic() - started < 900  # ends: no stage waits for one that failed
    return (first, last), variant, real, host.run(variant, "sim")


def test_the_first_stage_runs_out_of_memory_where_the_last_fits(host, tmp_path):
    """Without recompute the first stage holds two micro-batches' attention scores (its warm-up forward and the one
    in its backward), the last one micro-batch: between the two peaks only stage 0 fails. The call fails with stage 0's
    OOM, as the walk says; stage 1 ran its part to the end (its peak is measured, under the limit); the next call
    completes."""
    requests = [
        {"type": "forward_backward", "datums": [700, 650, 600, 550, 500, 450]},  # two micro-batches: 1F1B holds both
        {"type": "forward_backward", "datums": [40, 30]},
    ]
    (first, last), variant, real, sim = _between_stage_peaks(
        host, tmp_path, requests, {"trainer.recompute": {"granularity": "none"}}
    )
    assert first > last
    [failed, after] = real.calls
    assert failed.oom is not None and sim.calls[0].oom is not None, failed.error
    assert failed.oom.where["pp_stage"] == sim.calls[0].oom.where["pp_stage"] == 0
    assert failed.oom.where["ranks_failed"] == [0]
    assert failed.oom.attempted_bytes == sim.calls[0].oom.attempted_bytes
    assert failed.memory["stage_peaks"][1] <= variant.endpoint.capacity_bytes
    assert after.oom is None and after.error is None
    assert [r.status for r in real.requests] == ["failed", "completed"]


def test_the_last_stage_runs_out_of_memory_where_the_first_fits(host, tmp_path):
    """Short rows without recompute: the last stage (its layers, the LM head and the log-probs) peaks above the first.
    Between the two only stage 1 fails, and stage 0, which waits for its gradients, is released."""
    requests = [{"type": "forward_backward", "datums": [80, 70, 60]}, {"type": "forward_backward", "datums": [40]}]
    (first, last), variant, real, sim = _between_stage_peaks(
        host, tmp_path, requests, {"trainer.recompute": {"granularity": "none"}}
    )
    assert last > first
    [failed, after] = real.calls
    assert failed.oom is not None and sim.calls[0].oom is not None, failed.error
    assert failed.oom.where["pp_stage"] == sim.calls[0].oom.where["pp_stage"] == 1
    assert failed.oom.where["ranks_failed"] == [1]
    assert failed.memory["stage_peaks"][0] <= variant.endpoint.capacity_bytes
    assert after.oom is None and after.error is None


def test_vllm_samples_from_the_checkpoint_the_stages_export(host, tmp_path):
    """``save_weights_for_sampler`` at PP 2 joins the stages into one Hugging Face checkpoint that vLLM serves."""
    pytest.importorskip("skyrl_sim_plugins.megatron_vllm.sampler")
    requests = [
        {"type": "forward_backward", "datums": [12, 12]},
        {"type": "optim_step", "learning_rate": 0.02},
        {"type": "save_weights_for_sampler", "checkpoint": "trained"},
        {"type": "sample", "prompt_tokens": 12, "max_tokens": 8, "checkpoint": "trained"},
    ]
    scenario = load_scenario(write_scenario(tmp_path, requests))
    result = host.run(scenario.resolve("default"), "megatron", {"run_dir": str(tmp_path / "run")})
    assert [(r.id, r.error) for r in result.failed] == []
    [samples] = result.request(4).outputs["samples"]
    assert len(samples) == 8

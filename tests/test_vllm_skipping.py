"""The engine a run uses (``fast.vllm_cohorts.CohortEngine``: cohorts, runs of decode steps planned at once) against
the rule it is held to (``reference.vllm_scheduler.VllmEngine``: one step at a time), in whole runs.

On seeded random workloads (several engines, several tenants' LoRA adapters under ``max_loras``, prefix sharing on or
off, chunked prefill under a small token budget, a KV cache small enough to preempt) both must give every request
the same engine, queue wait, first token, completion and preemptions, the engines the same counters, and every
timeline point of the fast run must be a point of the step-by-step run. Step times are priced by the endpoint's
roofline either way: a planned run of decode steps sums its steps in closed form, so times agree to float rounding
(relative 1e-9), and every count is equal.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.reference.vllm_scheduler import VllmEngine
from skyrl_sim_plugins.sim.service.inference import vllm_sampler

REL = 1e-9
VLLM_TIMES = ("sent_s", "scheduled_s", "first_token_s", "finished_s")
COUNTERS = ("preemptions", "steps", "prompt_tokens", "generation_tokens", "prefix_cache_hit_tokens")


def random_document(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    lora = rng.random() < 0.6
    inference: dict[str, Any] = {
        "num_engines": rng.choice([1, 2, 3]),
        "max_num_seqs": rng.choice([4, 8, 32]),
        "max_num_batched_tokens": rng.choice([64, 128, 512]),
        "block_size": 16,
        "num_gpu_blocks_override": rng.randint(60, 400),
        "max_model_len": 1024,
        "enable_prefix_caching": rng.random() < 0.8,
        "enable_lora": lora,
        "max_loras": rng.choice([1, 2]),
        "generate_concurrency_per_engine": rng.choice([4, 16, 64]),
    }
    clients = []
    for i in range(rng.randint(1, 4)):
        requests: list[dict[str, Any]] = [{"type": "save_weights_for_sampler", "checkpoint": "s"}]
        for _ in range(rng.randint(3, 12)):
            requests.append(
                {
                    "type": "sample",
                    "checkpoint": "s",
                    "prompt_tokens": rng.randint(1, 300),
                    "max_tokens": rng.randint(1, 200),
                    "num_samples": rng.choice([1, 1, 2, 4]),
                }
            )
        clients.append(
            {
                "name": f"c{i}",
                "model_id": f"tenant-{i}",
                "submit": {"mode": "back_to_back", "gap_s": rng.choice([0.0005, 0.01, 0.2])},
                "requests": requests,
            }
        )
    return {
        "name": f"skipping_{seed}",
        "endpoint": {
            "name": "skipping",
            "model": "qwen3-8b",
            # colocated engines cover the trainer's devices, one per device (SkyRL asserts it: _build_policy)
            "hardware": {"profile": "h200", "devices": inference["num_engines"]},
            "parallelism": {"dp": inference["num_engines"]},
            "trainer": {"strategy": "megatron", "micro_train_batch_size_per_gpu": 1},
            "inference": inference,
            # vLLM serves adapters only when the trainer syncs adapters (SkyRL's _uses_lora_weight_sync)
            "lora": {"merge_lora": not lora},
        },
        "workload": {"clients": clients},
    }


def run(path: Path, fast: bool, monkeypatch: pytest.MonkeyPatch) -> RunResult:
    """The scenario on the simulator, its engines the fast ones (as a run has them) or the reference's."""
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(vllm_sampler, "CohortEngine", VllmEngine)
        return PluginHost().run(load_scenario(path).resolve("default"), "sim")


def close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


@pytest.mark.parametrize("seed", range(24))
def test_the_fast_engine_changes_nothing_but_rounding(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "skipping.yaml"
    path.write_text(yaml.safe_dump(random_document(seed)))
    skipped, stepped = run(path, True, monkeypatch), run(path, False, monkeypatch)
    assert [r.id for r in skipped.requests] == [r.id for r in stepped.requests]
    for a, b in zip(skipped.requests, stepped.requests, strict=True):
        assert (a.status, a.error) == (b.status, b.error)
        assert close(a.completed_s, b.completed_s), (a.id, a.completed_s, b.completed_s)
        va, vb = (a.outputs or {}).get("vllm"), (b.outputs or {}).get("vllm")
        if va is None or vb is None:
            assert va == vb
            continue
        assert (va["engine"], va["preemptions"]) == (vb["engine"], vb["preemptions"])
        for key in VLLM_TIMES:
            assert close(va[key], vb[key]), (a.id, key, va[key], vb[key])
    engines_a, engines_b = skipped.inference["engines"], stepped.inference["engines"]
    assert len(engines_a) == len(engines_b)
    for ea, eb in zip(engines_a, engines_b, strict=True):
        assert {k: ea[k] for k in COUNTERS} == {k: eb[k] for k in COUNTERS}
        assert close(ea["busy_s"], eb["busy_s"])
        ta, tb = ea["timeline"], eb["timeline"]
        assert len(ta["t"]) <= len(tb["t"])
        points = {
            (round(t, 6), tb["running"][i], tb["waiting"][i], tb["kv_blocks"][i], tb["preemptions"][i])
            for i, t in enumerate(tb["t"])
        }
        for i, t in enumerate(ta["t"]):
            point = (round(t, 6), ta["running"][i], ta["waiting"][i], ta["kv_blocks"][i], ta["preemptions"][i])
            assert point in points, (i, point)


def test_the_random_runs_cover_preemption_lora_and_several_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs above exercise what they claim: preemptions, adapters and several engines, all samples completed."""
    preemptions = lora_runs = multi = 0
    for seed in range(24):
        document = random_document(seed)
        path = tmp_path / f"cover{seed}.yaml"
        path.write_text(yaml.safe_dump(document))
        result = run(path, True, monkeypatch)
        assert all(r.status == "completed" for r in result.requests)
        preemptions += sum(e["preemptions"] for e in result.inference["engines"])
        inference = document["endpoint"]["inference"]
        lora_runs += inference["enable_lora"]
        multi += inference["num_engines"] > 1
    assert preemptions > 20 and lora_runs >= 5 and multi >= 5

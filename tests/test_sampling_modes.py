"""The three sampling modes on the simulator: which requests wait for which, and when each sample completes.

SkyRL 0.4.0: serial (one wave per iteration, every future at the wave's end), continuous (concurrent on vLLM, each
future at its own end, drained before blocking work), forwarded (around the engine: a sample never waits for a
pass). The admission and drain order itself is held to SkyRL's engine in ``tests/service/test_continuous_sampling.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from scenario_text import run_one_client
from skyrl_sim.engine.rules import sampling_mode
from skyrl_sim.errors import ScenarioError
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.results.result import RunResult
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.scenario import load_scenario


def endpoint(**sections: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "sampling",
        "model": "qwen3-8b",
        "hardware": {"profile": "h200", "devices": 1},
        "trainer": {"strategy": "megatron", "micro_train_batch_size_per_gpu": 1},
        # samples with no weight sync before them: SkyRL's first sleep at level 2 would refuse them
        # (tests/test_colocation.py); level 1 keeps the base weights, so these tests see scheduling only
        "inference": {"sleep_level": 1},
    }
    for key, value in sections.items():
        body[key] = {**body[key], **value} if isinstance(body.get(key), dict) else value
    return body


def run(tmp_path: Path, requests: list[dict[str, Any]], **sections: Any) -> RunResult:
    body = {
        "name": "modes",
        "endpoint": endpoint(**sections),
        "workload": {
            "clients": [
                {"name": "c", "model_id": "m", "submit": {"mode": "back_to_back", "gap_s": 0.001}, "requests": requests}
            ]
        },
    }
    path = tmp_path / "modes.yaml"
    path.write_text(yaml.safe_dump(body))
    return PluginHost().run(load_scenario(path).resolve("default"), "sim")


SAMPLES = [{"type": "sample", "prompt_tokens": 64, "max_tokens": n, "num_samples": 2} for n in (16, 64, 256, 1024)]


def test_the_mode_follows_from_the_backend_and_placement_as_skyrl_decides() -> None:
    def mode(**sections: Any) -> str:
        return sampling_mode(Endpoint.model_validate(endpoint(**sections)))

    assert mode() == "continuous"  # SkyRL-Train, colocated (SkyRL's default placement)
    assert mode(placement={"colocate_all": False}) == "forwarded"
    assert mode(trainer={"strategy": "fsdp"}, placement={"colocate_all": False}) == "forwarded"
    assert mode(trainer={"strategy": "jax"}) == "serial"
    assert mode(trainer={"strategy": "jax"}, placement={"colocate_all": False}) == "serial"
    assert mode(engine={"sampling": "serial"}) == "serial"


def test_continuous_samples_complete_each_at_its_own_end_and_serial_ones_together(tmp_path: Path) -> None:
    continuous = run(tmp_path, SAMPLES)
    serial = run(tmp_path, SAMPLES, engine={"sampling": "serial"})
    ends = [r.completed_s for r in continuous.requests]
    assert ends == sorted(ends) and len(set(ends)) == 4  # shorter generations are written first
    assert len({r.completed_s for r in serial.requests}) == 1  # the wave's futures are written at its end
    assert [c.kind for c in serial.calls] == ["sample"]
    # no blocking call: the engine kept iterating (the one record is vLLM's start and wake before the first samples)
    assert [c.kind for c in continuous.calls] == ["prepare_for_sampling"]
    assert continuous.request(1).completed_s < serial.request(1).completed_s
    assert continuous.inference["mode"] == "continuous" and serial.inference["mode"] == "serial"
    for record in continuous.requests:
        vllm = record.outputs["vllm"]
        assert record.started_s <= vllm["sent_s"] <= vllm["scheduled_s"] < vllm["first_token_s"] < vllm["finished_s"]
        assert record.outputs["generated_tokens"] == 2 * {1: 16, 2: 64, 3: 256, 4: 1024}[record.id]


def test_continuous_drains_in_flight_samples_before_a_pass_and_defers_newer_samples(tmp_path: Path) -> None:
    requests = [*SAMPLES[:2], {"type": "forward_backward", "lengths": [2048]}, SAMPLES[0]]
    result = run(tmp_path, requests)
    drain, fb = [c for c in result.calls if c.kind != "prepare_for_sampling"]  # the switches: vLLM woken before samples
    assert (drain.kind, drain.request_ids, fb.kind, fb.request_ids) == ("drain", [1, 2], "forward_backward", [3])
    assert drain.end_s == pytest.approx(max(result.request(i).completed_s for i in (1, 2)), abs=0.06)
    assert fb.start_s >= drain.end_s
    later = result.request(4)
    assert later.started_s > fb.end_s  # newer than the pass: admitted only in a later iteration
    assert "Draining 2 in-flight sample request(s) before forward_backward ..." in result.log


def test_forwarded_samples_do_not_wait_for_a_long_pass(tmp_path: Path) -> None:
    requests = [{"type": "forward_backward", "lengths": [32_000]}, SAMPLES[0]]
    forwarded = run(tmp_path, requests, placement={"colocate_all": False})
    continuous = run(tmp_path, requests)
    fb = next(c for c in forwarded.calls if c.kind == "forward_backward")
    assert forwarded.request(2).completed_s < fb.end_s  # served by vLLM while the pass runs
    assert continuous.request(2).started_s > fb.end_s  # queued behind the pass in the engine
    assert not any(c.kind == "drain" for c in forwarded.calls)


def test_an_unloaded_adapter_is_vllms_404_when_samples_bypass_the_engine(tmp_path: Path) -> None:
    requests = [
        {"type": "save_weights_for_sampler", "checkpoint": "s1"},
        {"type": "sample", "checkpoint": "s1", "prompt_tokens": 8, "max_tokens": 4},
        {"type": "unload_model"},
        {"type": "sample", "checkpoint": "s1", "prompt_tokens": 8, "max_tokens": 4},
    ]
    sections = {"placement": {"colocate_all": False}, "inference": {"enable_lora": True}, "lora": {"merge_lora": False}}
    # the client waits for each result before the next submission, so the unload runs before the last sample
    body_requests = requests
    result = run_after_previous(tmp_path, body_requests, **sections)
    assert result.request(2).status == "completed"
    assert result.request(4).error == "The model `m` does not exist."


def run_after_previous(tmp_path: Path, requests: list[dict[str, Any]], **sections: Any) -> RunResult:
    return run_one_client(tmp_path, "modes", endpoint(**sections), requests)


def test_a_sample_longer_than_the_engine_admits_is_refused_as_vllm_refuses_it(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        [{"type": "sample", "prompt_tokens": 100, "max_tokens": 700}, {"type": "sample", "prompt_tokens": 100}],
        inference={"num_gpu_blocks_override": 50, "max_model_len": 700},
    )
    assert result.request(1).status == "failed" and result.request(2).status == "completed"
    assert "maximum context length is 700 tokens. However, you requested 800 tokens" in result.request(1).error


def test_a_cache_that_cannot_hold_one_longest_sequence_does_not_start(tmp_path: Path) -> None:
    """vLLM's start-up check: one max_model_len sequence (4,096 tokens: 256 blocks of 16) in 49 usable blocks. The
    engine never starts, so the sample fails with vLLM's reason (a run-time failure, not bad input)."""
    result = run(tmp_path, SAMPLES[:1], inference={"num_gpu_blocks_override": 50, "max_model_len": 4096})
    assert result.request(1).status == "failed"
    assert re.search(r"max seq len \(4096\).*256 KV blocks of 16 tokens, more than the 49", result.request(1).error or "")


def test_a_small_kv_cache_preempts_and_the_run_records_it(tmp_path: Path) -> None:
    many = [{"type": "sample", "prompt_tokens": 200, "max_tokens": 600, "num_samples": 4, "count": 8}]
    tight = run(tmp_path, many, inference={"num_gpu_blocks_override": 400, "max_model_len": 1024})
    roomy = run(tmp_path, many)
    (engine,) = tight.inference["engines"]
    assert engine["preemptions"] > 0 and max(engine["timeline"]["preemptions"]) == engine["preemptions"]
    assert max(engine["timeline"]["kv_blocks"]) <= 399
    assert roomy.inference["engines"][0]["preemptions"] == 0
    assert sum(r.outputs["vllm"]["preemptions"] for r in tight.requests) == engine["preemptions"]
    assert tight.makespan_s > roomy.makespan_s


def test_training_only_runs_have_no_inference_section(tmp_path: Path) -> None:
    result = run(tmp_path, [{"type": "forward_backward", "lengths": [100]}])
    assert result.inference == {}
    assert b'"inference"' not in result.to_json()


def test_vllm_refuses_fewer_batched_tokens_than_sequences() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Endpoint.model_validate(endpoint(inference={"max_num_seqs": 512, "max_num_batched_tokens": 256}))


def test_bad_inference_settings_name_the_key(tmp_path: Path) -> None:
    clients = [{"name": "c", "model_id": "m", "requests": [{"type": "sample"}]}]
    body = {"name": "bad", "endpoint": endpoint(inference={"gpu_memory_utilization": 1.5}), "workload": {"clients": clients}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(ScenarioError, match="inference.gpu_memory_utilization"):
        load_scenario(path)

"""What the Tinker SDK sends (``sdk: tinker-0.25``, ``schema/tinker_sdk.py``) and what the API refuses at submission
(``engine/admission.py``), on the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from project_paths import ROOT
from skyrl_sim.errors import ScenarioError
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.tinker_sdk import FWDBWD_MAX_CHUNK_BYTES, FWDBWD_MAX_CHUNK_LEN, chunk_datums, datum_bytes

ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "tiny-cpu-tp1.yaml")
ROOMY = {"memory_limit_gib": None, "engine.cap_aware_padding": True}  # the device's memory, rows as sent


def scenario(tmp_path: Path, requests: list[dict], sdk: str = "tinker-0.25", **client: object) -> Path:
    path = tmp_path / "sdk.yaml"
    document = {
        "name": "sdk",
        "endpoint": ENDPOINT,
        "workload": {"clients": [{"name": "c", "model_id": "m", "sdk": sdk, "requests": requests, **client}]},
    }
    path.write_text(yaml.safe_dump(document))
    return path


def test_chunks_follow_the_sdks_datum_and_byte_limits() -> None:
    assert datum_bytes(100, "cross_entropy") == 100 * (4 + 8 + 4)  # int32 input, int64 targets, fp32 weights
    assert datum_bytes(100, "ppo") == 100 * (4 + 8 + 4 + 4)  # targets, sampling log-probs, advantages
    assert chunk_datums([10] * 2500, "cross_entropy") == [(10,) * FWDBWD_MAX_CHUNK_LEN] * 2 + [(10,) * 452]
    per = FWDBWD_MAX_CHUNK_BYTES // datum_bytes(1000, "cross_entropy")  # 312 datums of 1,000 tokens fill a chunk
    chunks = chunk_datums([1000] * 700, "cross_entropy")
    assert [len(c) for c in chunks] == [per, per, 700 - 2 * per]
    assert chunk_datums([400_000, 5, 5], "cross_entropy") == [(400_000,), (5, 5)]  # over the limit alone: its own


def test_a_forward_backward_of_many_datums_becomes_parallel_chunks_first_chunk_last(tmp_path: Path) -> None:
    lengths = [1000] * 700
    variant = load_scenario(scenario(tmp_path, [{"type": "forward_backward", "datums": lengths}])).resolve("default", ROOMY)
    planned = variant.client_requests(0)
    assert [len(p.datums) for p in planned] == [312, 76, 312]  # chunks 2 and 3, then chunk 1
    assert {p.call for p in planned} == {0} and variant.request_count() == 3
    result = PluginHost().run(variant, "sim")
    # submitted without time between them, all three are pending at one snapshot: one backend call runs them all
    assert len(result.calls) == 1 and result.calls[0].request_ids == [1, 2, 3]
    assert all(r.status == "completed" for r in result.requests)
    raw = load_scenario(scenario(tmp_path, [{"type": "forward_backward", "datums": lengths}], sdk="none"))
    assert len(raw.resolve("default").client_requests(0)) == 1  # the raw API: one request of 700 datums


def test_forward_backward_custom_is_a_forward_then_a_forward_backward(tmp_path: Path) -> None:
    requests = [{"type": "forward_backward_custom", "datums": [300, 200]}]
    path = scenario(tmp_path, requests, submit={"mode": "after_previous"})
    result = PluginHost().run(load_scenario(path).resolve("default"), "sim")
    kinds = [(c.kind, c.request_ids) for c in result.calls]
    assert kinds == [("forward", [1]), ("forward_backward", [2])]
    forward, backward = result.requests
    assert backward.submitted_s >= forward.completed_s  # the SDK awaited the forward's log-probs first


def test_compute_logprobs_is_a_one_token_sample_with_prompt_logprobs(tmp_path: Path) -> None:
    path = scenario(tmp_path, [{"type": "compute_logprobs", "prompt_tokens": 900}])
    variant = load_scenario(path).resolve("default")
    (planned,) = variant.client_requests(0)
    assert planned.spec.type == "sample" and planned.spec.prompt_logprobs
    assert (planned.spec.max_tokens, planned.spec.num_samples) == (1, 1)
    # the logits of 899 prompt positions over the 512-token vocabulary: fp32 params, fp32 cast, fp32 log-softmax
    expected = 899 * 512 * 12
    plain_path = tmp_path / "plain"
    plain_path.mkdir()
    plain_file = scenario(plain_path, [{"type": "sample", "prompt_tokens": 900, "max_tokens": 1}])
    for mode in ("serial", "continuous"):
        sets = {"engine.sampling": mode}
        result = PluginHost().run(load_scenario(path).resolve("default", sets), "sim")
        plain = PluginHost().run(load_scenario(plain_file).resolve("default", sets), "sim")
        (scored,), (unscored,) = result.requests, plain.requests
        if mode == "serial":  # a sample call: the figure is the call's
            (call,) = result.calls
            assert call.extra["prompt_logprobs_bytes"] == expected
        else:  # on the sampler: the request's output carries it
            assert not result.calls and scored.outputs["prompt_logprobs_bytes"] == expected
        # every prompt position's logits take longer than the last one's alone
        assert scored.completed_s - scored.submitted_s > unscored.completed_s - unscored.submitted_s, mode
def test_sdk_calls_need_the_sdk(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="compute_logprobs is a call of the Tinker SDK"):
        load_scenario(scenario(tmp_path, [{"type": "compute_logprobs", "prompt_tokens": 10}], sdk="none"))
    with pytest.raises(ScenarioError, match="leave loss_fn unset"):
        load_scenario(
            scenario(
                tmp_path,
                [
                    {
                        "type": "forward_backward_custom",
                        "datums": [5],
                        "loss_fn": "ppo",
                        "loss_fn_inputs": {"logprobs": -1, "advantages": 1},
                    }
                ],
            )
        )


def test_a_datum_over_the_admission_limit_fails_at_submission(tmp_path: Path) -> None:
    path = scenario(tmp_path, [{"type": "forward_backward", "lengths": [100, 5000, 200]}], sdk="none")
    variant = load_scenario(path).resolve("default", {**ROOMY, "admission.max_context_length": 4096})
    result = PluginHost().run(variant, "sim")
    first, refused, last = result.requests
    assert refused.status == "failed" and refused.started_s is None
    expected = "HTTP 400: datum 0 has 5,000 tokens, more than the maximum sequence length of 4,096 for this model"
    assert refused.error == expected
    assert first.status == last.status == "completed"
    assert all(2 not in c.request_ids for c in result.calls)  # never queued, never in a call
    skyrl = PluginHost().run(load_scenario(path).resolve("default", ROOMY), "sim")  # SkyRL: no limit
    assert all(r.status == "completed" for r in skyrl.requests)

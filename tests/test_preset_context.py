"""The built-in presets' context length: vLLM's ``max_model_len`` defaults to the model config's
``max_position_embeddings`` (``vllm/config/model.py: _get_and_verify_max_len``), so a preset without one would let the
simulator admit a prompt vLLM refuses. Each preset carries its model's value, and the presets the real backend builds
carry the value it writes into the config its vLLM reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from project_paths import ROOT
from scenario_text import run_one_client
from skyrl_sim.schema.architecture import BUILT_MODEL_CONTEXT, PRESETS
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.schema.variant import ResolvedVariant

SEED_ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "qwen3.6-27b-h200-tp4.yaml")
PUBLISHED = {"qwen3.6-27b": 262144, "qwen3.6-35b-a3b": 262144, "qwen3-8b": 40960}
"""The public models' ``max_position_embeddings`` (their HF config.json; architecture.py cites each)."""


def test_a_prompt_longer_than_qwen3_6_27b_s_context_fails_its_request_as_vllm_refuses_it(tmp_path: Path) -> None:
    """A 300,000-token prompt on Qwen3.6-27B (context 262,144): vLLM refuses the request, the run goes on."""
    requests = [
        {"type": "save_weights_for_sampler"},
        {"type": "sample", "prompt_tokens": 300000, "max_tokens": 512},
        {"type": "sample", "prompt_tokens": 1000, "max_tokens": 512},
    ]
    result = run_one_client(tmp_path, "long", SEED_ENDPOINT, requests)
    refused, served = result.request(2), result.request(3)
    assert refused.status == "failed" and served.status == "completed"
    assert refused.error == (
        "This model's maximum context length is 262144 tokens. However, you requested 300512 tokens "
        "(prompt plus max_tokens)."
    )


def test_a_prompt_that_fits_the_context_is_served(tmp_path: Path) -> None:
    requests = [{"type": "save_weights_for_sampler"}, {"type": "sample", "prompt_tokens": 200000, "max_tokens": 512}]
    result = run_one_client(tmp_path, "fits", SEED_ENDPOINT, requests)
    assert result.request(2).status == "completed"


def resolved(tmp_path: Path, endpoint: str) -> ResolvedVariant:
    """A one-sample scenario on ``endpoint``, resolved."""
    scenario = tmp_path / "s.yaml"
    client = {"name": "c", "model_id": "m", "requests": [{"type": "sample", "prompt_tokens": 10, "max_tokens": 1}]}
    scenario.write_text(json.dumps({"name": "s", "endpoint": endpoint, "workload": {"clients": [client]}}))
    return load_scenario(scenario).resolve("default")


def test_inference_max_model_len_still_overrides_the_preset(tmp_path: Path) -> None:
    run = resolved(tmp_path, SEED_ENDPOINT)
    assert run.endpoint.vllm_max_model_len(run.model) == 262144
    inference = run.endpoint.inference.model_copy(update={"max_model_len": 8192})
    assert run.endpoint.model_copy(update={"inference": inference}).vllm_max_model_len(run.model) == 8192


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_a_context_length(name: str) -> None:
    context = PRESETS[name].extra.get("max_position_embeddings")
    assert context == PUBLISHED.get(name, BUILT_MODEL_CONTEXT)


@pytest.mark.parametrize("name", sorted(set(PRESETS) - set(PUBLISHED)))
def test_the_real_backends_exported_config_gives_its_vllm_the_simulators_context(name: str, tmp_path: Path) -> None:
    """The real backend's vLLM reads ``max_position_embeddings`` from the config it exports: the same number the
    simulator's engine admits."""
    from skyrl_sim_plugins.megatron_vllm.hf_export import write_llama_config

    write_llama_config(PRESETS[name], tmp_path, "float32")
    written = json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"]
    endpoint = resolved(tmp_path, str(ROOT / "scenarios" / "endpoints" / "tiny-cpu-tp1.yaml")).endpoint
    assert written == endpoint.vllm_max_model_len(PRESETS[name]) == BUILT_MODEL_CONTEXT

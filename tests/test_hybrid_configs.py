"""Gated-DeltaNet hybrids read from their public ``config.json``: Qwen3-Next-80B-A3B's parameter count against its
model card and against transformers' own model of the same config (built on the meta device, no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_sim.schema.architecture import resolve_model

QWEN3_NEXT = Path(__file__).parent / "data" / "hf_configs" / "qwen3-next-80b-a3b" / "config.json"
CARD_TOTAL = 80e9
"""Qwen/Qwen3-Next-80B-A3B-Instruct's model card: "80B in total and 3B activated"."""


def test_qwen3_next_reads_as_a_gated_deltanet_hybrid() -> None:
    model = resolve_model({"config": str(QWEN3_NEXT)}, Path("."))
    assert model.layer_types.count("full_attention") == 12 and model.layer_types.count("linear_attention") == 36
    assert model.linear_attention is not None and model.linear_attention.fused_in_proj_checkpoint
    assert model.linear_attention.ssm_state_dtype == "auto"  # no mamba_ssm_dtype key: vLLM keeps the model's dtype
    assert model.attention_output_gate  # Qwen3-Next gates its attention without a config key
    assert model.moe is not None and (model.moe.num_experts, model.moe.top_k) == (512, 10)


def test_qwen3_next_parameters_match_the_model_card() -> None:
    model = resolve_model({"config": str(QWEN3_NEXT)}, Path("."))
    assert abs(model.parameter_count() - CARD_TOTAL) / CARD_TOTAL < 0.005


def test_qwen3_next_parameters_match_transformers() -> None:
    """The model transformers builds from the same file (its multi-token-prediction layer is not built, as SkyRL and
    vLLM do not build it): the same count, the shared experts' one-output gates (hidden x 1 per layer) included."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3NextConfig(**json.loads(QWEN3_NEXT.read_text()))
    with torch.device("meta"):
        reference = transformers.Qwen3NextForCausalLM(config)
    theirs = sum(p.numel() for p in reference.parameters())
    model = resolve_model({"config": str(QWEN3_NEXT)}, Path("."))
    assert theirs == model.parameter_count()

"""The vision tower vLLM builds beside a multimodal checkpoint's language model (Qwen3.5/3.6), on one worker: its
bytes against vLLM's own ``Qwen3_VisionTransformer`` built on the meta device, its FP8 treatment, and the switch
that drops it (``inference.language_model_only``, SkyRL's ``generator.inference_engine.language_model_only``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skyrl_sim.schema.architecture import ModelArch, from_hf_config, resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.quantization import default_ignored_layers
from skyrl_sim.schema.vision_tower import VISION_KEY, vision_tower
from skyrl_sim_plugins.sim.service.inference import vllm_budget
from skyrl_sim_plugins.sim.service.inference.vision_weights import tower_built, vision_tensors, vision_weights_bytes
from skyrl_sim_plugins.sim.service.inference.vllm_startup import load_allocations

ROOT = Path(__file__).resolve().parent.parent
BLOCKWISE = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def endpoint(model: Any, tp: int = 1, **sections: Any) -> Endpoint:
    inference = {"tensor_parallel_size": tp, **sections.pop("inference", {})}
    data: dict[str, Any] = {
        "name": "t",
        "model": model,
        "hardware": {"profile": "h100", "device_memory_gib": 79.1, "reserve_gib": 1.0, "devices": 1},
        "parallelism": {"tp": 1},
        "placement": {"colocate_all": False},
        "inference": inference,
        **sections,
    }
    return Endpoint.model_validate(data)


def model_of(e: Endpoint) -> ModelArch:
    return resolve_model(e.model, ROOT)


def vllm_tower_bytes(cases: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Every parameter's bytes of vLLM 0.32.0's ``Qwen3_VisionTransformer`` per case (``vllm_vision_tower.py``)."""
    spec = {"port": 29500 + os.getpid() % 1000, "cases": cases}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_vision_tower.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VISION-TOWER ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("VISION-TOWER "))


def test_tower_bytes_are_vllms() -> None:
    """bf16 at TP 1 and 4 (27B's and 35B-A3B's mergers), and an FP8 checkpoint with SkyRL's ignore list at TP 4:
    the model's bytes equal the sum of what vLLM's own tower registers, module group by module group."""
    pytest.importorskip("vllm")
    settings = [
        ("qwen3.6-27b", 1, {}),
        ("qwen3.6-27b", 4, {}),
        ("qwen3.6-35b-a3b", 4, {}),
        ("qwen3.6-27b", 4, {"quantization": "fp8"}),  # the default layout: SkyRL's blockwise ignore list
    ]
    endpoints = [endpoint(m, tp, inference=inference) for m, tp, inference in settings]
    cases = []
    for e in endpoints:
        model = model_of(e)
        quant = None
        if e.inference.quantization:
            quant = {**BLOCKWISE, "ignored_layers": [n for n in default_ignored_layers(model) if "visual" in n]}
        cases.append({"vision_config": model.extra[VISION_KEY], "tp": e.inference.tensor_parallel_size,
                      "quantization_config": quant})
    measured = vllm_tower_bytes(cases)
    for e, vllm_bytes in zip(endpoints, measured, strict=True):
        assert vision_weights_bytes(e, model_of(e)) == sum(vllm_bytes.values())
    # the whole bf16 tower at TP 1 is what the trainer counts for 27B (ModelArch.vision_params, ~460 M)
    assert sum(measured[0].values()) // 2 == pytest.approx(model_of(endpoints[0]).vision_params, rel=0.002)
    # FP8: the blocks' qkv and the merger are fp8 with fp32 block scales; proj, fc1, fc2 stay bf16 (ignored)
    fp8 = measured[3]
    assert "model.visual.blocks.0.attn.qkv.weight_scale_inv" not in fp8  # vLLM's names are relative to the tower
    assert "blocks.0.attn.qkv.weight_scale_inv" in fp8 and "blocks.0.attn.proj.weight_scale_inv" not in fp8
    assert sum(measured[3].values()) < sum(measured[1].values())


def test_the_tower_sits_in_vllms_weights_and_load() -> None:
    """The KV budget's weights term and the load step's allocations both carry the tower (built first)."""
    e = endpoint("qwen3.6-27b", tp=4)
    model = model_of(e)
    text_only = endpoint("qwen3.6-27b", tp=4, inference={"language_model_only": True})
    tower = vision_weights_bytes(e, model)
    assert tower > 200 * 2**20
    assert vllm_budget.weights_bytes(e, model) == vllm_budget.weights_bytes(text_only, model) + tower
    allocations = load_allocations(e, model, 0)
    assert sum(allocations) == vllm_budget.weights_bytes(e, model)
    first = [nbytes for nbytes, _ in vision_tensors(e, model) if nbytes]
    assert list(allocations[: len(first)]) == first


def test_language_model_only_drops_the_tower_as_skyrl_requires() -> None:
    """vLLM's ``language_model_only`` builds no tower; null follows the trainer's switch; SkyRL refuses a
    language-model-only policy with a multimodal engine."""
    assert tower_built(endpoint("qwen3.6-27b"), model_of(endpoint("qwen3.6-27b"))) is not None
    e = endpoint("qwen3.6-27b", inference={"language_model_only": True})
    assert vision_weights_bytes(e, model_of(e)) == 0
    follows = endpoint("qwen3.6-27b", trainer={"language_model_only": True})
    assert follows.vllm_language_model_only and vision_weights_bytes(follows, model_of(follows)) == 0
    with pytest.raises(ValueError, match="inference.language_model_only false with trainer.language_model_only"):
        endpoint("qwen3.6-27b", trainer={"language_model_only": True}, inference={"language_model_only": False})
    # a text-only model has no tower whatever the switch says
    assert vision_weights_bytes(endpoint("qwen3-8b"), model_of(endpoint("qwen3-8b"))) == 0


def test_an_hf_config_carries_its_tower() -> None:
    """A ``config.json``'s ``vision_config`` is the tower vLLM builds; a tower without the keys vLLM reads is
    refused with the key."""
    text = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 512,
            "vocab_size": 1000}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "patch_size": 16,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 16,
              "out_hidden_size": 256, "deepstack_visual_indexes": [1]}
    arch = {"architectures": ["Qwen3VLForConditionalGeneration"]}
    model = from_hf_config({**arch, "text_config": text, "vision_config": vision}, "m")
    tower = vision_tower(model.extra)
    assert tower is not None and tower.deepstack_mergers == 1 and tower.merged_width == 256
    with pytest.raises(ValueError, match="num_heads"):
        partial = {k: v for k, v in vision.items() if k != "num_heads"}
        from_hf_config({**arch, "text_config": text, "vision_config": partial}, "m")
    # another family's tower (Qwen2.5-VL's, LLaVA's) is not Qwen3_VisionTransformer: not read, not counted
    other = from_hf_config({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "text_config": text,
                            "vision_config": vision}, "m")
    assert vision_tower(other.extra) is None


def test_the_profile_run_encodes_vllms_dummy_image_batch() -> None:
    """The dummy image batch is what vLLM's own ``compute_mm_encoder_budget`` and ``MultiModalBudget._get_max_items``
    give for the tower's largest image (16,384 tokens: 16,777,216 pixels over 32 x 32), at budgets below and above
    one image; its outputs stay in the encoder cache beside the language model's dummy run."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.multimodal.encoder_budget import MultiModalBudget
    from vllm.v1.core.encoder_cache_manager import compute_mm_encoder_budget

    for tokens in (2048, 8192, 16384, 40000):
        e = endpoint("qwen3.6-27b", tp=4, inference={"max_num_batched_tokens": tokens})
        model = model_of(e)
        per_item = vision_tower(model.extra).max_image_tokens  # type: ignore[union-attr]
        assert per_item == 16384
        scheduler = SimpleNamespace(
            max_num_batched_tokens=tokens, max_num_encoder_input_tokens=tokens, encoder_cache_size=tokens,
            disable_chunked_mm_input=False, enable_chunked_prefill=True,
        )
        compute, cache = compute_mm_encoder_budget(scheduler, {"image": per_item, "video": 12288})
        budget_self = SimpleNamespace(
            get_encoder_budget=lambda c=compute, k=cache: min(c, k), mm_limits={"image": 999},
            max_model_len=262144, scheduler_config=scheduler, max_num_reqs=e.inference.max_num_seqs,
        )
        _, items = MultiModalBudget._get_max_items(budget_self, "image", per_item)  # type: ignore[arg-type]
        assert vllm_budget.encoder_profile_items(e, model) == (items, per_item)
        assert vllm_budget.encoder_output_bytes(e, model) == items * per_item * 5120 * 2
        language = max(
            vllm_budget.forward_peak_bytes(e, model, tokens), vllm_budget.profile_sampler_bytes(e, model)
        )
        peak = vllm_budget.profile_activation_bytes(e, model)
        assert peak >= vllm_budget.encoder_output_bytes(e, model) + language
        assert peak >= vllm_budget.encoder_forward_peak_bytes(e, model) > 0
    # language-model-only: no encoder in the profile run, the language model's peak alone
    text = endpoint("qwen3.6-27b", tp=4, inference={"language_model_only": True})
    assert vllm_budget.encoder_profile_items(text, model_of(text)) == (0, 0)
    forward = vllm_budget.forward_peak_bytes(text, model_of(text), text.inference.max_num_batched_tokens)
    sampler = vllm_budget.profile_sampler_bytes(text, model_of(text))
    assert vllm_budget.profile_activation_bytes(text, model_of(text)) == max(forward, sampler)
    # the start's profile step carries the same peak and names the encoder
    from skyrl_sim_plugins.sim.service.inference.vllm_startup import profile_step

    e = endpoint("qwen3.6-27b", tp=4)
    step = profile_step(e, model_of(e))
    assert step.live + step.attempt == vllm_budget.profile_activation_bytes(e, model_of(e))
    assert "vision encoder over 1 x 16,384-token dummy image" in step.detail

"""vLLM's LoRA adapter slots on an engine worker (``sim/service/inference/lora_slots.py``), held to vLLM's own LoRA
layers, and where they sit in vLLM's start and budget.

``test_each_modules_slots_are_vllms`` builds vLLM 0.32.0's linear, embedding and logits layers on the meta device,
wraps each in the LoRA layer vLLM's model manager picks for it (``tests/vllm_lora_layers.py``, a process of its own),
calls ``create_lora_weights`` and compares the bytes of its stacked A and B buffers with the model's, module by
module: Qwen3-0.6B's attention and MLP (merged QKV, gate_up, o, down), a Qwen3.6-27B gated-DeltaNet layer
(in_proj_qkvz of four slices, in_proj_ba, conv1d, out_proj) and its gated full-attention layer, the input embedding
and the LM head's logits processor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model_shapes import QWEN3_06B
from skyrl_sim.schema.architecture import ModelArch, resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.quantization import QuantLinear
from skyrl_sim_plugins.sim.service.inference.lora_slots import (
    layer_modules,
    linear_slot_tensors,
    lora_slot_tensors,
    lora_slots,
    punica_metadata_bytes,
)
from skyrl_sim_plugins.sim.service.inference.vllm_budget import profiled_budget
from skyrl_sim_plugins.sim.service.inference.vllm_startup import vllm_start

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


def endpoint(model: Any = None, **sections: Any) -> Endpoint:
    body: dict[str, Any] = {
        "name": "slots",
        "model": model or QWEN3_06B,
        "hardware": {"profile": "l4", "devices": 1, "device_memory_gib": 22.03, "reserve_gib": 0.78},
        "trainer": {"strategy": "megatron"},
        "lora": {"merge_lora": False, "rank": 32},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return Endpoint.model_validate(body)


def vllm_module(model: ModelArch, linear: QuantLinear) -> list[Any]:
    """The vLLM layer ``tests/vllm_lora_layers.py`` builds for the module, at TP 1."""
    if linear.split == "qkv":
        heads = linear.outputs[0] // model.head_dim
        return ["qkv", [linear.inputs, model.head_dim, heads, model.num_kv_heads]]
    if linear.split == "row":
        return ["row", [linear.inputs, linear.outputs[0]]]
    if len(linear.outputs) == 1:
        return ["column", [linear.inputs, linear.outputs[0]]]
    return ["merged", [linear.inputs, list(linear.outputs)]]


def test_each_modules_slots_are_vllms() -> None:
    pytest.importorskip("vllm")
    small = resolve_model(QWEN3_06B, ROOT)
    hybrid = resolve_model("qwen3.6-27b", ROOT)
    slots, rank = 3, 32
    modules = [(small, linear) for linear in layer_modules(small, 0)]
    modules += [(hybrid, linear) for index in (0, 3) for linear in layer_modules(hybrid, index)]
    names = [f"{m.name}.{i}.{linear.name}" for i, (m, linear) in enumerate(modules)]
    spec_modules = [[name, *vllm_module(m, linear)] for name, (m, linear) in zip(names, modules, strict=True)]
    spec_modules += [["embedding", "embedding", [small.vocab_size, small.hidden_size]],
                     ["logits", "logits", [small.vocab_size, small.hidden_size]]]
    spec = {"port": 29500 + os.getpid() % 1000 + 7, "max_loras": slots, "rank": rank, "modules": spec_modules}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_lora_layers.py"), json.dumps(spec)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("LORA-LAYERS ")), None)
    assert line is not None, proc.stderr[-3000:]
    measured = json.loads(line.removeprefix("LORA-LAYERS "))
    assert {linear.name for _, linear in modules} >= {"linear_attn.conv1d", "linear_attn.in_proj_qkvz", "mlp.down_proj"}
    for name, (m, linear) in zip(names, modules, strict=True):
        assert sum(linear_slot_tensors(m, linear, 1, slots, rank, 2)) == measured[name], name
    e = endpoint(inference={"max_loras": slots})
    tensors = lora_slot_tensors(e, small)
    assert tensors[1] + tensors[2] == measured["embedding"]
    assert tensors[-2] + tensors[-1] == measured["logits"]


def test_the_slots_are_the_models_modules_times_max_loras_and_rank() -> None:
    model = resolve_model(QWEN3_06B, ROOT)
    one = lora_slots(endpoint(), model)
    four = lora_slots(endpoint(inference={"max_loras": 4}), model)
    assert four.linears == 4 * one.linears and four.embeddings == 4 * one.embeddings
    assert lora_slots(endpoint(lora={"rank": 64}), model).linears == 2 * one.linears
    # Qwen3-0.6B, one slot at rank 32, bf16: per layer A r x (3 x 1024 + 2048 + 2 x 1024 + 3072), B (4096 + 1024 +
    # 6144 + 1024) x r; the embedding's A and the LM head's B are [151936, 32] each
    per_layer = 32 * (3 * 1024 + 2048 + 2 * 1024 + 3072) + (4096 + 1024 + 6144 + 1024) * 32
    assert one.linears == 28 * per_layer * 2
    assert one.embeddings == 2 * (151936 * 32 + 1024 * 32) * 2
    assert one.metadata == punica_metadata_bytes(endpoint())
    merged = endpoint(lora={"merge_lora": True})
    assert not merged.inference.enable_lora and lora_slots(merged, model).total == 0


def test_the_slots_are_made_in_load_model_and_taken_out_of_the_kv_budget() -> None:
    model = resolve_model(QWEN3_06B, ROOT)
    served, merged = endpoint(), endpoint(lora={"merge_lora": True})
    total = int(22.03 * GIB)
    start, without = vllm_start(served, model, total), vllm_start(merged, model, total)
    names = [s.name for s in start.steps]
    assert names[:2] == ["load_weights", "lora_slots"] and "lora_slots" not in [s.name for s in without.steps]
    step = start.step("lora_slots")
    assert step is not None and step.in_budget and step.held == lora_slots(served, model).total
    assert start.weights == without.weights + step.held  # in the weights pool a sleep offloads
    budget = profiled_budget(served, model, total)
    assert budget.lora_slots_bytes == step.held
    assert budget.kv_bytes == profiled_budget(merged, model, total).kv_bytes - step.held
    assert start.kv is not None and start.kv.as_dict()["lora_slots_bytes"] == step.held
    assert without.kv is not None and "lora_slots_bytes" not in without.kv.as_dict()


def test_fully_sharded_loras_shard_the_column_a_rank_and_the_row_b_output() -> None:
    """``create_lora_weights`` with ``fully_sharded_loras`` at TP 2: a column layer's A is ``[L, 1, r/2, in]``, a row
    layer's B ``[L, 1, out/2, r]``; the rest as without."""
    model = resolve_model(QWEN3_06B, ROOT)
    qkv, o = layer_modules(model, 0)[:2]
    plain = [linear_slot_tensors(model, m, 2, 1, 32, 2) for m in (qkv, o)]
    sharded = [linear_slot_tensors(model, m, 2, 1, 32, 2, fully_sharded=True) for m in (qkv, o)]
    assert sharded[0][:3] == [a // 2 for a in plain[0][:3]] and sharded[0][3:] == plain[0][3:]
    assert sharded[1] == [plain[1][0], plain[1][1] // 2]
    tp2 = {"tensor_parallel_size": 2}
    two = {"hardware": {"devices": 2}, "parallelism": {"dp": 2}}
    both = lora_slots(endpoint(inference={**tp2, "fully_sharded_loras": True}, **two), model)
    assert both.linears < lora_slots(endpoint(inference=tp2, **two), model).linears


def test_a_vocabulary_past_vllms_lora_limit_fails_the_start_while_loading_in_vllms_words() -> None:
    """``LogitsProcessorWithLoRA.create_lora_weights`` raises "When using LoRA, vocab size must be <= 258048" inside
    ``load_model``: the start fails at its LoRA slots, after the weights; without LoRA the same model starts."""
    from skyrl_sim.plugin_host.host import PluginHost
    from skyrl_sim.reports.memory_explain import explain_table
    from skyrl_sim.schema.scenario import load_scenario

    big = {**QWEN3_06B, "vocab_size": 262144}
    model = resolve_model(big, ROOT)
    start = vllm_start(endpoint(model=big), model, int(22.03 * GIB))
    failure = start.first_failure(start.total - start.context)
    assert failure is not None and (failure.step, failure.check) == ("lora_slots", "lora_vocab")
    assert failure.message == "When using LoRA, vocab size must be <= 258048"
    merged = endpoint(model=big, lora={"merge_lora": True})
    assert vllm_start(merged, model, int(22.03 * GIB)).first_failure(start.total - start.context) is None
    assert vllm_start(endpoint(model={**big, "vocab_size": 258048}), resolve_model({**big, "vocab_size": 258048}, ROOT),
                      int(22.03 * GIB)).first_failure(start.total - start.context) is None
    l4 = load_scenario(ROOT / "scenarios" / "public" / "skyrl-pr2051-l4-vllm-start.yaml").resolve(
        "util-0.7", {"model.vocab_size": 262144}
    )
    run = PluginHost().run(l4, "sim")
    oom = run.calls[0].oom
    assert oom is not None and oom.where["check"] == "lora_vocab" and oom.where["start_step"] == "lora_slots"
    table, *_ = explain_table(run)
    assert "refused the vocabulary in its LM head's LoRA layer while loading" in str(table.title)

"""The real backend's SDPA flash core attention (``trainer.attention: flash``): the same function as megatron-core's
unfused attention, the flash kernel (not the math fallback), and the same losses through the whole worker."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from worker_setup import worker_group

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.batch import shape_to_dict
from skyrl_sim_plugins.megatron_vllm.flash_attention import SdpaFlashAttention, local_layer_spec
from skyrl_sim_plugins.megatron_vllm.workers import WorkerGroup

pytestmark = pytest.mark.real


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as megatron-core's unfused path computes it: repeated K/V, scores, masked softmax."""
    seq, rows, heads, dim = q.shape
    groups = heads // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(dim)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(seq, rows, heads * dim)


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_module_equals_the_unfused_computation_forward_and_backward_with_gqa() -> None:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0
    )
    module = SdpaFlashAttention(config, 1, AttnMaskType.causal, "self")
    torch.manual_seed(0)
    q, k, v = (torch.randn(37, 3, h, 32, requires_grad=True) for h in (4, 2, 2))
    with OpNames() as ops:
        out = module(q, k, v, None)
        out.square().sum().backward()
    assert any("_scaled_dot_product_flash_attention_for_cpu" in n for n in ops.names)  # the flash kernel, not math
    assert not any("bmm" in n or "softmax" in n for n in ops.names)  # nothing quadratic materialised
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = reference_attention(q, k, v)
    ref.square().sum().backward()
    assert out.shape == (37, 3, 128)
    assert torch.allclose(out, ref, atol=1e-5)
    for mine, theirs in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-4)


def test_local_layer_spec_swaps_only_the_core_attention() -> None:
    unfused, flash = local_layer_spec("unfused"), local_layer_spec("flash")
    a, b = unfused.submodules.self_attention.submodules, flash.submodules.self_attention.submodules
    assert b.core_attention.module is SdpaFlashAttention
    assert a.core_attention is not b.core_attention
    for field in dataclasses.fields(a):
        if field.name != "core_attention":
            assert getattr(a, field.name) == getattr(b, field.name), field.name
    assert unfused.submodules.mlp == flash.submodules.mlp


def _group(endpoint: str, run_dir: Path) -> WorkerGroup:
    return worker_group(load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", endpoint).resolve("cap-aware"), run_dir)


def test_flash_and_unfused_workers_give_the_same_losses_and_logprobs(tmp_path: Path) -> None:
    lengths = [40, 23, 57]
    results = {}
    for endpoint in ("tiny-cpu-tp1", "tiny-cpu-tp1-flash"):
        variant = load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", endpoint).resolve("cap-aware")
        shape = shape_call("forward_backward", lengths, variant.endpoint, MEGATRON)
        with _group(endpoint, tmp_path / endpoint) as group:
            reply = group.command(
                {"cmd": "forward_backward", "model_id": "m", "shape": shape_to_dict(shape), "datums": lengths}
            )[0]
        assert reply["ok"], reply.get("traceback")
        results[endpoint] = reply
    unfused, flash = results["tiny-cpu-tp1"], results["tiny-cpu-tp1-flash"]
    assert flash["num_tokens"] == unfused["num_tokens"] == sum(lengths)
    assert flash["total_loss"] == pytest.approx(unfused["total_loss"], rel=1e-5)
    for row in range(3):
        a, b = unfused["rows"][str(row)]["logprobs"], flash["rows"][str(row)]["logprobs"]
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)

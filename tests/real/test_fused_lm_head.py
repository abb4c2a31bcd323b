"""The real backend's fused LM-head log-prob (``trainer.fused_lm_head_logprob: true``) and 16-bit LoRA adapters
(``lora.dtype: bf16``): the same function and gradients as the unfused head, never the full logits, and the same
training through the whole worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from worker_setup import worker_group

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.adapter_optimizer import AdapterOptimizer
from skyrl_sim_plugins.megatron_vllm.batch import shape_to_dict
from skyrl_sim_plugins.megatron_vllm.fused_lm_head import FusedLinearLogprob, recover_left_padding
from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter
from skyrl_sim_plugins.sim.reference.memory_graph import nbytes
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, fused_lm_head_workspaces

pytestmark = pytest.mark.real


class LargestOutput(TorchDispatchMode):
    """The element count of the largest tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_fused_op_equals_log_softmax_of_the_full_logits_with_gradients(weight_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rows, width, hidden_size, vocab, chunk = 3, 50, 16, 40, 16  # four chunks, the last one short
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=weight_dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, width))
    grad = torch.randn(rows, width)
    with LargestOutput() as seen:
        out = FusedLinearLogprob.apply(hidden, weight, targets, 0, chunk, None)
        (out * grad).sum().backward()
    assert seen.largest < rows * width * vocab  # the full logits never exist
    assert seen.largest == rows * width * hidden_size  # the hidden states' gradient is the largest tensor
    fused_hidden, fused_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = torch.log_softmax((hidden.to(weight_dtype) @ weight.t()).float(), -1).gather(-1, targets[..., None])
    (reference.squeeze(-1) * grad).sum().backward()
    assert torch.allclose(out, reference.squeeze(-1), atol=1e-5)
    assert torch.allclose(fused_hidden, hidden.grad, atol=1e-5)
    tolerance = 1e-4 if weight_dtype == torch.float32 else 0.02  # bf16 products, summed in a different order
    assert torch.allclose(fused_weight.float(), weight.grad.float(), rtol=tolerance, atol=tolerance)


def _dims(rows: int, hidden_size: int, chunk: int, act: str) -> Dims:
    """The walk's micro-batch dimensions for one fused-head call (only what the head's workspaces read is set)."""
    return Dims(
        rows=rows,
        seq=0,
        logits_width=0,
        tp=1,
        sp=False,
        act=act,
        hidden=hidden_size,
        lora_rank=8,
        lora_targets=frozenset(),
        layer_spec="local",
        attention="flash",
        fused_swiglu=False,
        train_base=False,
        fp32_output=True,
        fused_lm_head=True,
        chunk=chunk,
        logprob_kernel="vocab_parallel_cross_entropy",
        vl_clone=False,
        cuda=False,
    )


@pytest.mark.parametrize(
    ("rows", "width", "act"),
    [(1, 186, torch.float32), (16, 201, torch.float32), (1, 300, torch.bfloat16), (16, 201, torch.bfloat16)],
)
def test_fused_op_holds_what_the_walks_workspaces_say(rows: int, width: int, act: torch.dtype) -> None:
    """The op's measured high-water mark (forward and backward, beside its inputs) against the walk's forward and
    backward workspaces plus the hidden states' gradient: within 1% (the rest is [b, W] index and log-prob tensors)."""
    hidden_size, vocab, chunk = 128, 1536, 64
    torch.manual_seed(0)
    hidden = torch.randn(rows, width, hidden_size, requires_grad=True)  # fp32: Float16Module's upcast
    weight = torch.randn(vocab, hidden_size, dtype=act) * 0.05
    targets = torch.randint(0, vocab, (rows, width))
    grad = torch.ones(rows, width)
    meter = LiveTensorMeter([hidden, weight, targets, grad])
    with meter:
        out = FusedLinearLogprob.apply(hidden, weight, targets, 0, chunk, None)
        out.backward(grad)
        del out
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[act]
    temps, extras = fused_lm_head_workspaces(_dims(rows, hidden_size, chunk, name), vocab, width, "fp32")
    walk = max(sum(nbytes(s, d) for _, s, d in temps), sum(nbytes(s, d) for _, s, d in extras) + hidden.grad.nbytes)
    assert walk == pytest.approx(meter.high, rel=0.01)


def test_recover_left_padding_puts_real_positions_at_the_right_and_routes_their_gradient_back() -> None:
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3).requires_grad_(True)
    y = recover_left_padding(x, [3, 5], 7)
    assert y.shape == (2, 7, 3)
    assert torch.equal(y[0, 4:], x[0, :3]) and torch.equal(y[1, 2:], x[1]) and not y[0, :4].any()
    y.sum().backward()
    assert x.grad[0, :3].eq(1).all() and x.grad[0, 3:].eq(0).all() and x.grad[1].eq(1).all()


def test_bf16_adapters_keep_fp32_main_grads_master_weights_and_moments() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    state = AdapterOptimizer([param])
    assert state.mixed and param.grad is None
    (param.float() * torch.tensor([3.0, 5.0])).sum().backward()
    (param.float() * torch.tensor([1.0, 1.0])).sum().backward()
    assert param.grad is None  # the hook moved it into the fp32 main gradient
    assert state.grads[0].dtype == torch.float32 and state.grads[0].tolist() == [4.0, 6.0]
    held = state.held_tensors()
    assert [t.numel() for t in held if t.dtype == torch.float32] == [2, 2, 1, 2, 2]  # main grad, master, Adam's fields
    state.step(0.1)
    assert param.dtype == torch.bfloat16 and torch.allclose(param.float(), state.masters[0].to(torch.bfloat16).float())
    assert param.tolist()[0] < 1.0 and state.grads[0].eq(0).all()


# ---------------------------------------------------------------- through the workers (tiny-cpu-tp1, one rank)

LENGTHS = [40, 23, 57]
SETTINGS: dict[str, dict[str, Any]] = {
    "unfused": {},
    "fused": {"trainer.fused_lm_head_logprob": True, "trainer.logprobs_chunk_size": 16},
}


def _variant(sets: dict[str, Any]):
    return load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", "tiny-cpu-tp1").resolve("cap-aware", sets)


def _train_once(sets: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """forward_backward, one Adam step, then a forward: the second log-probs carry the first call's gradients."""
    variant = _variant(sets)
    replies = {}
    with worker_group(variant, run_dir) as group:
        for kind in ("forward_backward", "optim_step", "forward"):
            if kind == "optim_step":
                message: dict[str, Any] = {"cmd": kind, "model_id": "m", "learning_rate": 1e-2}
            else:
                shape = shape_to_dict(shape_call(kind, LENGTHS, variant.endpoint, MEGATRON))
                message = {"cmd": kind, "model_id": "m", "shape": shape, "datums": LENGTHS}
            reply = group.command(message)[0]
            assert reply["ok"], reply.get("traceback") or reply.get("error")
            replies[kind] = reply
    return replies


def test_fused_head_trains_like_the_unfused_head(tmp_path: Path) -> None:
    """Same losses and log-probs; after one Adam step on each, the same log-probs again: the adapters' gradients
    through the fused head equal those through megatron's cross-entropy over the full logits."""
    runs = {name: _train_once(sets, tmp_path / name) for name, sets in SETTINGS.items()}
    unfused, fused = runs["unfused"], runs["fused"]
    first, after = unfused["forward_backward"], unfused["forward"]
    assert fused["forward_backward"]["num_tokens"] == first["num_tokens"] == sum(LENGTHS)
    assert fused["forward_backward"]["total_loss"] == pytest.approx(first["total_loss"], rel=1e-5)
    assert after["total_loss"] < first["total_loss"] - 1.0  # the step moved the model
    assert fused["forward"]["total_loss"] == pytest.approx(after["total_loss"], rel=1e-5)
    for row in range(len(LENGTHS)):
        a, b = after["rows"][str(row)]["logprobs"], fused["forward"]["rows"][str(row)]["logprobs"]
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)

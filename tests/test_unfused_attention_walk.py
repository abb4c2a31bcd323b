"""Megatron-core's unfused attention on a 16-bit model, as the walk models it: the softmax runs in fp32 on a copy of
the scores, keeps its fp32 output and a 16-bit cast for the context product, and PyTorch's CUDA softmax backward
materialises ``grad * output`` before its kernel (the CPU kernel does not)."""

from __future__ import annotations

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.reference.allocator import round_allocated
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, layer_graph


def _variant(**sets: object):
    scenario = load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", "tiny-cpu-tp1-bf16")
    return scenario.resolve("cap-aware", {"memory_limit_gib": 20, **sets})


def test_softmax_in_fp32_keeps_its_fp32_output_and_the_16_bit_cast():
    variant = _variant()
    d = Dims.of(variant.endpoint, variant.model, rows=1, seq=512, logits_width=0)
    g = layer_graph(d, variant.model, "full_attention", moe=False)
    saved = g.saved_storages(grad=True, selective=False)
    name = "self_attention.core_attention."
    assert g.tensors[name + "softmax"].dtype == "fp32" and name + "softmax" in saved
    assert g.tensors[name + "softmax_output_cast"].dtype == "bf16" and name + "softmax_output_cast" in saved
    assert g.tensors[name + "softmax_input_fp32"].dtype == "fp32" and name + "softmax_input_fp32" not in saved
    fp32 = Dims.of(
        variant.endpoint.model_copy(
            update={"trainer": variant.endpoint.trainer.model_copy(update={"params_dtype": "fp32"})}
        ),
        variant.model,
        rows=1,
        seq=512,
        logits_width=0,
    )
    tensors = layer_graph(fp32, variant.model, "full_attention", moe=False).tensors
    assert name + "softmax_input_fp32" not in tensors and name + "softmax_output_cast" not in tensors


def test_cuda_softmax_backward_holds_one_more_fp32_score_matrix_than_the_cpu_kernel():
    # A long row on a small model: the peak is the attention's softmax backward on both devices.
    rows, length = 1, 2047
    cpu, gpu = _variant(), _variant(**{"hardware.profile": "h200", "hardware.reserve_gib": 0})
    peaks = []
    for variant in (cpu, gpu):
        shape = shape_call("forward_backward", [length] * rows, variant.endpoint, MEGATRON)
        peaks.append(AllocationWalk().evaluate(shape, variant.endpoint, variant.model).peak_bytes)
    heads = cpu.model.num_attention_heads
    scores_fp32 = round_allocated(rows * heads * (length + 1) ** 2 * 4)
    # the CUDA walk also rounds every request to 512-byte blocks (the CPU allocator sizes each exactly): the few
    # tensors below a block's multiple at the peak add less than a block each
    assert 0 <= peaks[1] - peaks[0] - scores_fp32 < 16 * 512

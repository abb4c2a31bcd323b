"""The memory walk of the local spec's SDPA flash attention (``trainer.attention: flash``), per device."""

from __future__ import annotations

import pytest

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, layer_graph, microbatch_inputs

TINY = PRESETS["tiny-dense"]  # 4 heads of 32, 2 KV heads


def flash_endpoint(profile: str, attention: str = "flash", tp: int = 1) -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": "tiny-dense",
            "hardware": {"profile": profile, "device_memory_gib": 64, "reserve_gib": 0, "devices": tp},
            "parallelism": {"tp": tp, "sequence_parallel": False},
            "trainer": {
                "layer_spec": "local",
                "attention": attention,
                "recompute": {"granularity": "none"},
                "remove_microbatch_padding": False,
                "micro_train_batch_size_per_gpu": 16,
                "params_dtype": "fp32" if profile == "cpu" else "bf16",
            },
        }
    )


def core_ops(endpoint: Endpoint, rows: int = 2, seq: int = 100) -> dict[str, object]:
    d = Dims.of(endpoint, TINY, rows=rows, seq=seq, logits_width=0)
    g = layer_graph(d, TINY, "full_attention", moe=False)
    return {op.name: op for op in g.ops if "core_attention" in op.name or "repeat" in op.name}, g


def test_cpu_flash_keeps_output_and_logsumexp_and_no_kernel_workspace() -> None:
    ops, g = core_ops(flash_endpoint("cpu"), rows=2, seq=100)
    assert set(ops) == {"self_attention.core_attention.logsumexp", "self_attention.core_attention.sdpa_flash"}
    lse, flash = g.tensors["self_attention.core_attention.logsumexp"], g.tensors["self_attention.core_attention.sdpa_flash"]
    assert (lse.shape, lse.dtype) == ((2, 4, 100), "fp32")
    assert (flash.shape, flash.dtype) == ((100, 2, 4 * 32), "fp32")
    op = ops["self_attention.core_attention.sdpa_flash"]
    assert "self_attention.core_attention.logsumexp" in op.saves and op.out in op.saves
    assert op.backward_extra == ()  # the CPU kernel's scratch is per-thread blocks, not tensors
    # enable_gqa: K and V enter at their own 2 heads (their gradients too: the walk sizes a gradient like its tensor)
    assert g.tensors[op.inputs[1]].shape == (100, 2, 2 * 32)


def test_cuda_flash_backward_adds_flash_attention_2_workspaces() -> None:
    ops, _ = core_ops(flash_endpoint("h200"), rows=2, seq=100)
    extra = {name: (shape, dtype) for name, shape, dtype in ops["self_attention.core_attention.sdpa_flash"].backward_extra}
    assert extra == {
        "dq_accum": ((2, 128, 4, 32), "fp32"),  # seq rounded up to 128, head dim to 32
        "softmax_d": ((2, 4, 128), "fp32"),
        "dk_expanded": ((2, 100, 4, 32), "bf16"),  # GQA: every query head before the per-group sum
        "dv_expanded": ((2, 100, 4, 32), "bf16"),
    }


def test_flash_passes_no_mask_but_keeps_the_local_specs_rotary_table() -> None:
    for attention, mask in (("flash", False), ("unfused", True)):
        d = Dims.of(flash_endpoint("cpu", attention), TINY, rows=2, seq=64, logits_width=0)
        names = {name for name, _, _ in microbatch_inputs(d, TINY)}
        assert ("attention_mask" in names) == mask
        assert "rotary_table" in names


def _peak(endpoint: Endpoint, length: int) -> int:
    shape = shape_call("forward_backward", [length] * 4, endpoint, MEGATRON)
    return AllocationWalk().evaluate(shape, endpoint, TINY).peak_bytes


@pytest.mark.parametrize("profile", ["cpu", "h200"])
def test_flash_peak_grows_linearly_in_length_and_unfused_quadratically(profile: str) -> None:
    flash, unfused = flash_endpoint(profile), flash_endpoint(profile, "unfused")
    base = _peak(flash_endpoint(profile), 64)  # the static part (weights, adapters, optimizer) is the same for both
    grow_flash = (_peak(flash, 4096) - base) / (_peak(flash, 2048) - base)
    grow_unfused = (_peak(unfused, 4096) - base) / (_peak(unfused, 2048) - base)
    assert grow_flash < 2.2
    assert grow_unfused > 3.0

"""The walk on a gated-DeltaNet hybrid: the kernel's tensors come from the layer description, and megatron's
persistent scores buffer grows where the first full-attention layer asks for it, not before the DeltaNet layers that
precede it (the real backend's out-of-memory in ``validation/tiny-hybrid-cpu`` is there)."""

from __future__ import annotations

from pathlib import Path

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.bound.memory import default_memory_model
from skyrl_sim_plugins.sim.description.layer_ops import gated_deltanet

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "queue_drain_17_tiny_hybrid.yaml"


def test_the_kernel_keeps_the_cumulative_gates_and_a_and_makes_a_state_per_chunk() -> None:
    variant = load_scenario(SCENARIO).resolve("cap-aware")
    kernel = gated_deltanet(variant.model).kernel_tensors(rows=2, seq=130, tp=1, act="fp32")
    assert dict((n, s) for n, s, _ in kernel.kept) == {"gate_cumsum": (2, 130, 4), "chunk_a": (2, 130, 4, 64)}
    assert ("h", (2, 3, 4, 32, 32), "fp32") in kernel.forward  # ceil(130 / 64) chunk states
    assert {"dh", "dv2", "dw", "dk2"} <= {n for n, _, _ in kernel.backward}


def test_the_scores_buffer_grows_at_the_first_full_attention_layer() -> None:
    variant = load_scenario(SCENARIO).resolve("no-cap")
    lengths = [1750] + [200] * 15
    shape = shape_call("forward_backward", lengths, variant.endpoint, MEGATRON)
    report = default_memory_model().walk(shape, variant.endpoint, variant.model)
    assert report.oom is not None and report.oom.where["layer"] == 3
    assert report.oom.where["op"] == "self_attention.core_attention.scores"
    rows = report.timeline
    buffer = next(i for i, row in enumerate(rows) if row["layer"] == "global_memory_buffer")
    assert [row["layer"] for row in rows[:buffer] if row["phase"] == "forward"][-3:] == [0, 1, 2]


def test_a_fitting_call_that_grows_the_buffer_is_walked_as_the_step_by_step_walk() -> None:
    variant = load_scenario(SCENARIO).resolve("cap-aware")
    shape = shape_call("forward_backward", [600], variant.endpoint, MEGATRON)
    fitted = default_memory_model().evaluate(shape, variant.endpoint, variant.model)
    walked = default_memory_model().walk(shape, variant.endpoint, variant.model)
    assert fitted.peak_bytes == walked.peak_bytes and fitted.oom is None

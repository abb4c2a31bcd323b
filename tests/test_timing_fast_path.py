"""The time model's fast path (``MicroBatchProgram`` and the tuple call costs) equals the op-by-op reference
(``TimeReference.microbatch``, ``TimeReference.call``) bit for bit, on shapes and endpoints that exercise every branch:
packed and padded micro-batches, CP, PP, DP with token budgets, MoE, fused and materialised LM heads, unfused
attention, selective and block recompute, TP 1 to 8 with and without sequence parallel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import ModelArch, resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.bound.timing import BoundRoofline, RooflineTimeModel
from skyrl_sim_plugins.sim.fast.time_program import PART_FIELDS, PARTS, MicroBatchProgram, coefficient_bits
from skyrl_sim_plugins.sim.reference.time_model import RL_KIND, microbatch_variables

# name: (model, parallelism, profile, trainer settings)
ENDPOINTS: dict[str, tuple[str | dict[str, Any], dict[str, Any], str, dict[str, Any]]] = {
    "27b tp4 padded fused head": ("qwen3.6-27b", {"tp": 4}, "h200", {"fused_lm_head_logprob": True}),
    "27b tp4 packed selective": (
        "qwen3.6-27b",
        {"tp": 4},
        "h200",
        {"remove_microbatch_padding": True, "recompute": {"granularity": "selective"}},
    ),
    "8b tp8 no sequence parallel, no recompute": (
        "qwen3-8b",
        {"tp": 8, "sequence_parallel": False},
        "h100",
        {"recompute": {"granularity": "none"}},
    ),
    "moe tp2 ep2 block recompute": (
        "qwen3.6-35b-a3b",
        {"tp": 2, "ep": 2},
        "h200",
        {"recompute": {"granularity": "full", "method": "block", "num_layers": 3}},
    ),
    "tiny tp1 packed unfused attention": (
        "tiny-dense",
        {"tp": 1},
        "cpu",
        {"remove_microbatch_padding": True, "attention": "unfused"},
    ),
    "tiny-moe dp2 pp2 token budget": (
        "tiny-moe",
        {"tp": 1, "dp": 2, "pp": 2},
        "cpu",
        {"remove_microbatch_padding": True, "max_tokens_per_microbatch": 700},
    ),
    "mid cp2 dp2": ("mid-dense", {"tp": 2, "cp": 2, "dp": 2}, "h200", {}),
    "seed-shard cp3 (fractions: the reference)": ("seed-shard", {"tp": 2, "cp": 3}, "h200", {}),
    "seed-shard pp4 padded": ("seed-shard", {"tp": 1, "pp": 4}, "h200", {"fused_lm_head_logprob": True}),
    "vocabulary TP does not divide": (
        {"preset": "tiny-dense", "vocab_size": 513},
        {"tp": 2},
        "cpu",
        {"remove_microbatch_padding": True},
    ),
}
LENGTHS = ([7], [1, 2, 3], [499, 37, 1200, 64, 65], [4095] * 5, [35_003, 10_000], [1] * 17)


def endpoint(name: str) -> tuple[Endpoint, ModelArch]:
    model, parallelism, profile, trainer = ENDPOINTS[name]
    devices = parallelism.get("tp", 1) * parallelism.get("pp", 1) * parallelism.get("cp", 1) * parallelism.get("dp", 1)
    ep = Endpoint.model_validate(
        {
            "model": model,
            "hardware": {"profile": profile, "devices": devices},
            "parallelism": parallelism,
            "trainer": {"micro_train_batch_size_per_gpu": 4, "micro_forward_batch_size_per_gpu": 2, **trainer},
            "engine": {"cap_aware_padding": True},
        }
    )
    return ep, resolve_model(ep.model, Path("."))


def call(kind: str, lengths: list[int], ep: Endpoint) -> Any:
    """A call of ``kind`` (``RL_KIND``: a forward_backward with an RL loss, SkyRL's RL path)."""
    if kind == RL_KIND:
        return shape_call("forward_backward", lengths, ep, MEGATRON, "ppo")
    return shape_call(kind, lengths, ep, MEGATRON)


def bits(fields: tuple[float | int, ...]) -> tuple[str | int, ...]:
    """Every float as its exact hex form: equal bits, not just equal values (0.0 and -0.0 differ here)."""
    return tuple(v.hex() if isinstance(v, float) else v for v in fields)


@pytest.mark.parametrize("name", ENDPOINTS)
def test_call_costs_equal_the_reference_bit_for_bit(name: str) -> None:
    ep, model = endpoint(name)
    bound = RooflineTimeModel().bind(ep, model)
    for kind in ("forward_backward", "forward", RL_KIND):
        for lengths in LENGTHS:
            shape = call(kind, lengths, ep)
            assert bits(bound.call_fields(shape)) == bits(bound.reference.call(shape).fields()), (kind, lengths)
            for mb in shape.microbatches:
                tokens, pairs = microbatch_variables(mb, ep.parallelism.tp)
                logits = float(mb.rows * shape.logits_width) if shape.logits_width and not mb.packed else tokens
                fast = bound.microbatch_fields(kind, tokens, pairs, logits)
                assert bits(fast) == bits(bound.reference.microbatch(kind, tokens, pairs, logits).fields())


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(ENDPOINTS)),
    kind=st.sampled_from(["forward_backward", "forward", RL_KIND]),
    lengths=st.lists(st.integers(min_value=1, max_value=40_000), min_size=1, max_size=9),
)
def test_any_call_costs_the_same_as_the_reference(name: str, kind: str, lengths: list[int]) -> None:
    ep, model = endpoint(name)
    bound = RooflineTimeModel().bind(ep, model)
    shape = call(kind, lengths, ep)
    assert bits(bound.call_fields(shape)) == bits(bound.reference.call(shape).fields())
    seconds = bound.reference.call(shape).seconds(bound.profile.time_coefficients)
    assert RooflineTimeModel().call_seconds(shape, ep, model).hex() == seconds.hex()


@pytest.mark.parametrize("name", ENDPOINTS)
def test_a_tile_of_widths_costs_each_lane_as_the_reference(name: str) -> None:
    """``padded_fields`` reads a lane of a tile evaluated at once; every lane it answers (of many tiles, every
    logits width less than TP below, first tiles that start at TP) equals the reference bit for bit, it answers on
    the padded endpoints (so the test cannot pass by never using tiles), and it leaves other logits widths (a
    call's later micro-batches) to the single evaluation."""
    ep, model = endpoint(name)
    bound = RooflineTimeModel().bind(ep, model)
    tp = ep.parallelism.tp
    answered = 0
    for kind in ("forward_backward", "forward", RL_KIND):
        for rows, width, distance in [
            (1, tp, 0),
            (2, 37 * tp, tp - 1),
            (3, 130 * tp, 1 % tp),
            (1, 4096, 0),
            (4, 8192, 5000),
            (16, 35_004 - 35_004 % tp, tp // 2),
            (2, 900 * tp, -3),
        ]:
            logits_width = width - distance
            fast = bound.padded_fields(kind, rows, width, logits_width)
            if fast is None:
                continue
            answered += 1
            tokens, pairs = float(rows * width), rows * width**2 * 0.5
            reference = bound.reference.microbatch(kind, tokens, pairs, float(rows * logits_width)).fields()
            assert bits(fast) == bits(reference), (kind, rows, width, logits_width)
    padded_whole_model = ep.parallelism.cp == 1 and "vocabulary" not in name
    assert answered > 0 or not padded_whole_model
    assert bound.padded_fields("forward_backward", 2, 900 * tp, 900 * tp + 3) is None  # a later micro-batch's
    huge = (2**24 // tp - 200) * tp  # 65,536 rows of about 2^24 tokens: rows x width^2 would wrap in int64
    fast = bound.padded_fields("forward_backward", 65_536, huge, huge)
    reference = bound.microbatch_fields("forward_backward", 65_536.0 * huge, 65_536 * huge**2 * 0.5, 65_536.0 * huge)
    assert fast is None or bits(fast) == bits(reference)
    assert bound.padded_fields("forward_backward", 2, 900 * tp, 900 * tp - tp) is None


def test_a_width_tile_is_evaluated_once_for_its_lanes() -> None:
    ep, model = endpoint("27b tp4 padded fused head")
    bound = RooflineTimeModel().bind(ep, model)
    for width in range(4, 4 * 128, 4):
        for distance in range(4):
            assert bound.padded_fields("forward_backward", 3, width, width - distance) is not None
    assert len(bound._width_tiles) == 1  # every width below 128 x TP and every near logits width: one tile


def program(name: str, backward: bool = True) -> tuple[BoundRoofline, MicroBatchProgram]:
    ep, model = endpoint(name)
    bound = RooflineTimeModel().bind(ep, model)
    return bound, bound.microbatch_program("forward_backward" if backward else "forward")


def test_the_program_is_exact_only_on_halves_of_integers_below_its_bound() -> None:
    _, fast = program("27b tp4 padded fused head")
    assert fast.exact(4096.0, 4096.0**2 / 2, 4096.0)
    assert fast.exact(3.0, 4.5, 3.0)  # pairs are halves of integers (CAUSAL_FRACTION)
    assert not fast.exact(1000 / 3, 0.0, 1000.0)  # context parallel 3 splits 1000 tokens into thirds
    assert not fast.exact(2.25, 0.0, 2.0)
    assert not fast.exact(-2.0, 0.0, 0.0)
    assert not fast.exact(4096.0, 2.0**60, 4096.0)  # a row would pass 2^51: its sums could round


def test_a_head_with_fractional_constants_is_never_taken_from_the_program() -> None:
    bound, fast = program("vocabulary TP does not divide")
    assert not fast.exact(64.0, 2048.0, 64.0)  # 513 / 2 vocabulary rows per rank: the head's products round
    fields = bound.microbatch_fields("forward_backward", 64.0, 2048.0, 64.0)
    assert bits(fields) == bits(bound.reference.microbatch("forward_backward", 64.0, 2048.0, 64.0).fields())


def test_a_forward_has_no_head_backward_rows() -> None:
    width = len(PART_FIELDS)
    _, forward = program("27b tp4 packed selective", backward=False)
    _, forward_backward = program("27b tp4 packed selective", backward=True)
    assert {PARTS[int(b) // width] for b in forward.bins} == {"layers", "head_forward", "embedding"}
    assert {PARTS[int(b) // width] for b in forward_backward.bins} == set(PARTS)


def test_coefficient_bits() -> None:
    import numpy as np

    assert coefficient_bits(np.array([[0.0, 3.0, 15360.0]])) == 0
    assert coefficient_bits(np.array([[2.5, 0.75]])) == 2
    assert coefficient_bits(np.array([[1 / 3]])) is None
    assert coefficient_bits(np.array([[-1.0]])) is None

"""The lane evaluation of the memory walk (``memory_lanes``) gives the step-by-step walk's exact integers.

Every shape of a tile is evaluated at once with ``Lanes`` sizes; each lane's effect, applied to the allocator, and the
timeline made from its lane must equal the compiled step-by-step walk (``AllocationWalk.walk``) of that shape alone,
on dense, hybrid (gated DeltaNet) and MoE models, unfused and flash attention, packed micro-batches, every recompute
setting, the local and TransformerEngine specs, the CE and fused LM heads, with and without re-expansion.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.plugin_host.costs import CarriedMemory
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.fast.memory_lanes import Diverged, Lanes, LaneStats
from skyrl_sim_plugins.sim.reference.allocator import (
    NEVER,
    AllocatorState,
    Effect,
    Step,
    StepArray,
    round_allocated,
    round_reserved,
)


def endpoint(model: str, tp: int = 1, **trainer: Any) -> Endpoint:
    version = trainer.pop("skyrl_version", "0.4.0")
    return Endpoint.model_validate(
        {
            "skyrl_version": version,
            "model": model,
            "hardware": {
                "profile": trainer.pop("profile", "cpu"),
                "device_memory_gib": 4096,
                "reserve_gib": 0,
                "devices": tp,
            },
            "parallelism": {"tp": tp, "sequence_parallel": tp > 1},
            "trainer": {"micro_train_batch_size_per_gpu": 4, **trainer},
            "engine": {"cap_aware_padding": True},
        }
    )


CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "dense-local-unfused": ("tiny-dense", 1, {"layer_spec": "local"}),
    "dense-local-flash-cuda": ("tiny-dense", 2, {"layer_spec": "local", "attention": "flash", "profile": "h100"}),
    "dense-te-selective": ("tiny-dense", 2, {"recompute": {"granularity": "selective"}}),
    "dense-no-recompute-ce-head": (
        "tiny-dense",
        1,
        {
            "recompute": {"granularity": "none"},
            "fused_lm_head_logprob": False,
            "logprob_kernel": "vocab_parallel_cross_entropy",
        },
    ),
    "dense-unfused-chunked-head": ("tiny-wide", 2, {"fused_lm_head_logprob": False, "logprobs_chunk_size": 64}),
    "dense-packed": ("tiny-dense", 2, {"remove_microbatch_padding": True, "max_tokens_per_microbatch": 700}),
    "moe-replay": ("tiny-moe", 1, {"recompute": {"granularity": "none"}, "routed_expert_replay": "compact"}),
    "hybrid-seed": ("qwen3.6-27b", 4, {"language_model_only": True, "params_dtype": "bf16"}),
    "hybrid-fp32-unfused": ("qwen3.6-27b", 4, {"layer_spec": "local", "fp32_output": False}),
    # SkyRL revisions and the RL path (``memory_logprob``): the seed's list + concatenation, 0.4.0's buffer, the
    # unchunked log-prob of a short call, the entropy (chunked by memory, unchunked, fused), the Triton fused head.
    "dense-chunked-head-pr1874": (
        "tiny-wide",
        2,
        {"fused_lm_head_logprob": False, "logprobs_chunk_size": 64, "skyrl_version": "pr1874"},
    ),
    "dense-rl-chunked-entropy": (
        "tiny-wide",
        2,
        {"fused_lm_head_logprob": False, "logprobs_chunk_size": 64, "vocab_entropy_chunk_memory_mb": 1, "_loss": "ppo"},
    ),
    "dense-rl-pr1874": (
        "tiny-wide",
        2,
        {"fused_lm_head_logprob": False, "logprobs_chunk_size": 512, "skyrl_version": "pr1874", "_loss": "ppo"},
    ),
    "dense-rl-bf16-logits": (
        "tiny-wide",
        1,
        {"fused_lm_head_logprob": False, "fp32_output": False, "logprobs_chunk_size": 256, "_loss": "cispo"},
    ),
    "hybrid-rl-fused": ("qwen3.6-27b", 4, {"language_model_only": True, "_loss": "importance_sampling"}),
    "hybrid-triton-rl": (
        "qwen3.6-27b",
        4,
        {"language_model_only": True, "fused_lm_head_logprob_backend": "triton", "_loss": "ppo"},
    ),
    "dense-token-batching-dummy-rows": (
        "tiny-dense",
        2,
        {"remove_microbatch_padding": False, "max_tokens_per_microbatch": 900, "micro_train_batch_size_per_gpu": 8},
    ),
}


def walked(report: Any) -> tuple[Any, ...]:
    return (report.peak_bytes, report.breakdown, report.progress, report.oom, report.carried, report.resolve_timeline())


@pytest.mark.parametrize("case", sorted(CASES))
def test_lanes_equal_the_step_by_step_walk_on_random_calls(case: str) -> None:
    model_name, tp, trainer = CASES[case]
    trainer = dict(trainer)
    loss = trainer.pop("_loss", "cross_entropy")
    ep, model = endpoint(model_name, tp, **trainer), PRESETS[model_name]
    rng = random.Random(case)
    lanes, steps = AllocationWalk(), AllocationWalk()
    carried = CarriedMemory()
    for _ in range(12):
        lengths = [rng.randint(1, 1500) for _ in range(rng.randint(1, 9))]
        shape = shape_call("forward_backward", lengths, ep, MEGATRON, loss)
        fast = lanes.evaluate(shape, ep, model, carried)
        slow = steps.walk(shape, ep, model, carried)
        assert walked(fast) == walked(slow), (case, lengths)
        carried = slow.carried
    bound = lanes.bind(ep, model)
    effects = bound.rl_effects if loss != "cross_entropy" else bound.effects
    assert effects.tiles > 0 and effects.single_lanes == 0  # evaluated in tiles, never one plain lane at a time


def test_a_call_that_does_not_fit_is_walked_step_by_step() -> None:
    ep = endpoint("tiny-dense", 1, layer_spec="local")
    ep.hardware.device_memory_gib = 0.05
    model = PRESETS["tiny-dense"]
    shape = shape_call("forward_backward", [1500] * 4, ep, MEGATRON)
    fast, slow = AllocationWalk().evaluate(shape, ep, model), AllocationWalk().walk(shape, ep, model)
    assert fast.oom is not None and walked(fast) == walked(slow)


def test_lanes_refuse_a_decision_they_do_not_share() -> None:
    lanes = Lanes.of(np.array([3, 5, 5, 0]))
    with pytest.raises(Diverged) as split:
        bool(lanes)
    assert [g.tolist() for g in split.value.groups] == [[3], [0, 1, 2]]  # by truth value
    with pytest.raises(Diverged) as split:
        range(lanes[:3])
    assert [g.tolist() for g in split.value.groups] == [[0], [1, 2]]  # by value
    assert bool(lanes[:3] > 1) and int(lanes[1:3]) == 5 and list(range(lanes[1:3])) == list(range(5))
    assert min(2, lanes[1:3]) == 2  # an agreed decision goes through


def random_array(rng: random.Random) -> StepArray:
    steps = []
    for _ in range(rng.randint(0, 8)):
        size = rng.choice([512, 1024, 4 << 20, 3 << 21])
        steps.append(Step("t", rng.choice([1, -1]) * size, rng.choice([1, -1]) * size, rng.randint(0, 4), "op", (), "bf16"))
    return StepArray.compile(steps)


def test_effects_compose_like_running_the_programs_one_after_the_other() -> None:
    rng = random.Random(7)
    for _ in range(300):
        arrays = [random_array(rng) for _ in range(rng.randint(1, 5))]
        effect = Effect.of(arrays[0])
        for array in arrays[1:]:
            effect = effect.then(array)
        one_by_one, at_once = AllocatorState(capacity=2**40), AllocatorState(capacity=2**40)
        for state in (one_by_one, at_once):
            state.hold(1 << 20, "weights")
        for array in arrays:
            assert one_by_one.run(array) is None
        at_once.apply(effect)
        assert vars(at_once) == vars(one_by_one)
        worst = max((p.reserved_to_fit for p in arrays), default=NEVER)
        assert (effect.reserved_to_fit == NEVER) == (worst == NEVER)


@pytest.mark.parametrize("case", ["dense-unfused-chunked-head", "dense-local-flash-cuda"])
def test_one_tile_answers_every_logits_distance_of_its_widths(case: str) -> None:
    """A single micro-batch's logits width (its longest row) lies less than TP below its width: the first call of a
    tile evaluates every such distance (``MicroBatchEffects.lanes_with``), and each lane equals the walk. The lengths
    cross the LM head's chunk (64 positions), where the lanes split into groups."""
    model_name, tp, trainer = CASES[case]
    ep = endpoint(model_name, tp, **dict(trainer), remove_microbatch_padding=False)  # logits re-expanded
    model = PRESETS[model_name]
    lanes, steps = AllocationWalk(), AllocationWalk()
    effects = lanes.bind(ep, model).effects
    for length in range(56, 76):
        shape = shape_call("forward_backward", [length], ep, MEGATRON)
        assert shape.logits_width and 0 <= shape.microbatches[0].width - shape.logits_width < tp
        assert walked(lanes.evaluate(shape, ep, model)) == walked(steps.walk(shape, ep, model)), (case, length)
        if length == 56:
            evaluated = effects.tiles
    assert effects.tiles == evaluated  # the later lengths (other distances, same tile) were all answered already


def lane_arrays(rng: random.Random, lanes: int) -> list[StepArray]:
    """One step array per lane with the same steps (sign and category) and sizes that differ by lane, as a tile's lanes
    have: some start with a free, some only free, some are empty."""
    signs = [rng.choice([1, -1]) for _ in range(rng.randint(0, 9))]
    categories = [rng.randint(0, 4) for _ in signs]
    arrays = []
    for _ in range(lanes):
        steps = []
        for sign, category in zip(signs, categories, strict=True):
            size = rng.choice([100, 512, 3000, 1 << 20, (1 << 20) + 1, 5 << 20])
            steps.append(Step("t", sign * round_allocated(size), sign * round_reserved(size), category, "op", (), "bf16"))
        arrays.append(StepArray.compile(steps))
    return arrays


def test_lane_totals_equal_each_lanes_program() -> None:
    """``LaneStats.of_steps`` (every lane at once) gives each lane's ``StepArray`` totals, and ``LaneStats.sequence``
    the step arrays run back to back (``Effect.then``)."""
    rng = random.Random(11)
    for _ in range(200):
        distinct = [lane_arrays(rng, 5) for _ in range(rng.randint(1, 3))]
        stats = []
        for arrays in distinct:
            allocated = np.array([p.allocated for p in arrays]).reshape(5, -1)
            reserved = np.array([p.reserved for p in arrays]).reshape(5, -1)
            lane_stats = LaneStats.of_steps(allocated, reserved, arrays[0].category)
            for lane, array in enumerate(arrays):
                assert lane_effect(lane_stats, lane) == Effect.of(array)
                assert int(lane_stats.peak_step[lane]) == array.peak_index
            stats.append(lane_stats)
        index = np.array([rng.randrange(len(distinct)) for _ in range(rng.randint(1, 6))], dtype=np.int64)
        together = LaneStats.sequence(stats, index)
        for lane in range(5):
            effect = Effect.of(distinct[index[0]][lane])
            for i in index[1:].tolist():
                effect = effect.then(distinct[i][lane])
            assert lane_effect(together, lane) == effect



def lane_effect(stats: LaneStats, lane: int) -> Effect:
    scalars = (stats.end_allocated, stats.end_reserved, stats.peak_allocated, stats.peak_reserved, stats.reserved_to_fit)
    at_peak, at_end = stats.categories_at_peak[:, lane].tolist(), stats.end_categories[:, lane].tolist()
    return Effect(*(int(a[lane]) for a in scalars), tuple(at_peak), tuple(at_end))

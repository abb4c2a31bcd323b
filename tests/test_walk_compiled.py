"""The compiled allocation walk gives exactly what a step-by-step walk gives.

The walk's speed comes from three shortcuts, each checked here against the plain rule it replaces:

* a graph's step plan (which tensor is allocated or freed when) is compiled once per topology and reused for every
  micro-batch shape: reused plans must size each step exactly as a fresh liveness analysis of that shape does;
* a step array's totals (peak, its step, per-category bytes, end) are numpy reductions: they must equal a running
  total kept step by step, and the vectorised block rounding must equal the scalar rule;
* a micro-batch's step arrays are applied as one vectorised sequence: the allocator must end in the same state, with
  the same high-water marks and the same failing step array, as when they run one by one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.endpoint_files import load_endpoint
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk, PlanCache
from skyrl_sim_plugins.sim.description.moe_routes import moe_layer_dims
from skyrl_sim_plugins.sim.reference.allocator import (
    CATEGORIES,
    AllocatorState,
    Step,
    StepArray,
    StepArraySequence,
    round_allocated,
    round_allocated_array,
    round_reserved,
    round_reserved_array,
)
from skyrl_sim_plugins.sim.reference.memory_graph import backward_recipe, forward_recipe
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, head_graph, layer_graph

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "scenarios" / "queue_drain_17.yaml"
OUT = "mlp.residual_add"


def seed_endpoint(**trainer: object) -> Endpoint:
    data, _ = load_endpoint("qwen3.6-27b-h200-tp4", SEED)
    data = dict(data)
    data["trainer"] = {**data["trainer"], **trainer}
    return Endpoint.model_validate(data)


def tiny_moe_endpoint() -> Endpoint:
    return Endpoint.model_validate(
        {
            "model": "tiny-moe",
            "hardware": {"profile": "cpu", "device_memory_gib": 4, "reserve_gib": 0, "devices": 1},
            "parallelism": {"tp": 1, "sequence_parallel": False},
            "trainer": {"recompute": {"granularity": "none"}},
        }
    )


def step_tuple(step: Step) -> tuple[object, ...]:
    return (step.key, step.nbytes, step.reserved, step.category, step.op, tuple(step.shape), step.dtype)


LAYER_RECIPES = {
    "forward without grad": (forward_recipe(grad=False, keep=(OUT,)),),
    "recompute + backward": (
        forward_recipe(grad=True, keep=(OUT,)),
        backward_recipe(OUT, keep_forward=(OUT,), free_after=("in", OUT), grad_input="in"),
    ),
    "selective forward": (forward_recipe(grad=True, keep=(OUT,), selective=True),),
    "selective backward": (backward_recipe(OUT, keep_forward=(OUT,), free_after=("in",), grad_input="in", selective=True),),
}


@pytest.mark.parametrize("layer_spec", ["transformer_engine", "local"])
@pytest.mark.parametrize("kind", ["full_attention", "linear_attention"])
@pytest.mark.parametrize("recipe", list(LAYER_RECIPES))
def test_a_plan_compiled_on_one_shape_sizes_another_as_a_fresh_analysis(layer_spec: str, kind: str, recipe: str) -> None:
    """Qwen3.6-27B layers (TP 4, sequence parallel); the local spec keeps the quadratic attention scores."""
    endpoint = seed_endpoint(layer_spec=layer_spec)
    model = PRESETS["qwen3.6-27b"]
    recipes = LAYER_RECIPES[recipe]
    first = layer_graph(Dims.of(endpoint, model, 16, 35001, 35001), model, kind, False)
    plans = PlanCache()
    plan = plans.compile(first, recipes)
    for rows, seq in ((1, 513), (3, 4097), (16, 1)):
        graph = layer_graph(Dims.of(endpoint, model, rows, seq, seq), model, kind, False)
        assert plans.compile(graph, recipes) is plan  # same topology: the plan is reused
        fresh = [step for r in recipes for step in graph.steps(graph.plan(r))]
        reused = plan.sized(graph).steps
        assert [step_tuple(s) for s in reused] == [step_tuple(s) for s in fresh]
        if layer_spec == "local" and kind == "full_attention":
            heads = model.num_attention_heads // 4  # per TP rank
            assert any(s.nbytes > 0 and tuple(s.shape) == (rows * heads, seq, seq) for s in reused)  # quadratic


def test_an_moe_layer_plan_reused_across_token_counts() -> None:
    endpoint, model = tiny_moe_endpoint(), PRESETS["tiny-moe"]
    recipes = LAYER_RECIPES["recompute + backward"]
    plans = PlanCache()
    plan = None
    for rows, seq in ((2, 50), (1, 333), (4, 64)):
        d = Dims.of(endpoint, model, rows, seq, 0)
        graph = layer_graph(d, model, "full_attention", True, moe_layer_dims(rows * seq, endpoint, model))
        plan = plan or plans.compile(graph, recipes)
        assert plans.compile(graph, recipes) is plan
        fresh = [step for r in recipes for step in graph.steps(graph.plan(r))]
        assert [step_tuple(s) for s in plan.sized(graph).steps] == [step_tuple(s) for s in fresh]


def test_graphs_of_another_topology_get_their_own_plan() -> None:
    """The LM head re-expands logits to the global width only when the call has one: another topology."""
    endpoint, model = seed_endpoint(), PRESETS["qwen3.6-27b"]
    recipes = (forward_recipe(grad=True, keep=("fused_lm_head_logprob",)),)
    plans = PlanCache()
    expanded = head_graph(Dims.of(endpoint, model, 2, 100, 200), model)
    plain = head_graph(Dims.of(endpoint, model, 2, 100, 0), model)
    assert expanded.topology() != plain.topology()
    assert plans.compile(expanded, recipes) is not plans.compile(plain, recipes)
    ops = {s.op for s in plans.compile(expanded, recipes).sized(expanded).steps}
    assert "recover_left_padding" in ops and "recover_left_padding" not in {s.op for s in plain.forward_steps(True, ())}


def test_plan_cache_is_bounded() -> None:
    endpoint, model = seed_endpoint(), PRESETS["qwen3.6-27b"]
    plans = PlanCache(max_entries=2)
    graph = layer_graph(Dims.of(endpoint, model, 1, 64, 64), model, "full_attention", False)
    for recipe in LAYER_RECIPES.values():
        plans.compile(graph, recipe)
    assert 0 < len(plans._plans) <= 2


sizes = st.integers(min_value=0, max_value=2**42)


@settings(max_examples=200, deadline=None)
@given(st.lists(sizes, min_size=1, max_size=50))
def test_vectorised_rounding_is_the_scalar_rule(values: list[int]) -> None:
    array = np.array(values, dtype=np.int64)
    assert round_allocated_array(array).tolist() == [round_allocated(v) for v in values]
    assert round_reserved_array(array).tolist() == [round_reserved(v) for v in values]


step_lists = st.lists(
    st.tuples(st.sampled_from([1, -1]), sizes, st.integers(min_value=0, max_value=len(CATEGORIES) - 1)),
    max_size=40,
)


def make_array(entries: list[tuple[int, int, int]]) -> StepArray:
    steps = [
        Step(f"t{i}", sign * round_allocated(size), sign * round_reserved(size), cat, f"op{i}", (size,), "bf16")
        for i, (sign, size, cat) in enumerate(entries)
    ]
    return StepArray.compile(steps, work=float(len(steps)))


@settings(max_examples=200, deadline=None)
@given(step_lists)
def test_program_totals_equal_a_running_total(entries: list[tuple[int, int, int]]) -> None:
    array = make_array(entries)
    allocated = reserved = 0
    best, best_index, top_reserved = 0, -1, 0
    cats = [0] * len(CATEGORIES)
    best_cats = tuple(cats)
    for index, step in enumerate(array.steps):
        allocated += step.nbytes
        reserved += step.reserved
        cats[step.category] += step.nbytes
        if allocated > best:
            best, best_index, best_cats = allocated, index, tuple(cats)
        top_reserved = max(top_reserved, reserved)
    assert (array.peak_allocated, array.peak_index, array.peak_reserved) == (best, best_index, top_reserved)
    assert array.categories_at_peak == best_cats
    assert (array.end_allocated, array.end_reserved, array.end_categories) == (allocated, reserved, tuple(cats))
    assert array.peak_op == (
        (array.steps[best_index].op, array.steps[best_index].nbytes) if best_index >= 0 else ("", 0)
    )


def state_of(state: AllocatorState) -> tuple[object, ...]:
    return (
        state.allocated,
        state.reserved,
        list(state.categories),
        state.peak_allocated,
        state.peak_reserved,
        tuple(state.peak_categories),
    )


@settings(max_examples=150, deadline=None)
@given(
    st.lists(step_lists, min_size=1, max_size=6),
    st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=30),
    st.integers(min_value=0, max_value=2**44),
)
def test_a_sequence_applied_at_once_equals_running_each_program(
    distinct: list[list[tuple[int, int, int]]], order: list[int], capacity: int
) -> None:
    arrays = [make_array(entries) for entries in distinct]
    index = [i % len(arrays) for i in order]
    one_by_one, at_once = AllocatorState(capacity=capacity), AllocatorState(capacity=capacity)
    for state in (one_by_one, at_once):
        state.hold(2**20, "weights")
    failed_at, failure = len(index), None
    for position, i in enumerate(index):
        failure = one_by_one.run(arrays[i])
        if failure is not None:
            failed_at = position
            break
    sequence = StepArraySequence(arrays, np.array(index, dtype=np.int64))
    applied, bases = at_once.run_sequence(sequence)
    assert applied == failed_at
    assert bases[0] == round_allocated(2**20)  # the held block
    if applied < len(index):
        again = at_once.run(arrays[index[applied]])
        assert again is not None and failure is not None
        assert (again.index, again.allocated_before, again.reserved_before) == (
            failure.index,
            failure.allocated_before,
            failure.reserved_before,
        )
    assert state_of(at_once) == state_of(one_by_one)


def test_a_warm_walk_reports_what_a_cold_walk_reports() -> None:
    """Reusing compiled step arrays and plans across calls changes nothing: each call's report equals a fresh walk's."""
    endpoint, model = seed_endpoint(), PRESETS["qwen3.6-27b"]
    warm = AllocationWalk(max_cache=3)
    for lengths in ([35000] * 16, [500], [9000, 12000, 700], [35000], [500], [9000, 12000, 700]):
        for cap_aware in (False, True):
            ep = endpoint.model_copy(deep=True)
            ep.engine.cap_aware_padding = cap_aware
            shape = shape_call("forward_backward", lengths, ep, MEGATRON)
            got, expected = warm.evaluate(shape, ep, model), AllocationWalk().evaluate(shape, ep, model)
            assert (got.peak_bytes, got.breakdown, got.progress, got.timeline) == (
                expected.peak_bytes,
                expected.breakdown,
                expected.progress,
                expected.timeline,
            )
            assert got.oom == expected.oom
    assert len(warm._segments) <= 3  # the compiled segments of at most three shapes are kept

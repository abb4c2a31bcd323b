"""The simulator's vLLM model: KV sizing, the step price (its compiled program held to the op-by-op reference, its
closed forms), the block pool, and the engine: the rule (``reference.vllm_scheduler.VllmEngine``) and the fast engine
held to it (``fast.vllm_cohorts.CohortEngine``: cohorts, closed-form decode runs, block phases) on random cases.
(``tests/real/test_vllm_scheduler_oracle.py`` holds the engine to vLLM's own scheduler.)"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_sim.errors import UserError
from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.fast.vllm_cohorts import CohortEngine
from skyrl_sim_plugins.sim.fast.vllm_step_program import StepProgram, sum_of_max
from skyrl_sim_plugins.sim.reference.kv_blocks import BlockPool, Owner
from skyrl_sim_plugins.sim.reference.vllm_scheduler import EngineSettings, PromptGroup, Seq, VllmEngine
from skyrl_sim_plugins.sim.reference.vllm_step_cost import StepReference, step_weights
from skyrl_sim_plugins.sim.service.inference.kv_cache import KvCacheRefused, bytes_per_block, kv_cache_size

sys.path.insert(0, str(Path(__file__).parent))
import vllm_oracle  # noqa: E402

TINY = {"preset": "tiny-dense"}


def endpoint(**inference: object) -> Endpoint:
    """The tiny endpoint with these vLLM settings, on as many devices as its colocated engine shards (SkyRL asserts
    they match)."""
    devices = int(inference.get("num_engines", 1)) * int(inference.get("tensor_parallel_size", 1))  # type: ignore[call-overload]
    return Endpoint.model_validate(
        {
            "name": "t",
            "model": TINY,
            "hardware": {"profile": "cpu", "device_memory_gib": 24.0, "reserve_gib": 0.5, "devices": devices},
            "parallelism": {"tp": 1, "dp": devices},
            "inference": inference,
        }
    )


def test_explicit_kv_space_gives_vllms_block_count_on_cpu() -> None:
    """VLLM_CPU_KVCACHE_SPACE=1 (kv_cache_memory_bytes 1 GiB), CPU block size 128: blocks = bytes // block bytes,
    a block being K and V of every layer for 128 tokens at the model dtype."""
    e = endpoint(kv_cache_memory_bytes=2**30, model_dtype="float32")
    model = resolve_model(e.model, Path("."))
    per_block = 2 * 128 * model.num_kv_heads * model.head_dim * 4 * model.num_layers
    assert bytes_per_block(e, model) == per_block
    size = kv_cache_size(e, model)
    assert (size.block_size, size.num_blocks, size.usable_blocks) == (128, 2**30 // per_block, 2**30 // per_block - 1)
    assert size.source == "kv_cache_memory_bytes"


def test_block_override_and_tensor_parallel_kv_heads() -> None:
    # max_model_len 128: 11 blocks of 16 tokens cannot hold one request of the model's context (vLLM refuses to start)
    e = endpoint(kv_cache_memory_bytes=2**30, num_gpu_blocks_override=12, block_size=16, max_model_len=128)
    model = resolve_model(e.model, Path("."))
    size = kv_cache_size(e, model)
    assert (size.num_blocks, size.usable_blocks, size.source) == (12, 11, "num_gpu_blocks_override")
    wide = endpoint(kv_cache_memory_bytes=2**30, tensor_parallel_size=2 * model.num_kv_heads)
    # more ranks than KV heads: vLLM replicates them, one head per rank
    assert bytes_per_block(wide, model) == bytes_per_block(endpoint(kv_cache_memory_bytes=2**30), model) // (
        model.num_kv_heads
    )


def test_profiled_kv_bytes_are_the_budget_less_what_is_not_kv_cache() -> None:
    e = endpoint(gpu_memory_utilization=0.5)
    model = resolve_model(e.model, Path("."))
    size = kv_cache_size(e, model)
    assert size.source == "profiled"
    assert size.budget_bytes == int(0.5 * 24 * 2**30)
    rest = size.weights_bytes + size.buffers_bytes + size.activation_bytes + size.cuda_graph_bytes + size.process_bytes
    assert size.kv_cache_bytes == size.budget_bytes - rest
    assert size.cuda_graph_bytes == 0  # CPU: no CUDA graphs
    with pytest.raises(KvCacheRefused, match="No available memory for the cache blocks") as nothing_left:
        kv_cache_size(endpoint(gpu_memory_utilization=0.01), model)  # vLLM's words when its profile leaves nothing
    assert nothing_left.value.needed_bytes == 2 * bytes_per_block(e, model) and nothing_left.value.available_bytes == 0
    with pytest.raises(KvCacheRefused, match="KV cache would hold 0 blocks"):
        kv_cache_size(endpoint(num_gpu_blocks_override=1), model)
    assert isinstance(nothing_left.value, UserError)  # a refusal is still a user-facing error where it is raised


@settings(max_examples=300, deadline=None)
@given(
    st.floats(-1e3, 1e3), st.floats(-10, 10), st.floats(-1e3, 1e3), st.floats(-10, 10), st.integers(0, 400)
)
def test_sum_of_max_is_the_sum_of_its_maxima(p1: float, q1: float, p2: float, q2: float, n: int) -> None:
    brute = sum(max(p1 + q1 * j, p2 + q2 * j) for j in range(n))
    assert sum_of_max(p1, q1, p2, q2, n) == pytest.approx(brute, rel=1e-9, abs=1e-6)


STEP_ENDPOINTS = [
    {"model": {"preset": "qwen3-8b"}, "hardware": {"profile": "h200", "devices": 1}},
    {"model": {"preset": "qwen3-8b"}, "hardware": {"profile": "cpu", "devices": 1}},
    {
        "model": {"preset": "qwen3-8b"},
        "hardware": {"profile": "h200", "devices": 4},
        "parallelism": {"tp": 4},
        "inference": {"tensor_parallel_size": 2, "num_engines": 2, "enable_lora": True},
        "lora": {"merge_lora": False},
    },
]


@pytest.mark.parametrize("document", STEP_ENDPOINTS, ids=["h200", "cpu", "tp2-lora"])
@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 4096),
    st.integers(0, 256),
    st.integers(0, 200_000),
    st.integers(1, 64),
)
def test_the_step_program_prices_a_step_as_the_reference_does(
    document: dict[str, object], prefill: int, seqs: int, context: int, extra_rows: int
) -> None:
    """The compiled step program (``StepPrices.seconds``) equals the step's ops listed at its variables and priced
    one by one (``StepReference``), for prefill, decode and mixed steps, with TP all-reduces and adapters."""
    e = Endpoint.model_validate({"name": "t", **document})
    model = resolve_model(e.model, Path("."))
    weights = step_weights(e)
    prices = StepProgram.build(e, model).bind(weights)
    reference = StepReference(e, model)
    context = context if seqs else 0
    pairs = prefill * (prefill + 1) / 2
    variables = (float(prefill + seqs), float(prefill), pairs, float(seqs), float(context), float(seqs + extra_rows))
    assert prices.seconds(*variables) == pytest.approx(reference.seconds(weights, *variables), rel=1e-9)


def test_a_decode_run_is_its_steps_priced_one_by_one() -> None:
    """The closed form of a run of decode steps equals each step priced at its own variables (the KV context
    growing by one token per sequence a step), for a memory-bound and a compute-bound profile."""
    for profile in ("cpu", "h200"):
        e = Endpoint.model_validate(
            {"name": "t", "model": {"preset": "qwen3-8b"}, "hardware": {"profile": profile, "devices": 1}}
        )
        model = resolve_model(e.model, Path("."))
        prices = StepProgram.build(e, model).bind(step_weights(e))
        seqs, context = 37, 37 * 900
        run = prices.decode(seqs, float(context))
        steps = [prices.seconds(seqs, 0, 0, seqs, context + seqs * j, seqs) for j in range(300)]
        assert run.elapsed(300) == pytest.approx(sum(steps), rel=1e-9)
        assert run.step(123) == pytest.approx(steps[123], rel=1e-9)


def test_prefill_is_compute_bound_and_decode_reads_weights_and_kv() -> None:
    """A long prefill step costs about its FLOPs at the matmul rate; a decode step of one sequence about the
    weights streamed once, and more KV context costs more."""
    e = Endpoint.model_validate(
        {"name": "t", "model": {"preset": "qwen3-8b"}, "hardware": {"profile": "h200", "devices": 1}}
    )
    model = resolve_model(e.model, Path("."))
    prices = StepProgram.build(e, model).bind(step_weights(e))
    from skyrl_sim.schema.hardware import load_profile

    profile = load_profile("h200")
    params = model.parameter_count()
    prefill = prices.seconds(8192, 8192, 8192 * 8193 / 2, 0, 0, 1)
    assert prefill >= 2 * params * 8192 / profile.flops_matmul
    decode = prices.seconds(1, 0, 0, 1, 1000, 1)
    assert decode >= 2 * params / profile.bytes_memory  # bf16 weights read once
    assert prices.seconds(1, 0, 0, 1, 100_000, 1) > decode


def test_the_block_pool_reuses_the_oldest_free_blocks_and_evicts_their_cache() -> None:
    pool = BlockPool(10)
    a, b = Owner(), Owner()
    pool.take(6)
    a.cached = 3
    pool.give(a, 3)  # freed first: reused first
    b.cached = 2
    pool.give(b, 2)
    assert pool.free == 9
    pool.take(5)  # the 4 never-used blocks, then one of a's
    assert (a.cached, b.cached, pool.free) == (2, 2, 4)
    assert pool.touch(b) == 2 and pool.free == 2 and b.run is None
    pool.take(2)
    assert (a.cached, pool.free) == (0, 0)


ENGINES = [VllmEngine, CohortEngine]
"""The rule and the engine a run uses: every behaviour below holds for both."""
Engine = VllmEngine | CohortEngine


def engine_for(case: vllm_oracle.Case, kind: type[Engine] = CohortEngine) -> Engine:
    settings = EngineSettings(
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        block_size=case.block_size,
        usable_blocks=case.num_blocks - 1,
        enable_prefix_caching=case.prefix_caching,
        enable_chunked_prefill=case.chunked_prefill,
        max_loras=None,
    )
    return kind(0, settings, vllm_oracle.UnitSteps())


@pytest.mark.parametrize("seed", range(60))
def test_the_fast_engine_takes_the_steps_of_the_rule(seed: int) -> None:
    """Cohorts, closed-form decode runs and block phases give every sequence the steps the reference engine, one
    step at a time, gives, on random cases with preemption."""
    case = vllm_oracle.random_case(seed)
    assert vllm_oracle.run_model(case) == vllm_oracle.run_model(case, fast=False)


@pytest.mark.parametrize("seed", range(30))
def test_the_fast_engine_takes_the_steps_of_the_rule_with_a_hybrids_state_blocks(seed: int) -> None:
    """A hybrid's state blocks (one or three per sequence, taken at admission, freed on leaving or preemption): the
    fast engine still takes the reference's steps, with and without prefix caching."""
    import dataclasses

    case = dataclasses.replace(vllm_oracle.random_case(seed), state_groups=1 + seed % 3)
    case.num_blocks += 4 * case.state_groups
    assert vllm_oracle.run_model(case) == vllm_oracle.run_model(case, fast=False)


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_engine_holds_to_the_rule_with_adapters_and_prompt_logprobs(seed: int) -> None:
    """Random cases with several tenants' adapters under ``max_loras``, prompt log-probs, chunked prefill on or off,
    and arrivals during decode runs: both engines give every sequence the same schedule, first token, finish and
    preemptions, and the same counters."""
    rng = random.Random(seed)
    case = vllm_oracle.random_case(seed)
    chunked = rng.random() < 0.7
    max_loras = rng.choice([None, 1, 2])
    settings = EngineSettings(
        case.max_num_seqs, max(case.max_num_batched_tokens, 96), case.block_size, case.num_blocks - 1,
        case.prefix_caching, chunked, max_loras,
    )
    plan = []
    for index, request in enumerate(case.requests):
        lora = rng.choice(["a", "b", "c"]) if max_loras is not None else None
        plan.append((index, request, lora, rng.random() < 0.2))

    def drive(kind: type[Engine]) -> tuple[list[tuple[object, ...]], tuple[int, ...]]:
        engine = kind(0, settings, vllm_oracle.UnitSteps())
        seqs: list[Seq] = []
        at = 0.0
        for index, request, lora, scores in plan:
            at = max(at, float(request.arrival) + 0.5 * (index % 2))  # some arrive inside a step
            group = PromptGroup(request.prompt, case.block_size)
            batch = [
                Seq(len(seqs) + k, index, group, request.prompt, request.max_tokens, lora, float(request.arrival), scores)
                for k in range(request.samples)
            ]
            seqs += batch
            engine.arrive(batch, at)
        engine.advance(math.inf)
        stats = engine.stats
        counters = (stats.preemptions, stats.steps, stats.prompt_tokens, stats.generation_tokens, stats.prefix_hit_tokens)
        return [(s.scheduled_s, s.first_token_s, s.finished_s, s.preemptions, s.output) for s in seqs], counters

    assert drive(CohortEngine) == drive(VllmEngine)


@pytest.mark.parametrize("kind", ENGINES, ids=lambda k: k.__name__)
@pytest.mark.parametrize("seed", range(40))
def test_every_sequence_finishes_once_and_every_block_comes_back(seed: int, kind: type[Engine]) -> None:
    case = vllm_oracle.random_case(seed)
    engine = engine_for(case, kind)
    seqs = []
    for index, request in enumerate(case.requests):
        group = PromptGroup(request.prompt, case.block_size)
        batch = [
            Seq(len(seqs) + k, index, group, request.prompt, request.max_tokens, None, 0.0) for k in range(request.samples)
        ]
        seqs += batch
        engine.arrive(batch, float(request.arrival))
    engine.advance(math.inf)
    assert sorted(s.index for s in engine.finished) == [s.index for s in seqs]
    assert all(s.output == s.max_tokens and s.finished_s is not None for s in seqs)
    assert engine.pool.free == engine.pool.total  # cached blocks are free blocks
    assert not engine.busy() and engine.running_count() == 0
    assert engine.stats.generation_tokens == sum(s.max_tokens for s in seqs)


def test_preemption_starts_when_blocks_run_out_and_not_before() -> None:
    """Four long generations in a cache that holds two of them: vLLM recomputes; with room for all, nothing is
    preempted."""
    requests = [vllm_oracle.Request(0, 20, 200, 1) for _ in range(4)]
    tight = vllm_oracle.run_model(vllm_oracle.Case(requests, block_size=16, num_blocks=30))
    roomy = vllm_oracle.run_model(vllm_oracle.Case(requests, block_size=16, num_blocks=80))
    assert sum(t[3] for t in tight.values()) > 0
    assert sum(t[3] for t in roomy.values()) == 0
    assert max(t[2] for t in tight.values()) > max(t[2] for t in roomy.values())  # type: ignore[type-var]


@pytest.mark.parametrize("kind", ENGINES, ids=lambda k: k.__name__)
def test_samples_of_one_prompt_share_its_blocks(kind: type[Engine]) -> None:
    """Four samples of a 100-token prompt in one step: the first computes it, the other three hit its 6 full blocks
    and compute 4 tokens each (a hit never covers the last token's block)."""
    case = vllm_oracle.Case([vllm_oracle.Request(0, 100, 1, 4)], max_num_batched_tokens=256, num_blocks=100)
    engine = engine_for(case, kind)
    group = PromptGroup(100, 16)
    engine.arrive([Seq(k, 0, group, 100, 1, None, 0.0) for k in range(4)], 0.0)
    engine.advance(math.inf)
    assert engine.stats.prompt_tokens == 100 + 3 * 4
    assert engine.stats.prefix_hit_tokens == 3 * 96
    no_cache = vllm_oracle.Case([vllm_oracle.Request(0, 100, 1, 4)], max_num_batched_tokens=512, prefix_caching=False)
    plain = engine_for(no_cache, kind)
    plain.arrive([Seq(k, 0, PromptGroup(100, 16), 100, 1, None, 0.0) for k in range(4)], 0.0)
    plain.advance(math.inf)
    assert plain.stats.prompt_tokens == 400


def test_random_cases_cover_preemption() -> None:
    """The random cases the engine is checked on include preemptions (so the checks above test something)."""
    total = sum(t[3] for seed in range(40) for t in vllm_oracle.run_model(vllm_oracle.random_case(seed)).values())
    assert total > 20


@pytest.mark.parametrize("kind", ENGINES, ids=lambda k: k.__name__)
def test_max_loras_keeps_a_second_adapter_waiting_until_the_first_leaves(kind: type[Engine]) -> None:
    """vLLM skips a waiting sequence whose adapter would exceed max_loras in the step (it keeps its place): with one
    slot, adapter b's samples start only when adapter a's have finished; with two, together."""

    def run(max_loras: int) -> dict[str, float]:
        settings = EngineSettings(8, 256, 16, 200, True, True, max_loras)
        engine = kind(0, settings, vllm_oracle.UnitSteps())
        seqs = [Seq(i, i, PromptGroup(20, 16), 20, 10, lora, 0.0) for i, lora in enumerate(["a", "a", "b", "b"])]
        engine.arrive(seqs, 0.0)
        engine.advance(math.inf)
        return {f"{s.lora}{s.index}": s.scheduled_s for s in seqs}  # type: ignore[misc]

    one, two = run(1), run(2)
    assert one["a0"] == one["a1"] == 0.0 and one["b2"] == one["b3"] == 10.0  # a finishes at step 10
    assert set(two.values()) == {0.0}

"""The simulator memoises memory walks by ``walk_key``: calls with equal keys must get equal reports from the walk.

If the walk starts reading something of a shape that ``walk_key`` leaves out, a group of shapes with one key gets
different reports here, and the key must grow."""

from __future__ import annotations

import random

import pytest

from project_paths import SCENARIOS
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import BatchCall
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.plugin_host.costs import CarriedMemory
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.sim.backend import SimExecutor, priced_beyond_walk, walk_key
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.bound.timing import call_key, default_time_model

SEED17 = SCENARIOS / "queue_drain_17.yaml"
SETTINGS = {
    "bshd, cap-aware": {"engine.cap_aware_padding": True},
    "bshd, padded to micro": {"engine.cap_aware_padding": False, "trainer.micro_train_batch_size_per_gpu": 4},
    "thd, token budget": {"trainer.remove_microbatch_padding": True, "trainer.max_tokens_per_microbatch": 16384},
    "out of memory": {"engine.cap_aware_padding": False, "hardware.device_memory_gib": 40},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_shapes_with_one_walk_key_get_one_report(name):
    variant = load_scenario(SEED17).resolve("cap-aware", SETTINGS[name])
    rng = random.Random(17)
    groups: dict[tuple, list] = {}
    for _ in range(400):
        rows = rng.randint(1, 6)
        top = rng.choice([1024, 2048, 4096, 8192])
        lengths = [rng.randint(top // 2, top) for _ in range(rows)]
        lengths[rng.randrange(rows)] = top  # many calls share the longest row, so keys repeat
        shape = shape_call("forward_backward", lengths, variant.endpoint, MEGATRON)
        groups.setdefault(walk_key(shape), []).append(shape)
    shared = [g for g in groups.values() if len(g) > 1 and len({s.row_tokens for s in g}) > 1]
    assert len(shared) >= 3, "the test should compare shapes that differ in their rows but share a key"
    walk = AllocationWalk()
    failed = 0
    for group in shared:
        first = walk.evaluate(group[0], variant.endpoint, variant.model)
        failed += first.oom is not None
        for other in group[1:]:
            assert walk.evaluate(other, variant.endpoint, variant.model) == first
    assert (failed > 0) == (name == "out of memory")


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_walk_key_and_what_is_priced_beyond_it_determine_the_call_key(name):
    """The executor keeps a call's seconds with its walk (``SimExecutor.call_costs``) by the walk key and
    ``priced_beyond_walk``: shapes with one such key must have one ``timing.call_key`` (what the time model reads), or
    a call would be answered with another's duration."""
    variant = load_scenario(SEED17).resolve("cap-aware", SETTINGS[name])
    rng = random.Random(43)
    groups: dict[tuple, set] = {}
    kinds = ["forward_backward", "forward"]
    for _ in range(600):
        rows = rng.randint(1, 6)
        top = rng.choice([1024, 2048, 4096])
        lengths = [rng.randint(top // 2, top) for _ in range(rows)]
        lengths[rng.randrange(rows)] = top
        loss = rng.choice(["cross_entropy", "ppo"])
        shape = shape_call(rng.choice(kinds), lengths, variant.endpoint, MEGATRON, loss)
        groups.setdefault(walk_key(shape) + priced_beyond_walk(shape), set()).add(call_key(shape))
    assert len(groups) < 600, "the test should compare shapes that share a key"
    assert all(len(g) == 1 for g in groups.values())


def test_a_call_answered_from_the_cost_cache_costs_what_it_cost_when_walked():
    """The second call of a shape is answered from ``call_costs``' cache: the same duration, peak and record."""
    variant = load_scenario(SEED17).resolve("cap-aware")
    executor = SimExecutor(variant.endpoint, variant.model, AllocationWalk(), default_time_model())
    request = Request(id=1, type="forward_backward", model_id="m", datums=(1000, 4000))
    shape = shape_call("forward_backward", [1000, 4000], variant.endpoint, MEGATRON)
    first = executor.batch(BatchCall("forward_backward", "m", (request,)), shape)
    second = executor.batch(BatchCall("forward_backward", "m", (request,)), shape)
    assert executor.costs_by_key
    assert (second.duration_s, second.peak_bytes) == (first.duration_s, first.peak_bytes)
    assert second.duration_s == executor.time.call_seconds(shape)
    assert second.memory == first.memory  # both within the calls that keep their timelines


class CountingWalk:
    """A memory model that counts the calls its bound model answers."""

    def __init__(self) -> None:
        self.walk = AllocationWalk()
        self.calls = 0

    def bind(self, endpoint, model):
        bound = self.walk.bind(endpoint, model)
        counting = self

        class Counting:
            def evaluate(self, shape, carried=None, device=None):
                counting.calls += 1
                return bound.evaluate(shape, carried, device)

        return Counting()


def test_the_executor_walks_each_key_once_and_the_carried_state_is_part_of_the_key():
    variant = load_scenario(SEED17).resolve("cap-aware")
    counting = CountingWalk()
    executor = SimExecutor(variant.endpoint, variant.model, counting, default_time_model())

    def call(lengths: tuple[int, ...]):
        request = Request(id=1, type="forward_backward", model_id="m", datums=lengths)
        shape = shape_call("forward_backward", list(lengths), variant.endpoint, MEGATRON)
        return executor.batch(BatchCall("forward_backward", "m", (request,)), shape)

    a, b = call((1000, 4000)), call((3000, 4000))
    assert counting.calls == 1 and a.peak_bytes == b.peak_bytes
    call((1000, 5000))
    assert counting.calls == 2
    executor.carried = CarriedMemory((((0, "scores buffer"), 1 << 30),))  # another state the workers carry
    call((1000, 4000))
    assert counting.calls == 3

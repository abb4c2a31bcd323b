"""Routed-expert replay (R3) on the real backend: megatron-core's RouterReplay fed with SkyRL's rules (route_replay.py).

The models run in this process (one rank, gloo), so a test can build a model with a router setting the endpoints do
not expose (the expert bias) and read megatron's router state directly. Each test builds its own model: megatron's
replay instances are process-wide, and building a model empties them.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from project_paths import SCENARIOS
from skyrl_sim.engine.recorded_routes import synthetic_routes
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.requests import RecordedRoutes
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm import model_builder, route_replay

pytestmark = pytest.mark.real

SEED = 4


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    """This process as the only rank of a gloo group, with megatron's model parallel state and the CPU shims."""
    from megatron.core import parallel_state, tensor_parallel

    from skyrl_sim_plugins.megatron_vllm.cpu_shims import apply_cpu_shims
    from skyrl_sim_plugins.megatron_vllm.single_rank import init_single_rank_group

    init_single_rank_group()  # no port and no MASTER_PORT left in the environment for the tests after these
    apply_cpu_shims()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.set_num_threads(1)
    yield


def variant(sets: dict | None = None):
    return load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", "tiny-moe-cpu").resolve("no-cap", sets)


def build(sets: dict | None = None):
    from skyrl_sim_plugins.megatron_vllm.trainer import LoraModel

    v = variant(sets)
    return LoraModel(v.model, v.endpoint, SEED, 256), v


def shape_of(v, lengths: list[int], kind: str = "forward_backward"):
    return shape_call(kind, lengths, v.endpoint, MEGATRON)


def test_microbatch_replay_lays_routes_out_as_the_routers_read_them_and_masks_what_has_none():
    """Two datums (3 and 2 routed tokens), a pad row (a copy of row 0) and a dummy row, width 4, top 2: the ids are
    [layers, width x rows, k] sequence-major (token (s, b) at s * rows + b), padding routes arange(k) elsewhere; the
    mask is True on right padding, the uncaptured suffix, and the whole pad and dummy rows."""
    routes = [
        np.array([[[5, 1]], [[2, 7]], [[0, 3]]], dtype=np.uint8),  # [captured 3, layers 1, k 2]
        np.array([[[6, 4]], [[1, 2]]], dtype=np.uint8),
    ]
    replay = types.SimpleNamespace(top_k=2, moe_layers=1, kept=[0])
    ids, mask = route_replay.microbatch_replay([0, 1, 2, -1], [4, 3, 4, 1], 4, routes, 2, replay)  # type: ignore[arg-type]
    assert ids.dtype == torch.int32 and ids.shape == (1, 16, 2)
    by_position = ids[0].view(4, 4, 2)  # [s, b, k]
    assert by_position[:, 0].tolist() == [[5, 1], [2, 7], [0, 3], [0, 1]]  # datum 0, then its uncaptured token
    assert by_position[:, 1].tolist() == [[6, 4], [1, 2], [0, 1], [0, 1]]  # datum 1, uncaptured, right padding
    assert by_position[:, 2].tolist() == by_position[:, 0].tolist()  # the pad row replays row 0's routes
    assert by_position[:, 3].tolist() == [[0, 1]] * 4  # the dummy row: padding routes
    assert mask.tolist() == [
        [False, False, False, True],
        [False, False, True, True],
        [True] * 4,
        [True] * 4,
    ]


def logprob_gap(a, b) -> float:
    """The largest difference of two calls' per-token log-probs (every real row)."""
    return max(
        float(np.max(np.abs(np.array(a.rows[i]["logprobs"]) - np.array(b.rows[i]["logprobs"])))) for i in a.rows
    )


def test_replayed_routes_give_the_recorded_assignment_and_the_same_loss(monkeypatch):
    """Record the routers' own choices over a call of two micro-batches of two rows, replay them: the routers use
    exactly the recorded ids and the loss is the recording run's. Other routes change the loss. Flattening the ids
    batch-major (SkyRL's ``_split_replay_indices`` order) hands rows each other's routes and changes it too."""
    model, v = build({"trainer.micro_train_batch_size_per_gpu": 2})
    lengths = [40, 23, 57]
    shape = shape_of(v, lengths)
    assert len(shape.microbatches) == 2 and max(mb.rows for mb in shape.microbatches) == 2
    recorded = model.run_pass(shape, lengths, forward_only=True, watch_routes=True)
    routes = [recorded.routes[i] for i in range(len(lengths))]
    assert [r.shape for r in routes] == [(41, 2, 2), (24, 2, 2), (58, 2, 2)]  # every token of each row, 2 layers, top 2
    replayed = model.run_pass(shape, lengths, forward_only=True, routes=routes, watch_routes=True)
    for i in range(len(lengths)):
        assert np.array_equal(replayed.routes[i], routes[i]), i
    assert replayed.total_loss == pytest.approx(recorded.total_loss, rel=1e-6)
    assert logprob_gap(replayed, recorded) < 1e-5
    other = [synthetic_routes(RecordedRoutes(seed=9, uncaptured=0), n, v.model) for n in lengths]
    different = model.run_pass(shape, lengths, forward_only=True, routes=other, watch_routes=True)
    assert np.array_equal(different.routes[2], other[2].astype(np.int64))
    assert logprob_gap(different, recorded) > 1e-3  # an untrained model: the experts' share of a log-prob is small

    real = route_replay.microbatch_replay

    def batch_major(*args, **kwargs):
        ids, mask = real(*args, **kwargs)
        layers, tokens, k = ids.shape
        rows = len(args[0])
        return ids.view(layers, tokens // rows, rows, k).transpose(1, 2).reshape(layers, tokens, k), mask

    monkeypatch.setattr(route_replay, "microbatch_replay", batch_major)
    shuffled = model.run_pass(shape, lengths, forward_only=True, routes=routes)
    assert logprob_gap(shuffled, recorded) > 1e-3


def test_a_forward_only_pass_between_two_training_steps_leaves_the_second_steps_replay_intact(monkeypatch):
    """Full recompute: the backward re-runs each router, which pops its ids from megatron's FIFO. A forward-only pass
    with routes fills that FIFO and never pops it; because each schedule clears the replay state before and after,
    the next training step's recompute still reads its own ids: its gradients are those of a run without the forward
    pass. Without the clearing the recompute reads the forward pass's ids and the gradients differ."""
    full = {"trainer.recompute": {"granularity": "full", "method": "uniform", "num_layers": 1}}
    first, step, between = [30, 18], [26, 41], [33, 12]
    m = variant(full).model
    a, b, c = (
        [synthetic_routes(RecordedRoutes(seed=seed), n, m) for n in lengths]
        for seed, lengths in ((1, first), (2, between), (3, step))
    )

    def run(with_forward: bool) -> list[torch.Tensor]:
        model, v = build(full)
        model.run_pass(shape_of(v, first), first, forward_only=False, routes=a)
        model.optim_step(1e-2)
        model.optimizer.zero_grad()
        if with_forward:
            model.run_pass(shape_of(v, between, "forward"), between, forward_only=True, routes=b)
        model.run_pass(shape_of(v, step), step, forward_only=False, routes=c)
        return [g.detach().clone() for g in model.optimizer.grads]

    clean, with_forward = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(clean, with_forward, strict=True))

    def no_clearing(self, active):  # the schedule scope without its clearing: the control that shows the leak
        return contextlib.nullcontext()

    monkeypatch.setattr(route_replay.RouteReplay, "schedule", no_clearing)
    leaked = run(True)
    assert not all(torch.allclose(x, y) for x, y in zip(clean, leaked, strict=True))


def test_padding_rows_and_the_uncaptured_suffix_are_left_out_of_expert_bias_accounting(monkeypatch):
    """With megatron's aux-loss-free expert bias on (sigmoid scores), each router counts the tokens it sent to each
    expert. The router padding mask leaves out the uncaptured suffix (3 tokens per row here), the right padding and
    the pad row: the count is top_k x the captured tokens of the real rows, per router."""
    settings = model_builder.moe_settings

    def with_expert_bias(arch, replay):
        return {**settings(arch, replay), "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}

    monkeypatch.setattr(model_builder, "moe_settings", with_expert_bias)
    model, v = build()
    lengths = [40, 23, 57]  # three rows and one pad row in one micro-batch of 4
    shape = shape_of(v, lengths)
    assert shape.padded_rows == 4
    recorded = RecordedRoutes(seed=5, uncaptured=3)
    routes = [synthetic_routes(recorded, n, v.model) for n in lengths]
    routers = [m for m in model.model.modules() if type(m).__name__ == "TopKRouter"]
    assert len(routers) == 2 and all(r.local_tokens_per_expert is not None for r in routers)
    for r in routers:
        r.local_tokens_per_expert.zero_()
    model.run_pass(shape, lengths, forward_only=False, routes=routes)
    captured = sum(n + 1 - 3 for n in lengths)
    assert [int(r.local_tokens_per_expert.sum()) for r in routers] == [2 * captured] * 2
    # per expert: exactly the recorded routes' counts (the dummy routes of masked tokens are not among them)
    for layer, r in enumerate(routers):
        expected = np.bincount(np.concatenate([x[:, layer].ravel() for x in routes]), minlength=8)
        assert r.local_tokens_per_expert.tolist() == expected.tolist()

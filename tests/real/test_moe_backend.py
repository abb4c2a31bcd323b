"""The real backend on a mixture-of-experts model (tiny-moe: 2 layers, 8 experts, top 2) on one CPU rank: megatron-core's
local MoE layer with LoRA on the attention and on every expert, trained under torchrun, its memory against the walk's.

One worker group per module (``tiny-moe-cpu``, replay off here: the routers route for themselves), its model given
Qwen's gated shared expert (``GATED``: a shared expert 64 wide whose output ``sigmoid(x @ w)`` scales, megatron-core's
``SharedExpertMLP`` with ``moe_shared_expert_gate``), so the walk's routed experts and its shared expert's gate are
both held to the meter; the expert-parallel check runs plain tiny-moe.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from worker_setup import worker_group

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.backend import worker_endpoint
from skyrl_sim_plugins.megatron_vllm.batch import shape_to_dict
from skyrl_sim_plugins.megatron_vllm.workers import WorkerGroup
from skyrl_sim_plugins.sim.bound.memory import default_memory_model

pytestmark = pytest.mark.real

SEED = 3
OFF = {"trainer.routed_expert_replay": "off"}


GATED = {"shared_expert_ffn_hidden_size": 64, "shared_expert_gate": True}


def moe_variant(sets: dict | None = None):
    return load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", "tiny-moe-cpu").resolve("no-cap", {**OFF, **(sets or {})})


def gated_variant():
    """tiny-moe-cpu with a Qwen-style gated shared expert on every MoE layer."""
    variant = moe_variant()
    assert variant.model.moe is not None
    model = dataclasses.replace(variant.model, moe=dataclasses.replace(variant.model.moe, **GATED))
    return dataclasses.replace(variant, model=model)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    with worker_group(gated_variant(), tmp_path_factory.mktemp("moe"), seed=SEED, model_ids=["train", "walk"]) as group:
        yield group


def run_pass(group: WorkerGroup, model_id: str, lengths: list[int], kind: str = "forward_backward") -> dict:
    shape = shape_call(kind, lengths, gated_variant().endpoint, MEGATRON)
    [reply] = group.command({"cmd": kind, "model_id": model_id, "shape": shape_to_dict(shape), "datums": lengths}).values()
    assert reply["ok"], f"{reply.get('error')}\n{reply.get('traceback')}"
    return reply


def test_the_moe_model_trains_its_attention_and_expert_adapters(moe):
    losses = []
    for _ in range(4):
        losses.append(run_pass(moe, "train", [48, 30])["total_loss"])
        moe.command({"cmd": "optim_step", "model_id": "train", "learning_rate": 3e-3})
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses


@pytest.mark.parametrize(
    ("kind", "lengths"), [("forward_backward", [40, 40]), ("forward_backward", [119] * 4), ("forward", [119] * 4)]
)
def test_peak_tensor_memory_of_moe_calls_is_the_walks_within_3_percent(moe, kind, lengths):
    """The meter's peak (weights, adapters and their optimizer state, every live tensor of the call) against the
    walk of the same shape: router, permutation, each expert's tensors, unpermutation, the shared expert and its gate,
    as megatron-core runs them."""
    variant = gated_variant()
    shape = shape_call(kind, lengths, variant.endpoint, MEGATRON)
    real = run_pass(moe, "walk", lengths, kind)["peak_bytes"]
    walked = default_memory_model().evaluate(shape, variant.endpoint, variant.model).peak_bytes
    ungated = dataclasses.replace(variant.model, moe=dataclasses.replace(variant.model.moe, shared_expert_gate=False))
    blind = default_memory_model().evaluate(shape, variant.endpoint, ungated).peak_bytes
    print(f"{kind} {lengths}: real {real:,} walked {walked:,} ({(walked - real) / real:+.2%}), without the gate "
          f"{blind:,} ({(blind - real) / real:+.2%})")
    assert abs(walked - real) < abs(blind - real)  # the gate's weight and what its product keeps, as the meter has them
    assert abs(walked - real) / real <= 0.03, (walked, real)


def ep_group(expert_parallel: int, run_dir) -> WorkerGroup:
    """Two ranks of tiny-moe-cpu (data parallel 2), the experts split over them (``expert_parallel`` 2) or not."""
    v = moe_variant({"parallelism.dp": 2, "parallelism.ep": expert_parallel, "hardware.devices": 2})
    config = {
        "endpoint": worker_endpoint(v.endpoint),
        "arch": dataclasses.asdict(v.model),
        "seed": SEED,
        "model_ids": ["m"],
        "max_sequence_length": 512,
        "memory_limit_bytes": None,
        "idle_timeout_s": 600,
    }
    return WorkerGroup(config, 2, run_dir, startup_timeout_s=240, call_timeout_s=240)


def test_expert_parallel_2_gives_the_losses_and_checkpoint_of_expert_parallel_1(tmp_path):
    """Data parallel 2 with the experts split over the two ranks (EP 2) or held whole by each (EP 1): the same rows give
    the same log-probs, before and after optim_steps (an expert's adapter gradient stays on the rank that holds the
    expert; the others are summed over data parallel), and the saved checkpoint holds every expert, the same."""
    from safetensors.torch import load_file

    v = moe_variant({"parallelism.dp": 2, "parallelism.ep": 2, "hardware.devices": 2})
    lengths = [60, 60, 60, 60, 60, 60]  # equal rows: the all-gather dispatcher takes equal sizes from both ranks
    shape = shape_call("forward_backward", lengths, v.endpoint, MEGATRON)
    message = {"cmd": "forward_backward", "model_id": "m", "shape": shape_to_dict(shape), "datums": lengths}
    rows: dict[int, list] = {}
    for ep in (1, 2):
        with ep_group(ep, tmp_path / f"ep{ep}") as group:
            replies = []
            for _ in range(3):
                replies.append(group.command(message))
                group.command({"cmd": "optim_step", "model_id": "m", "learning_rate": 5e-3})
            path = tmp_path / f"saved-ep{ep}"
            group.command({"cmd": "save_weights_for_sampler", "model_id": "m", "path": str(path)})
        rows[ep] = [{int(k): r for reply in round_.values() for k, r in reply["rows"].items()} for round_ in replies]
        assert all(reply["ok"] for round_ in replies for reply in round_.values())
    for one, two in zip(rows[1], rows[2], strict=True):
        assert set(one) == set(two) == set(range(6))
        for i in range(6):
            assert one[i]["logprobs"] == pytest.approx(two[i]["logprobs"], abs=1e-4)
    assert rows[1][0][0]["logprobs"] != pytest.approx(rows[1][2][0]["logprobs"], abs=1e-3)  # it trained
    saved = {ep: load_file(str(tmp_path / f"saved-ep{ep}" / "model.safetensors")) for ep in (1, 2)}
    assert set(saved[1]) == set(saved[2])
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in saved[2]
    for name, tensor in saved[1].items():
        assert torch.allclose(tensor, saved[2][name], atol=1e-5), name

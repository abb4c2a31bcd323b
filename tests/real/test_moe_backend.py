"""The real backend on a mixture-of-experts model (tiny-moe: 2 layers, 8 experts, top 2) on one CPU rank: megatron-core's
local MoE layer with LoRA on the attention and on every expert, trained under torchrun, its memory against the walk's.

One worker group per module (``tiny-moe-cpu``, replay off here: the routers route for themselves).
"""

from __future__ import annotations

import pytest
from worker_setup import worker_group

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.batch import shape_to_dict
from skyrl_sim_plugins.megatron_vllm.workers import WorkerGroup
from skyrl_sim_plugins.sim.memory import default_memory_model

pytestmark = pytest.mark.real

SEED = 3
OFF = {"trainer.routed_expert_replay": "off"}


def moe_variant(sets: dict | None = None):
    return load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", "tiny-moe-cpu").resolve("no-cap", {**OFF, **(sets or {})})


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    with worker_group(moe_variant(), tmp_path_factory.mktemp("moe"), seed=SEED, model_ids=["train", "walk"]) as group:
        yield group


def run_pass(group: WorkerGroup, model_id: str, lengths: list[int], kind: str = "forward_backward") -> dict:
    shape = shape_call(kind, lengths, moe_variant().endpoint, MEGATRON)
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
    walk of the same shape: router, permutation, each expert's tensors, unpermutation, as megatron-core runs them."""
    variant = moe_variant()
    shape = shape_call(kind, lengths, variant.endpoint, MEGATRON)
    real = run_pass(moe, "walk", lengths, kind)["peak_bytes"]
    walked = default_memory_model().evaluate(shape, variant.endpoint, variant.model).peak_bytes
    assert abs(walked - real) / real <= 0.03, (walked, real)

"""The real backend on a sliding-window model (tiny-swa: tiny-dense whose first layer attends to its last 64 tokens):
megatron-core's unfused attention with its window (``window_size``, ``window_attn_skip_freq``), trained under torchrun
on one CPU rank, its memory against the walk's (the banded mask each window layer builds and keeps). One worker group
for the module; the full matrix is ``scripts/validate.py --endpoint tiny-swa-cpu``."""

from __future__ import annotations

import pytest
from worker_setup import worker_group

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.batch import shape_to_dict
from skyrl_sim_plugins.megatron_vllm.workers import WorkerGroup
from skyrl_sim_plugins.sim.bound.memory import default_memory_model

pytestmark = pytest.mark.real

SEED = 3


def swa_variant():
    return load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", "tiny-swa-cpu").resolve("cap-aware")


@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    with worker_group(swa_variant(), tmp_path_factory.mktemp("swa"), seed=SEED, model_ids=["train", "walk"]) as group:
        yield group


def run_pass(group: WorkerGroup, model_id: str, lengths: list[int], kind: str = "forward_backward") -> dict:
    shape = shape_call(kind, lengths, swa_variant().endpoint, MEGATRON)
    [reply] = group.command({"cmd": kind, "model_id": model_id, "shape": shape_to_dict(shape), "datums": lengths}).values()
    assert reply["ok"], f"{reply.get('error')}\n{reply.get('traceback')}"
    return reply


def test_the_window_model_trains_and_its_peak_is_the_walks_within_3_percent(swa):
    losses = []
    for _ in range(3):
        losses.append(run_pass(swa, "train", [150, 90])["total_loss"])
        swa.command({"cmd": "optim_step", "model_id": "train", "learning_rate": 3e-3})
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    variant = swa_variant()
    lengths = [199] * 4
    shape = shape_call("forward_backward", lengths, variant.endpoint, MEGATRON)
    real = run_pass(swa, "walk", lengths)["peak_bytes"]
    walked = default_memory_model().evaluate(shape, variant.endpoint, variant.model).peak_bytes
    assert abs(walked - real) / real <= 0.03, (walked, real)

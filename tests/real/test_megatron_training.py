"""Real megatron-core LoRA workers under torchrun (gloo, CPU): TP equality, training, and the exported checkpoint.

One TP=1 and one TP=2 worker group per module (about 10 s and 15 s to start); each test uses its own model id, so
gradients never leak between tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from worker_setup import worker_group

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.batch import datum_tokens, shape_to_dict
from skyrl_sim_plugins.megatron_vllm.executor import checkpoint_dir
from skyrl_sim_plugins.megatron_vllm.workers import WorkerGroup

pytestmark = pytest.mark.real

MODEL_IDS = ["tp-equal", "train", "export"]
SEED = 11


def endpoint_variant(name: str):
    return load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", name).resolve("no-cap")


def start(name: str, run_dir: Path) -> WorkerGroup:
    return worker_group(endpoint_variant(name), run_dir, seed=SEED, model_ids=MODEL_IDS)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    with start("tiny-cpu-tp1", tmp_path_factory.mktemp("tp1")) as group:
        yield group


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    with start("tiny-cpu-tp2", tmp_path_factory.mktemp("tp2")) as group:
        yield group


def run_pass(group: WorkerGroup, endpoint_name: str, model_id: str, lengths: list[int], kind: str = "forward_backward"):
    shape = shape_call(kind, lengths, endpoint_variant(endpoint_name).endpoint, MEGATRON)
    replies = group.command({"cmd": kind, "model_id": model_id, "shape": shape_to_dict(shape), "datums": lengths})
    for rank, reply in replies.items():
        assert reply["ok"], f"rank {rank}: {reply.get('error')}\n{reply.get('traceback')}"
    return replies


def test_tp2_gives_the_same_losses_as_tp1_before_and_after_an_optim_step(tp1, tp2):
    lengths = [40, 23, 57]
    for round_ in range(2):
        one = run_pass(tp1, "tiny-cpu-tp1", "tp-equal", lengths)[0]
        two = run_pass(tp2, "tiny-cpu-tp2", "tp-equal", lengths)
        assert two[0]["total_loss"] == pytest.approx(two[1]["total_loss"], rel=1e-6)  # both TP ranks agree
        assert one["num_tokens"] == two[0]["num_tokens"] == sum(lengths)
        assert two[0]["total_loss"] == pytest.approx(one["total_loss"], rel=1e-5), f"round {round_}"
        for row in range(3):
            a, b = one["rows"][str(row)]["logprobs"], two[0]["rows"][str(row)]["logprobs"]
            assert len(a) == len(b) == lengths[row]
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
        for group in (tp1, tp2):
            group.command({"cmd": "optim_step", "model_id": "tp-equal", "learning_rate": 1e-3})


def test_loss_decreases_over_forward_backward_and_optim_step_rounds(tp1):
    losses = []
    for _ in range(4):
        losses.append(run_pass(tp1, "tiny-cpu-tp1", "train", [64])[0]["total_loss"])
        tp1.command({"cmd": "optim_step", "model_id": "train", "learning_rate": 2e-3})
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.97 * losses[0], losses


def test_forward_matches_forward_backward_and_accumulates_no_gradient(tp1):
    fb = run_pass(tp1, "tiny-cpu-tp1", "export", [30, 12])[0]
    fwd = run_pass(tp1, "tiny-cpu-tp1", "export", [30, 12], kind="forward")[0]
    assert fwd["total_loss"] == pytest.approx(fb["total_loss"], rel=1e-6)
    assert fwd["rows"]["1"]["elementwise_loss"] == pytest.approx(fb["rows"]["1"]["elementwise_loss"], rel=1e-6)


def test_saved_checkpoint_is_the_trained_model_in_hf_llama_form(tp2, tmp_path):
    transformers = pytest.importorskip("transformers")
    for _ in range(2):
        run_pass(tp2, "tiny-cpu-tp2", "export", [24])
        tp2.command({"cmd": "optim_step", "model_id": "export", "learning_rate": 5e-3})
    trained = run_pass(tp2, "tiny-cpu-tp2", "export", [24], kind="forward")[0]["total_loss"]
    path = tmp_path / "trained"
    tp2.command({"cmd": "save_weights_for_sampler", "model_id": "export", "path": str(path)})
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()

    def hf_loss(directory: Path) -> float:
        model = transformers.LlamaForCausalLM.from_pretrained(directory).float().eval()
        ids = torch.from_numpy(datum_tokens(SEED, 24, model.config.vocab_size)).unsqueeze(0)
        with torch.no_grad():
            logits = model(ids[:, :-1]).logits
        return float(-torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum())

    assert hf_loss(path) == pytest.approx(trained, rel=1e-5)
    base = checkpoint_dir(tp2.run_dir, "export", "")  # one base checkpoint, written at start, shared by the model ids
    assert hf_loss(base) > trained * 1.001  # the base checkpoint is the untrained model

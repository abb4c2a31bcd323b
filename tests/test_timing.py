"""The roofline time model: FLOPs of one layer by hand, how time grows with length, collectives, profiles."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from skyrl_sim.engine.request import Request
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.errors import UserError
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.hardware import load_profile, shipped_profiles
from skyrl_sim_plugins.sim.bound.timing import RooflineTimeModel
from skyrl_sim_plugins.sim.description.layer_ops import (
    CAUSAL_FRACTION,
    Setup,
    Work,
    decoder_layer,
    lora_parameter_count,
    unfused_score_bytes,
)
from skyrl_sim_plugins.sim.fast.time_program import AffinePass
from skyrl_sim_plugins.sim.reference.time_model import FEATURES, backward_of

TINY = PRESETS["tiny-dense"]
QWEN = PRESETS["qwen3.6-27b"]


def endpoint(model: str = "qwen3.6-27b", tp: int = 4, profile: str = "h200", **trainer) -> Endpoint:
    """An endpoint of the seed's SkyRL revision (its all-linear LoRA leaves the gated-DeltaNet projections alone)."""
    return Endpoint.model_validate(
        {
            "skyrl_version": "pr1874",
            "model": model,
            "hardware": {"profile": profile, "devices": tp},
            "parallelism": {"tp": tp},
            "trainer": {"micro_train_batch_size_per_gpu": 16, "remove_microbatch_padding": False, **trainer},
            "engine": {"cap_aware_padding": True},
        }
    )


def call_seconds(ep: Endpoint, lengths: list[int], kind: str = "forward_backward") -> float:
    model = PRESETS[ep.model] if isinstance(ep.model, str) else QWEN
    return RooflineTimeModel().call_seconds(shape_call(kind, lengths, ep, MEGATRON), ep, model)


def test_dense_layer_flops_by_hand():
    # tiny-dense at TP 1, LoRA rank 8 on qkv, proj, fc1, fc2: h 128, ffn 352, 4 heads x 32, 2 KV heads (qkv width 256).
    # One row of 100 tokens: 100 x 100 / 2 causal (query, key) pairs.
    work = Work(tokens=100, pairs=100 * 100 * CAUSAL_FRACTION)
    layer = decoder_layer(TINY, 0).forward(work, Setup.of(endpoint("tiny-dense", tp=1, profile="cpu")))
    by_name = {op.name: op.flops for op in layer.ops}
    assert by_name["linear_qkv"] == 2 * 100 * 128 * 256 == 6_553_600
    assert by_name["linear_qkv.lora"] == 2 * 100 * 8 * (128 + 256) == 614_400
    assert by_name["core_attention"] == 4 * 5000 * 4 * 32 == 2_560_000
    assert by_name["linear_proj"] == 3_276_800
    assert by_name["linear_proj.lora"] == 409_600
    assert by_name["linear_fc1"] == 2 * 100 * 128 * 704 == 18_022_400
    assert by_name["linear_fc1.lora"] == 1_331_200
    assert by_name["linear_fc2"] == 2 * 100 * 352 * 128 == 9_011_200
    assert by_name["linear_fc2.lora"] == 768_000
    assert layer.flops == 42_547_200
    assert layer.collectives == []  # TP 1 talks to nobody


def test_deltanet_layer_flops_by_hand_at_tp4():
    # Qwen3.6-27B layer 0 is gated DeltaNet. 1,000 tokens, TP 4. Its projections carry no LoRA; the MLP's do.
    # in_proj width 2x2048 + 2x6144 + 2x48 = 16,480; conv channels 2x2048 + 6144 = 10,240, kernel 4;
    # core per token 48/4 value heads x (4 x 128 x 128 + 2 x 64 x (128 + 128)); fc1 5120 -> 34,816, fc2 17,408 -> 5120.
    work = Work(tokens=1000, pairs=0)
    layer = decoder_layer(QWEN, 0).forward(work, Setup.of(endpoint()))
    by_name = {op.name: op.flops for op in layer.ops}
    assert by_name["in_proj"] == 42_188_800_000
    assert by_name["conv1d"] == 20_480_000
    assert by_name["deltanet_core"] == 1_179_648_000
    assert by_name["out_proj"] == 15_728_640_000
    assert by_name["linear_fc1"] == 89_128_960_000
    # Column-parallel adapter: A [8, 5120] replicated, B [34816/4, 8] sharded.
    assert by_name["linear_fc1.lora"] == 2 * 1000 * 8 * (5120 + 8704) == 221_184_000
    # Row-parallel adapter: A [8, 17408/4] sharded, B [5120, 8] replicated.
    assert by_name["linear_fc2.lora"] == 2 * 1000 * 8 * (4352 + 5120) == 151_552_000
    assert "in_proj.lora" not in by_name and "out_proj.lora" not in by_name
    assert layer.flops == 193_183_744_000
    # Sequence parallel: an all-gather and a reduce-scatter around each block, plus the row-parallel adapter's all-reduce.
    kinds = sorted(c.kind for c in layer.collectives)
    assert kinds == ["all_gather", "all_gather", "all_reduce", "reduce_scatter", "reduce_scatter"]


def test_full_attention_is_quadratic_and_deltanet_linear_in_length():
    setup = Setup.of(endpoint())
    full = QWEN.layer_types.index("full_attention")

    def core(index: int, tokens: int) -> float:
        work = Work(tokens, tokens * tokens * CAUSAL_FRACTION)
        return next(op.flops for op in decoder_layer(QWEN, index).forward(work, setup).ops if op.role == "core")

    assert core(full, 20_000) == pytest.approx(4 * core(full, 10_000))
    assert core(0, 20_000) == pytest.approx(2 * core(0, 10_000))


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=1, max_value=15_000))
def test_doubling_length_at_least_doubles_the_flops(quarter):
    # Rows are input + 1 tokens, trimmed to a multiple of TP 4: a row of 4k tokens against one of 8k.
    ep = endpoint()
    model = RooflineTimeModel()
    one = model.call_cost(shape_call("forward_backward", [4 * quarter - 1], ep, MEGATRON), ep, QWEN)
    two = model.call_cost(shape_call("forward_backward", [8 * quarter - 1], ep, MEGATRON), ep, QWEN)
    assert two.flops >= 2 * one.flops


@pytest.mark.parametrize("length", [35_000, 70_000])
def test_doubling_a_long_row_at_least_doubles_the_call_time(length):
    ep = endpoint()
    assert call_seconds(ep, [2 * length]) >= 2 * call_seconds(ep, [length])


def test_doubling_length_at_least_doubles_on_the_cpu_profile():
    ep = endpoint("tiny-wide", tp=1, profile="cpu")
    assert call_seconds(ep, [16_000]) >= 2 * call_seconds(ep, [8_000])


def test_padding_rows_cost_full_compute():
    capped = call_seconds(endpoint(), [35_000])
    padded_ep = endpoint()
    padded_ep.engine.cap_aware_padding = False  # 1 row -> 16 copies of row 0
    assert call_seconds(padded_ep, [35_000]) > 12 * capped


def test_forward_is_cheaper_than_forward_backward_and_recompute_costs_a_forward():
    ep = endpoint()
    fb = call_seconds(ep, [20_000])
    assert call_seconds(ep, [20_000], kind="forward") < fb / 2
    no_recompute = endpoint(recompute={"granularity": "none"})
    assert call_seconds(no_recompute, [20_000]) < fb


def test_tensor_parallel_collectives_cost_time_only_with_tp():
    model = RooflineTimeModel()
    for tp, expect_comm in ((1, False), (4, True)):
        ep = endpoint(tp=tp)
        cost = model.call_cost(shape_call("forward_backward", [8000], ep, MEGATRON), ep, QWEN)
        assert (cost.comm_s > 0) == expect_comm
    # Sequence parallel splits each block's all-reduce into an all-gather and a reduce-scatter: the same traffic.
    sp = endpoint()
    no_sp = endpoint()
    no_sp.parallelism.sequence_parallel = False
    with_sp = model.call_cost(shape_call("forward_backward", [8000], sp, MEGATRON), sp, QWEN).comm_s
    without = model.call_cost(shape_call("forward_backward", [8000], no_sp, MEGATRON), no_sp, QWEN).comm_s
    assert without == pytest.approx(with_sp, rel=0.05)


def test_features_sum_to_the_duration_and_h100_is_slower_on_memory():
    ep = endpoint()
    model = RooflineTimeModel()
    shape = shape_call("forward_backward", [4000], ep, MEGATRON)
    features = model.features(shape, ep, QWEN)
    assert set(features) == set(FEATURES)
    assert sum(features.values()) == pytest.approx(model.call_seconds(shape, ep, QWEN))
    h100 = endpoint(profile="h100")
    assert model.features(shape, h100, QWEN)["memory_s"] > features["memory_s"]


def test_sampling_grows_with_generated_tokens():
    ep = endpoint()
    model = RooflineTimeModel()
    short = Request(1, "sample", "m", prompt_tokens=256, max_tokens=64)
    long = Request(2, "sample", "m", prompt_tokens=256, max_tokens=512)
    assert model.sample_seconds([long], ep, QWEN) > 4 * model.sample_seconds([short], ep, QWEN) - 1.0
    assert model.sample_seconds([long], ep, QWEN) > model.sample_seconds([short], ep, QWEN)


def test_a_sample_call_is_kept_by_what_its_cost_reads():
    """A repeated sample call is answered from the cache with the same seconds a fresh model gives; a call that
    differs in anything the cost reads (order, a LoRA checkpoint, a count) is costed anew."""
    ep = endpoint()
    kept = RooflineTimeModel()
    a = Request(1, "sample", "m", prompt_tokens=512, max_tokens=256, num_samples=2, checkpoint="c1")
    b = Request(2, "sample", "n", prompt_tokens=100, max_tokens=256)
    calls = [[a, b], [b, a], [a], [b], [Request(3, "sample", "m", prompt_tokens=512, max_tokens=256, num_samples=2)]]
    for requests in [*calls, *calls]:
        fresh = RooflineTimeModel().sample_seconds(requests, ep, QWEN)
        assert kept.sample_seconds(requests, ep, QWEN).hex() == fresh.hex()
    # Apart from the swapped pair, every call costs differently, so a key that is too coarse fails above.
    seconds = {kept.sample_seconds(requests, ep, QWEN) for requests in calls if requests != [b, a]}
    assert len(seconds) == len(calls) - 1


def test_singles_have_their_costs():
    ep = endpoint()
    model = RooflineTimeModel()

    def single(kind: str) -> float:
        return model.single_seconds(Request(1, kind, "m"), ep, QWEN)

    assert single("create_model") > single("save_weights") > single("optim_step") > 0
    # LoRA on qkv, proj (16 full-attention layers) and fc1, fc2 (all 64 layers), rank 8.
    full = 16 * 8 * ((5120 + 12288 + 2048) + (6144 + 5120))
    mlp = 64 * 8 * ((5120 + 34816) + (17408 + 5120))
    assert lora_parameter_count(QWEN, ep) == full + mlp


def test_profiles_by_name_by_path_and_calibrated(tmp_path):
    assert {"h100", "h200", "cpu"} <= set(shipped_profiles())
    with pytest.raises(UserError, match="hardware.profile 'tpu-v9'"):
        load_profile("tpu-v9")
    data = yaml.safe_load((resources.files("skyrl_sim") / "data" / "hardware" / "h200.yaml").read_text())
    assert isinstance(data["peak_flops"], float)  # YAML 1.1 reads 989.0e12 (no exponent sign) as a string
    data["peak_flops"] *= 2
    data["name"] = "h200-fast"
    fast = tmp_path / "fast.yaml"
    fast.write_text(yaml.safe_dump(data))
    base = call_seconds(endpoint(), [30_000])
    assert call_seconds(endpoint(profile=str(fast)), [30_000]) < base
    calibrated = tmp_path / "calibrated.yaml"
    calibrated.write_text(
        yaml.safe_dump(
            {"schema": "skyrl-sim/profile/1", "name": "c", "base": "h200", "time_coefficients": {f: 2.0 for f in FEATURES}}
        )
    )
    assert call_seconds(endpoint(profile=str(calibrated)), [30_000]) == pytest.approx(2 * base)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({**data, "efficiency": {"matmul": 3}}))
    with pytest.raises(UserError, match=r"broken\.yaml, key 'efficiency.matmul'"):
        load_profile(str(broken))


@pytest.mark.parametrize(
    ("model", "recompute"),
    [
        ("qwen3.6-27b", {"granularity": "full"}),
        ("qwen3.6-27b", {"granularity": "selective"}),
        ("qwen3.6-35b-a3b", {"granularity": "full", "method": "block", "num_layers": 3}),
        ("qwen3-8b", {"granularity": "none"}),
    ],
)
def test_every_training_op_is_as_affine_as_it_declares(model, recompute):
    """The layers' ops declare themselves affine in tokens and pairs; the affine form built from three probes
    predicts every op and collective at any work (``AffinePass.check`` raises ``NotAffine`` where it does not)."""
    ep = endpoint(model, recompute=recompute)
    reference = RooflineTimeModel().bind(ep, PRESETS[model]).reference
    for backward in (False, True):

        def listed(tokens, pairs, backward=backward):
            return reference.layers_direct(Work(tokens, pairs), backward)

        affine = AffinePass.build(listed, 2)
        for work in (Work(4, 8), Work(3000, 3000**2 / 2), Work(16 * 35004, 16 * 35004**2 / 2)):
            affine.check(listed(work.tokens, work.pairs), (work.tokens, work.pairs))


def test_a_broken_profile_is_a_clear_cli_error(tmp_path, capsys):
    from project_paths import SCENARIOS
    from skyrl_sim.cli import main

    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "name: x\ndevice_memory_gib: 80\npeak_flops: fast\nmemory_bandwidth: 1.0e+12\ninterconnect_bandwidth: 1.0e+11\n"
    )
    args = ["run", str(SCENARIOS / "queue_drain_17.yaml"), "--variant", "cap-aware", "--set", f"hardware.profile={broken}"]
    assert main(args) == 2
    assert "broken.yaml, key 'peak_flops'" in capsys.readouterr().err


def test_attention_kernel_follows_the_layer_spec_unless_set():
    assert endpoint(layer_spec="local").trainer.attention_kernel == "unfused"
    assert endpoint(layer_spec="transformer_engine").trainer.attention_kernel == "flash"
    assert endpoint(layer_spec="local", attention="flash").trainer.attention_kernel == "flash"
    assert endpoint(layer_spec="transformer_engine", attention="unfused").trainer.attention_kernel == "unfused"


def test_the_time_model_reads_the_trainers_attention_not_the_profile():
    # The same shape on the same (cpu) profile: only trainer.attention changes the attention core. Unfused runs every
    # (query, key) pair (no causal skipping) and moves the scores through memory, so it costs more of both.
    work = Work(tokens=1000, pairs=1000 * 1000 * CAUSAL_FRACTION)

    def core(**trainer: object):
        setup = Setup.of(endpoint("tiny-dense", tp=1, profile="cpu", **trainer))
        return [op for op in decoder_layer(TINY, 0).forward(work, setup).ops if op.role == "core"]

    flash, unfused = core(attention="flash"), core(attention="unfused")
    assert sum(op.flops for op in unfused) == pytest.approx(sum(op.flops for op in flash) / CAUSAL_FRACTION)
    assert sum(op.bytes for op in unfused) > sum(op.bytes for op in flash)
    assert core(layer_spec="local") == unfused
    assert core(layer_spec="transformer_engine") == flash
    lengths = [3000, 3000]
    assert call_seconds(endpoint(attention="unfused"), lengths) > call_seconds(endpoint(attention="flash"), lengths)


def test_a_profile_no_longer_names_an_attention_kernel(tmp_path):
    # Profiles describe hardware; the attention kernel is the trainer's (trainer.attention).
    data = yaml.safe_load((resources.files("skyrl_sim") / "data" / "hardware" / "cpu.yaml").read_text())
    assert "attention_kernel" not in data
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({**data, "attention_kernel": "unfused"}))
    with pytest.raises(UserError, match=r"old\.yaml, key 'attention_kernel'"):
        load_profile(str(old))


def test_unfused_score_traffic_follows_the_softmax_dtype_and_device():
    # Bytes per score element that megatron's unfused attention moves (memory_ops._unfused_core_attention's kernels):
    # a 16-bit model makes fp32 copies (more traffic than its own dtype would), CUDA's softmax backward one more pass.
    bf16_cuda, bf16_cpu = unfused_score_bytes(2, True), unfused_score_bytes(2, False)
    fp32_cuda = unfused_score_bytes(4, True)
    assert bf16_cuda[0] == bf16_cpu[0] == 28 and bf16_cuda[1] - bf16_cpu[1] == 12
    assert fp32_cuda[0] < bf16_cuda[0] and fp32_cuda[1] > bf16_cuda[1]
    work = Work(tokens=1000, pairs=1000 * 1000 * CAUSAL_FRACTION)
    setup = Setup.of(endpoint("tiny-dense", tp=1, profile="h200", attention="unfused"))
    scores = next(op for op in decoder_layer(TINY, 0).forward(work, setup).ops if op.name == "core_attention.scores")
    elements = 1000 * 1000 * TINY.num_attention_heads
    assert scores.bytes == pytest.approx(elements * 28) and scores.backward_bytes == pytest.approx(elements * 52)
    grad = next(
        op for op in backward_of(decoder_layer(TINY, 0).forward(work, setup)).ops if op.name == "core_attention.scores.grad"
    )
    assert grad.bytes == scores.backward_bytes

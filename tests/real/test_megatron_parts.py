"""The real backend's parts that need no worker: batch preparation, the HF layout, the memory meter, refusals.

Fast (no torchrun), but they import torch and megatron-core, so they carry the ``real`` mark like the rest.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from project_paths import SCENARIOS
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.errors import UserError
from skyrl_sim.results.oom_text import attempted_bytes
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim_plugins.megatron_vllm.backend import check_variant
from skyrl_sim_plugins.megatron_vllm.batch import build_microbatches, datum_tokens, shape_from_dict, shape_to_dict
from skyrl_sim_plugins.megatron_vllm.hf_export import from_megatron, init_hf_weights, to_megatron
from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter
from skyrl_sim_plugins.megatron_vllm.model_builder import check_supported

pytestmark = pytest.mark.real


def tiny_variant(variant: str = "no-cap", endpoint: str | None = None, sets: dict | None = None):
    return load_scenario(SCENARIOS / "queue_drain_17_tiny.yaml", endpoint).resolve(variant, sets)


def test_batch_follows_the_shape_left_padding_pad_rows_and_trimming():
    variant = tiny_variant()
    lengths = [7, 30, 12]
    shape = shape_call("forward_backward", lengths, variant.endpoint, MEGATRON)
    assert (shape.rows, shape.padded_rows, shape.width) == (3, 16, 31)
    [mb] = build_microbatches(shape, lengths, seed=3, vocab_size=512, dp_rank=0, dp=1, tp=1, budget=-1)
    assert mb.tokens.shape == (16, 31)  # trimmed to the micro-batch's longest row (= S here)
    assert mb.lengths == [8, 31, 13] + [8] * 13  # pad rows are copies of row 0
    seq = datum_tokens(3, 7, 512)
    assert mb.tokens[0, :8].tolist() == seq.tolist() and mb.tokens[0, 8:].eq(0).all()  # real tokens moved left
    assert mb.targets[0, 31 - 8 : 30].tolist() == seq[1:].tolist()  # left-padded targets at the global width
    assert mb.loss_mask[:3].sum(dim=1).tolist() == [7.0, 30.0, 12.0]  # one weight per target
    assert mb.loss_mask[3:].sum() == 0  # pad rows: full compute, no loss
    assert mb.tokens[5].tolist() == mb.tokens[0].tolist()


def test_micro_batches_split_rows_and_trim_each_to_its_own_width():
    variant = tiny_variant(sets={"trainer.micro_train_batch_size_per_gpu": 2})
    lengths = [5, 40, 9]
    shape = shape_call("forward_backward", lengths, variant.endpoint, MEGATRON)
    mbs = build_microbatches(shape, lengths, seed=0, vocab_size=512, dp_rank=0, dp=1, tp=1, budget=-1)
    assert [m.row_index for m in mbs] == [[0, 1], [2, 3]]
    assert [m.tokens.shape[1] for m in mbs] == [mb.width for mb in shape.microbatches] == [41, 10]
    assert all(m.global_width == 41 for m in mbs)


def test_token_batching_pads_each_micro_batch_with_one_token_dummy_rows():
    """``_pad_microbatch_to_size``: the token packer's bins get one-token rows (token 0, no loss, no RL input) up to
    the rank's largest row count, as the shape says."""
    budget = 120
    variant = tiny_variant(sets={"trainer.max_tokens_per_microbatch": budget, "engine.cap_aware_padding": True})
    lengths = [100, 20, 25, 30]
    shape = shape_call("forward_backward", lengths, variant.endpoint, MEGATRON, "ppo")
    inputs = [([-1.0] * n, [0.5] * n) for n in lengths]
    mbs = build_microbatches(shape, lengths, 0, 512, 0, 1, 1, budget, loss_inputs=inputs)
    assert len({m.tokens.shape[0] for m in mbs}) == 1 and len(mbs) == len(shape.microbatches) > 1
    for m, planned in zip(mbs, shape.microbatches, strict=True):
        dummies = [r for r, index in enumerate(m.row_index) if index < 0]
        assert len(dummies) == planned.dummy_rows and [m.lengths[r] for r in dummies] == [1] * len(dummies)
        assert all(m.loss_mask[r].sum() == 0 and m.advantages[r].abs().sum() == 0 for r in dummies)
    real = [m for m in mbs if m.row_index[0] == 0][0]
    assert real.sampling_logprobs[0, real.global_width - 101 : real.global_width - 1].eq(-1.0).all()


def test_shape_survives_the_wire():
    shape = shape_call("forward", [3, 9], tiny_variant().endpoint, MEGATRON)
    assert shape_from_dict(shape_to_dict(shape)) == shape


def test_datum_tokens_are_deterministic_and_avoid_pad_and_eos():
    a, b = datum_tokens(1, 50, 512), datum_tokens(1, 50, 512)
    assert a.tolist() == b.tolist() and len(a) == 51 and a.min() >= 2
    assert datum_tokens(2, 50, 512).tolist() != a.tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_layout_round_trips_through_megatron_shards(tp):
    arch = PRESETS["tiny-dense"]
    hf = init_hf_weights(arch, seed=5)
    shards = [to_megatron(hf, arch, tp, rank) for rank in range(tp)]
    back = from_megatron(shards, arch)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    if tp == 2:  # fc1 holds each rank's gate slice then its up slice
        gate = hf["model.layers.0.mlp.gate_proj.weight"]
        assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"][:176], gate[176:])


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_hf_layout_round_trips_through_expert_parallel_shards(ep):
    """tiny-moe in the Mixtral layout: the router and every expert's w1 / w3 / w2 map to megatron's router and
    SequentialMLP experts; each EP rank holds its slice of the experts (at EP 1 every one)."""
    arch = PRESETS["tiny-moe"]
    hf = init_hf_weights(arch, seed=5)
    assert hf["model.layers.1.block_sparse_moe.experts.7.w2.weight"].shape == (128, 64)
    shards = [to_megatron(hf, arch, 1, 0, ep, rank) for rank in range(ep)]
    local = 8 // ep
    assert sum(1 for k in shards[-1] if k.startswith("decoder.layers.0.mlp.experts.")) == 2 * local
    last = shards[-1]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    first_of_last_rank = (ep - 1) * local
    assert torch.equal(last[:64], hf[f"model.layers.0.block_sparse_moe.experts.{first_of_last_rank}.w1.weight"])
    assert torch.equal(last[64:], hf[f"model.layers.0.block_sparse_moe.experts.{first_of_last_rank}.w3.weight"])
    if ep == 1:
        back = from_megatron(shards, arch)
        assert set(back) == set(hf)
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), name


def test_live_tensor_meter_counts_exact_storage_bytes():
    held = torch.zeros(1000)
    meter = LiveTensorMeter([held])
    with meter:
        a = torch.ones(256, 256)  # 262,144 bytes
        b = a * 2  # another 262,144
        del a
        c = b.sum()  # 4 bytes, while b (and not a) is live
        del b, c
    assert meter.baseline == 4000
    assert meter.high == 2 * 262_144
    assert meter.current == 0
    assert meter.peak_bytes == 4000 + 2 * 262_144


def test_tensor_limit_refuses_the_op_whose_output_passes_it_and_frees_it():
    held = torch.zeros(1000)  # 4,000 bytes of baseline
    meter = LiveTensorMeter([held], limit_bytes=4000 + 2 * 262_144)
    with meter:
        a = torch.ones(256, 256)  # 262,144: fits
        b = a * 2  # exactly at the limit: fits
        with pytest.raises(torch.OutOfMemoryError) as refused:
            a + b  # one more 262,144 would pass it
        message = str(refused.value)
        del refused  # its traceback holds the op's inputs
        assert meter.current == 2 * 262_144  # the refused output was never counted and is gone
        del a
        c = b + 1  # with a freed, the same size fits again
        del b, c
    assert attempted_bytes(message) == 262_144
    assert "DefaultCPUAllocator: can't allocate memory" in message
    assert meter.high == 2 * 262_144 and meter.current == 0


def test_tensor_limit_names_the_first_output_of_an_op_that_does_not_fit():
    x = torch.randn(64, 1000)
    meter = LiveTensorMeter([x], limit_bytes=x.nbytes + 64 * 4 + 100)
    with meter, pytest.raises(torch.OutOfMemoryError) as refused:
        torch.max(x, dim=1)  # values (64 fp32) fit; the int64 indices (512 bytes) are the allocation refused
    assert attempted_bytes(str(refused.value)) == 64 * 8


def test_tensor_limit_fails_a_backward_like_a_device_allocator():
    weight = torch.randn(128, 128, requires_grad=True)
    x = torch.randn(512, 128)
    limit = weight.nbytes + x.nbytes + 3 * 512 * 128 * 4  # the forward's outputs fit, the backward's gradients not
    meter = LiveTensorMeter([weight, x], limit_bytes=limit)
    with meter, pytest.raises(torch.OutOfMemoryError):
        (torch.relu(x @ weight) ** 2).sum().backward()
    assert weight.grad is None


def test_attempted_bytes_from_cpu_and_cuda_messages():
    cpu = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 12345678 bytes. Error code 12"
    assert attempted_bytes(cpu) == 12_345_678
    assert attempted_bytes("CUDA out of memory. Tried to allocate 9.08 GiB. GPU 0 has") == int(9.08 * 2**30)
    assert attempted_bytes("something else") is None


def test_unsupported_models_and_settings_are_refused_with_the_endpoint_named():
    with pytest.raises(UserError, match="qwen3.6-27b.*attention output gates"):
        check_supported(PRESETS["qwen3.6-27b"], 4, "seed")
    check_supported(PRESETS["tiny-moe"], 1)  # megatron-core's local MoE layer: supported at TP 1
    with pytest.raises(UserError, match="tiny-moe.*mixture-of-experts.*tp = 1"):
        check_supported(PRESETS["tiny-moe"], 2)
    with pytest.raises(UserError, match="8 experts do not split over ep = 3"):
        check_supported(PRESETS["tiny-moe"], 1, ep=3)
    with pytest.raises(UserError, match="remove_microbatch_padding"):
        check_variant(tiny_variant(sets={"trainer.remove_microbatch_padding": True}))
    with pytest.raises(UserError, match="trainer.layer_spec"):
        check_variant(tiny_variant(sets={"trainer.layer_spec": "transformer_engine"}))
    with pytest.raises(UserError, match="trainer.logprob_kernel"):
        check_variant(tiny_variant(sets={"trainer.logprob_kernel": "chunked_distributed_logprob"}))
    check_variant(tiny_variant(sets={"trainer.attention": "flash"}))  # the SDPA flash module: supported
    # the fused LM-head log-prob takes no logits kernel, and 16-bit adapters get mixed-precision state: supported
    fused = {"trainer.fused_lm_head_logprob": True, "trainer.logprob_kernel": "chunked_distributed_logprob"}
    check_variant(tiny_variant(sets={**fused, "lora.dtype": "bf16", "trainer.params_dtype": "bf16"}))
    with pytest.raises(UserError, match="sliding-window layers run with megatron-core's unfused attention"):
        check_variant(tiny_variant(endpoint="tiny-swa-cpu", sets={"trainer.attention": "flash"}))
    with pytest.raises(UserError, match="multi-latent attention runs with the flash core attention"):
        mla = load_scenario(SCENARIOS / "mla_moe_tiny.yaml").resolve("compact", {"trainer.attention": "unfused"})
        check_variant(mla)
    odd = dataclasses.replace(PRESETS["tiny-dense"], num_kv_heads=1, num_attention_heads=3)
    with pytest.raises(UserError, match="not divisible by tp = 2"):
        check_supported(odd, 2)


def test_pipeline_stages_take_their_layers_and_names_from_the_whole_model():
    """A stage's weights are the whole model's (its layers renamed from 0, the embedding on the first, the final norm
    and output layer on the last); its names map back, and the stages join into the whole model's shard."""
    from skyrl_sim_plugins.megatron_vllm.pipeline_stage import join_stages, stage_of, to_global, to_stage

    arch = dataclasses.replace(PRESETS["tiny-dense"], num_layers=4, layer_types=("full_attention",) * 4)
    whole = to_megatron(init_hf_weights(arch, 0), arch, 1, 0)
    first, last = stage_of(4, 2, 0), stage_of(4, 2, 1)
    a, b = to_stage(whole, first), to_stage(whole, last)
    assert "embedding.word_embeddings.weight" in a and "embedding.word_embeddings.weight" not in b
    assert "output_layer.weight" in b and "decoder.final_layernorm.weight" in b and "output_layer.weight" not in a
    assert {k.split(".")[2] for k in b if k.startswith("decoder.layers.")} == {"0", "1"}
    assert b["decoder.layers.0.mlp.linear_fc1.weight"] is whole["decoder.layers.2.mlp.linear_fc1.weight"]
    assert to_global("decoder.layers.1.self_attention.linear_qkv", last) == "decoder.layers.3.self_attention.linear_qkv"
    assert to_global("decoder.layers.1.self_attention.linear_qkv", first) == "decoder.layers.1.self_attention.linear_qkv"
    back = [(0, 0, {to_global(k, stage): v for k, v in part.items()}) for stage, part in ((first, a), (last, b))]
    assert join_stages(back, 1)[0].keys() == whole.keys()
    pp2 = str(SCENARIOS / "endpoints" / "tiny-cpu-pp2.yaml")
    check_variant(tiny_variant(endpoint=pp2))
    with pytest.raises(UserError, match="5 layers do not split evenly over pp = 2"):
        check_variant(tiny_variant(endpoint=pp2, sets={"model": {"preset": "tiny-dense", "num_layers": 5}}))

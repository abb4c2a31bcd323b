"""Multi-latent attention and sliding-window attention in the one layer description: the memory walk's graphs build
them as megatron-core runs them, the time model prices them, and the LoRA targets SkyRL 0.4.0 adapts on MLA."""

from __future__ import annotations

from dataclasses import replace

from skyrl_sim.api import Endpoint
from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim_plugins.sim.description.layer_ops import (
    FullAttention,
    LatentAttention,
    Setup,
    Work,
    decoder_layer,
    layer_kind,
)
from skyrl_sim_plugins.sim.reference.memory_ops import Dims, layer_graph

MLA = PRESETS["tiny-mla-moe"]
WINDOWED = replace(PRESETS["tiny-dense"], sliding_window=16, layer_types=("sliding_attention", "full_attention"))


def endpoint(model: str, attention: str, **trainer: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "name": "e",
            "skyrl_version": "0.4.0",
            "model": model,
            "hardware": {"profile": "cpu", "device_memory_gib": 24, "devices": 1},
            "trainer": {"layer_spec": "local", "attention": attention, "params_dtype": "fp32", **trainer},
        }
    )


def test_skyrl_all_linear_adapts_only_the_output_projection_of_mla() -> None:
    e = endpoint("tiny-mla-moe", "flash")
    attention = decoder_layer(MLA, 0).attention
    assert isinstance(attention, LatentAttention)
    adapted = {lin.name for lin in attention.linears if lin.adapted(e.adapted_targets(MLA))}
    assert adapted == {"linear_proj"}
    names = {lin.name for lin in attention.linears}
    assert names == {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"}


def test_the_mla_graph_keeps_the_latent_the_query_and_the_rotations() -> None:
    e = endpoint("tiny-mla-moe", "flash")
    d = Dims.of(e, MLA, 2, 64, 0)
    g = layer_graph(d, MLA, "full_attention", False)
    saved = set(g.saved_storages(grad=True, selective=False))
    # the norms keep the compressed query and the latent (with its rotary key); the rotations keep the up-projected
    # query alive through their saved views; the core attention keeps the concatenated query, key and the value copy
    for name in ("self_attention.linear_q_down_proj.base", "self_attention.linear_kv_down_proj.base",
                 "self_attention.linear_q_up_proj.base", "self_attention.query", "self_attention.key",
                 "self_attention.value"):
        assert name in saved, name
    assert g.tensors["self_attention.linear_kv_down_proj.base"].shape == (64, 2, 32 + 16)
    assert g.tensors["self_attention.query"].shape == (64, 2, 4 * 32)
    assert g.tensors["self_attention.value"].shape == (64, 2, 4 * 32)


def test_an_unfused_window_layer_keeps_its_banded_mask() -> None:
    e = endpoint("tiny-dense", "unfused")
    d = Dims.of(e, WINDOWED, 1, 64, 0)
    window = layer_graph(d, WINDOWED, "sliding_attention", False)
    full = layer_graph(d, WINDOWED, "full_attention", False)
    mask = "self_attention.core_attention.window_mask"
    assert mask in set(window.saved_storages(grad=True, selective=False))
    assert window.tensors[mask].shape == (64, 64) and mask not in full.tensors


def test_a_flash_window_computes_at_most_window_pairs_per_token() -> None:
    setup = Setup(tp=1, sequence_parallel=False, dtype=2, lora_rank=0, lora_targets=frozenset())
    block = layer_kind(WINDOWED, "sliding_attention", False).attention
    assert isinstance(block, FullAttention) and block.window == 16
    work = Work(tokens=1024, pairs=1024 * 1025 / 2)
    assert block.computed_pairs(work, setup) == 1024 * 16
    assert layer_kind(WINDOWED, "full_attention", False).attention.computed_pairs(work, setup) == work.pairs
    decode = Work(tokens=8, pairs=0, decode=True, sequences=8, context=4096)
    window_decode = block.forward(decode, setup, WINDOWED.hidden_size).ops
    full_decode = layer_kind(WINDOWED, "full_attention", False).attention.forward(decode, setup, 128).ops
    core = [op for op in window_decode if op.name == "core_attention"][0]
    assert core.flops < [op for op in full_decode if op.name == "core_attention"][0].flops


def test_mla_decoding_reads_one_latent_vector_per_token() -> None:
    setup = Setup(tp=1, sequence_parallel=False, dtype=2, lora_rank=0, lora_targets=frozenset())
    block = decoder_layer(MLA, 0).attention
    decode = Work(tokens=8, pairs=0, decode=True, sequences=8, context=1000)
    core = [op for op in block.forward(decode, setup, MLA.hidden_size).ops if op.name == "core_attention"][0]
    assert core.bytes == 8 * 1000 * (32 + 16) * 2

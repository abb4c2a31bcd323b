"""vLLM's KV cache for multi-latent attention and sliding-window models, as the installed vLLM computes it: each
layer's ``KVCacheSpec`` (its page size), the KV cache groups (``get_kv_cache_groups``) and the pool's blocks for a
memory budget (``get_kv_cache_config_from_groups``), called on vLLM's own code and compared with the simulator's
(``kv_cache.layer_cache_specs``, ``kv_cache.layout``, ``kv_cache.kv_cache_size``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from skyrl_sim.api import Endpoint, ModelArch
from skyrl_sim.schema.architecture import from_hf_config
from skyrl_sim_plugins.sim.service.inference.kv_cache import kv_cache_size, layer_cache_specs, layout

torch = pytest.importorskip("torch")
interface = pytest.importorskip("vllm.v1.kv_cache_interface")
utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "scenarios" / "models"
BF16 = 2


def load(name: str) -> ModelArch:
    return from_hf_config(json.loads((CONFIGS / name / "config.json").read_text()), name)


def endpoint(tp: int = 1, block_size: int = 16, memory: int = 8 * 2**30) -> Endpoint:
    return Endpoint.model_validate(
        {
            "name": "e",
            "model": "tiny-dense",
            "hardware": {"profile": "h100", "device_memory_gib": 80, "devices": tp},
            "parallelism": {"tp": tp},
            "inference": {
                "kv_cache_memory_bytes": memory,
                "block_size": block_size,
                "max_model_len": 4096,
                "tensor_parallel_size": tp,
            },
        }
    )


def vllm_spec(model: ModelArch, index: int, tp: int, block_size: int) -> object:
    """The spec vLLM's attention layer returns for layer ``index`` (``MLAAttention.get_kv_cache_spec``,
    ``Attention.get_kv_cache_spec``), from the model's own widths, not from the simulator's specs."""
    if model.mla is not None:
        return interface.MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, max_tp_shards=1, dtype=torch.bfloat16, cache_dtype_str="auto",
            head_size=model.mla.kv_lora_rank + model.mla.qk_rope_head_dim,
        )
    heads = max(1, model.num_kv_heads // tp)
    if model.layer_types[index] == "sliding_attention":
        return interface.SlidingWindowSpec(
            block_size=block_size, num_kv_heads=heads, head_size=model.head_dim, dtype=torch.bfloat16,
            sliding_window=model.sliding_window,
        )
    return interface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=model.head_dim, dtype=torch.bfloat16
    )


def vllm_config() -> SimpleNamespace:
    """The parts of a VllmConfig the grouping and sizing read (a layer-outer layout, vLLM's legacy NHD)."""
    cache = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBNHC,
        num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None,
    )
    return SimpleNamespace(
        cache_config=cache,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        model_config=SimpleNamespace(hf_config=SimpleNamespace(), max_model_len=4096),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )


def vllm_pool(model: ModelArch, tp: int, block_size: int, memory: int) -> tuple[dict, list, object]:
    specs = {f"model.layers.{i}.self_attn.attn": vllm_spec(model, i, tp, block_size) for i in range(model.num_layers)}
    config = vllm_config()
    groups = utils.get_kv_cache_groups(config, dict(specs))
    return specs, groups, utils.get_kv_cache_config_from_groups(config, groups, memory)


@pytest.mark.parametrize(
    ("name", "tp"), [("glm-4.7-flash", 1), ("glm-4.7-flash", 4), ("deepseek-v3", 8), ("gpt-oss-120b", 1), ("gpt-oss-20b", 2)]
)
def test_pages_groups_and_blocks_are_vllms(name: str, tp: int) -> None:
    model, e = load(name), endpoint(tp)
    specs, groups, config = vllm_pool(model, tp, 16, e.inference.kv_cache_memory_bytes)
    ours = layer_cache_specs(e, model)
    assert [16 * s.token_bytes for s in ours] == [s.page_size_bytes for s in specs.values()]
    cache = layout(e, model)
    assert len(cache.groups) == len(groups)
    assert sorted(g.layers for g in cache.groups) == sorted(len(g.layer_names) for g in groups)
    assert cache.bytes_per_block == utils._get_kv_cache_bytes_per_block(groups, KVCacheLayout.LBNHC)
    assert kv_cache_size(e, model).num_blocks == config.num_blocks


def test_an_mla_page_is_one_latent_vector_per_token_on_every_rank() -> None:
    """GLM-4.7-Flash: 512 + 64 = 576 values per token and layer, whatever TP (vLLM's max_tp_shards=1), against 20
    heads x 2 x 256 = 10,240 for the MHA the old reader built: 17.8x less cache per token."""
    model = load("glm-4.7-flash")
    for tp in (1, 2, 4):
        cache = layout(endpoint(tp), model)
        assert cache.page_bytes == 16 * 576 * BF16 == vllm_spec(model, 0, tp, 16).page_size_bytes
        assert [g.layers for g in cache.groups] == [47]


def test_gpt_oss_window_groups_halve_the_blocks_the_scheduler_sees() -> None:
    """Two groups (sliding and full, 12 layers each) share the pool: a request takes a block in each per 16 tokens
    (the window group's stop growing at its window in vLLM; the scheduler model counts them like the full group's)."""
    model = load("gpt-oss-20b")
    size = kv_cache_size(endpoint(), model)
    _, groups, config = vllm_pool(model, 1, 16, 8 * 2**30)
    assert size.num_blocks == config.num_blocks and size.attention_groups == len(groups) == 2
    assert size.sequence_blocks == (config.num_blocks - 1) // 2
    window = [g for g in layout(endpoint(), model).groups if g.spec.kind == "sliding_window"][0]
    assert window.spec.blocks_for(4096, 16) == -(-(128 - 1) // 16) + 1 < 4096 // 16

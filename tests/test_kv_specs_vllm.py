"""vLLM's KV cache for the modelled families, as the installed vLLM computes it: each layer's ``KVCacheSpec`` (its
page size), the KV cache groups (``get_kv_cache_groups``) and the pool's blocks for a memory budget
(``get_kv_cache_config_from_groups``), called on vLLM's own code and compared with ``kv_specs`` and
``kv_cache.kv_cache_size``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from skyrl_sim.api import Endpoint, ModelArch
from skyrl_sim.schema.architecture import from_hf_config
from skyrl_sim_plugins.sim.service.inference import kv_specs
from skyrl_sim_plugins.sim.service.inference.kv_cache import kv_cache_size

torch = pytest.importorskip("torch")
interface = pytest.importorskip("vllm.v1.kv_cache_interface")
utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

CONFIGS = Path(__file__).parent.parent / "scenarios" / "models"
DTYPES = {2: torch.bfloat16, 4: torch.float32}


def load(name: str) -> ModelArch:
    return from_hf_config(json.loads((CONFIGS / name / "config.json").read_text()), name)


def vllm_spec(spec: kv_specs.LayerCacheSpec) -> object:
    """The spec vLLM's attention layer returns for this layer (``MLAAttention.get_kv_cache_spec``,
    ``Attention.get_kv_cache_spec``)."""
    dtype = DTYPES[spec.dtype_bytes]
    if spec.kind == "mla_attention":
        return interface.MLAAttentionSpec(
            block_size=spec.block_size, num_kv_heads=1, max_tp_shards=1, head_size=spec.head_size, dtype=dtype,
            cache_dtype_str="auto",
        )
    if spec.kind == "sliding_window":
        return interface.SlidingWindowSpec(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            head_size_v=spec.head_size_v, dtype=dtype, sliding_window=spec.sliding_window,
        )
    return interface.FullAttentionSpec(
        block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        head_size_v=spec.head_size_v, dtype=dtype,
    )


def vllm_config(num_gpu_blocks_override: int | None = None) -> SimpleNamespace:
    """The parts of a VllmConfig the grouping and sizing read (a layer-outer layout, vLLM's legacy NHD)."""
    cache = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBNHC,
        num_gpu_blocks_override=num_gpu_blocks_override,
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


def vllm_pool(model: ModelArch, block_size: int, tp: int, dtype: int, memory: int) -> tuple[list, object]:
    specs = {}
    for index in range(model.num_layers):
        spec = kv_specs.layer_spec(model, index, block_size, tp, dtype)
        if spec is not None:
            specs[f"model.layers.{index}.self_attn.attn"] = vllm_spec(spec)
    config = vllm_config()
    groups = utils.get_kv_cache_groups(config, dict(specs))
    return groups, utils.get_kv_cache_config_from_groups(config, groups, memory)


@pytest.mark.parametrize(
    ("name", "tp"), [("glm-4.7-flash", 1), ("glm-4.7-flash", 4), ("deepseek-v3", 8), ("gpt-oss-120b", 1), ("gpt-oss-20b", 2)]
)
def test_pages_groups_and_blocks_are_vllms(name: str, tp: int) -> None:
    model, block_size, dtype, memory = load(name), 16, 2, 40 * 2**30
    ours = kv_specs.kv_cache_groups(model, block_size, tp, dtype)
    groups, config = vllm_pool(model, block_size, tp, dtype, memory)
    assert len(ours) == len(groups)
    for mine, theirs in zip(ours, groups, strict=True):
        assert mine.spec.page_size_bytes == theirs.kv_cache_spec.page_size_bytes
        assert [f"model.layers.{i}.self_attn.attn" for i in mine.layers] == theirs.layer_names
    assert memory // kv_specs.bytes_per_block(ours) == config.num_blocks


def test_an_mla_page_is_one_latent_vector_per_token_on_every_rank() -> None:
    """GLM-4.7-Flash: 512 + 64 = 576 values per token and layer, whatever TP (vLLM's max_tp_shards=1), against 20
    heads x 2 x 256 = 10,240 for the MHA the old reader built: 17.8x less cache per token."""
    model = load("glm-4.7-flash")
    for tp in (1, 2, 4):
        (group,) = kv_specs.kv_cache_groups(model, 16, tp, 2)
        assert group.spec.page_size_bytes == 16 * 576 * 2 == vllm_spec(group.spec).page_size_bytes
        assert len(group.layers) == 47


def test_the_endpoints_kv_cache_uses_the_groups() -> None:
    """kv_cache_size on an MLA endpoint: the bytes per block vLLM's code gives and its block count for an explicit
    cache size; gpt-oss's two groups halve the blocks the scheduler sees per request."""
    for name, groups in (("glm-4.7-flash", 1), ("gpt-oss-20b", 2)):
        endpoint = Endpoint.model_validate(
            {
                "name": "e",
                "model": "tiny-dense",
                "hardware": {"profile": "h100", "device_memory_gib": 80, "devices": 1},
                "inference": {"kv_cache_memory_bytes": 8 * 2**30, "block_size": 16, "max_model_len": 4096},
            }
        )
        model = load(name)
        size = kv_cache_size(endpoint, model)
        _, config = vllm_pool(model, 16, 1, 2, 8 * 2**30)
        assert size.num_blocks == config.num_blocks and size.groups == groups
        assert size.sequence_blocks == (config.num_blocks - 1) // groups

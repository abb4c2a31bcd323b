"""The per-layer cache specs and the hybrid layout (``sim.service.inference.kv_specs``) against the installed vLLM's
own code, called in this process: its state shape and dtype calculators, its ``KVCacheSpec`` page sizes, its hybrid
block-size alignment (``Platform._align_hybrid_block_size`` on a ``VllmConfig`` built from Qwen3-Next's public
``config.json``), its layer grouping and its block count (``get_kv_cache_config_from_groups``)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from skyrl_sim_plugins.sim.service.inference import kv_specs
from skyrl_sim_plugins.sim.service.inference.vllm_startup import mamba_blocks_message

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.config import CacheConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.config.compilation import CompilationConfig  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: E402

QWEN3_NEXT = Path(__file__).parent / "data" / "hf_configs" / "qwen3-next-80b-a3b"
DTYPES = {4: torch.float32, 2: torch.bfloat16}
# (tp, k heads, v heads, k dim, v dim, kernel): Qwen3-Next-80B-A3B, Qwen3.6-27B, Qwen3.6-35B-A3B, a tiny hybrid
GDN = [(1, 16, 32, 128, 128, 4), (2, 16, 48, 128, 128, 4), (4, 16, 32, 128, 128, 4), (1, 2, 4, 32, 32, 4)]


@pytest.mark.parametrize("dims", GDN)
def test_gated_deltanet_state_is_vllms(dims: tuple[int, ...]) -> None:
    ours = kv_specs.gated_deltanet_state_shapes(*dims)
    conv, recurrent = MambaStateShapeCalculator.gated_delta_net_state_shape(*dims)
    assert sorted(ours[0]) == sorted(conv)  # vLLM orients the conv state either way: the same bytes
    assert ours[1] == tuple(recurrent)
    for ssm in ("auto", "float32", "bfloat16"):
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", ssm)
        theirs = MambaSpec(block_size=16, shapes=(conv, recurrent), dtypes=dtypes).page_size_bytes
        sizes = [dtypes[0].itemsize, dtypes[1].itemsize]
        assert kv_specs.mamba_spec(ours, sizes).page_bytes(16) == theirs


@pytest.mark.parametrize(("heads", "head_size", "block"), [(2, 256, 16), (4, 256, 784), (1, 32, 128), (8, 128, 16)])
def test_attention_page_is_vllms(heads: int, head_size: int, block: int) -> None:
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    assert kv_specs.attention_spec(heads, head_size, 2).page_bytes(block) == spec.page_size_bytes


def vllm_config(tp_block: int, ssm: str) -> VllmConfig:
    model = ModelConfig(model=str(QWEN3_NEXT), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=tp_block))
    config.cache_config.mamba_ssm_cache_dtype = ssm  # the CPU platform may reset it; set what this test compares
    return config


@pytest.mark.parametrize("block_size", [16, 64, 128, 2048])
@pytest.mark.parametrize("ssm", ["float32", "bfloat16"])
def test_hybrid_block_size_is_vllms(block_size: int, ssm: str) -> None:
    """vLLM's own alignment on Qwen3-Next's public config (the CPU attention backend, kernel blocks of 32)."""
    config = vllm_config(block_size, ssm)
    Platform._align_hybrid_block_size(config, CPUAttentionBackend)
    shapes = kv_specs.gated_deltanet_state_shapes(1, 16, 32, 128, 128, 4)
    mamba = kv_specs.mamba_spec(shapes, [2, 4 if ssm == "float32" else 2])
    attention = kv_specs.attention_spec(2, 256, 2)
    layout = kv_specs.cache_layout([attention, mamba, mamba, mamba], block_size, 32, 32)
    assert layout.block_size == config.cache_config.block_size
    padded = config.cache_config.mamba_page_size_padded
    assert layout.page_bytes == (padded if padded is not None else mamba.state_bytes)
    assert layout.mamba_page_unpadded == mamba.state_bytes


def vllm_specs(pattern: list[str], block_size: int, page: int) -> dict[str, object]:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 2, 4, 32, 32, 4)
    specs: dict[str, object] = {}
    for i, kind in enumerate(pattern):
        if kind == "a":
            specs[f"layers.{i}"] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=page // (block_size * 2 * 64 * 2), head_size=64, dtype=torch.bfloat16
            )
        else:
            specs[f"layers.{i}"] = MambaSpec(
                block_size=block_size, shapes=shapes, dtypes=(torch.bfloat16, torch.float32), page_size_padded=page
            )
    return specs


@pytest.mark.parametrize(
    "pattern",
    [
        ["m", "m", "m", "a"] * 16,  # Qwen3.6-27B
        ["m", "m", "m", "a"] * 12,  # Qwen3-Next
        ["a"] * 10 + ["m"] * 14,  # under 1.5x: the largest bucket sets the group size
        ["a"] * 4 + ["m"] * 9,  # over 1.5x: padded groups
        ["a"] * 6,
    ],
)
def test_groups_and_blocks_are_vllms(pattern: list[str]) -> None:
    block_size = 256
    page = block_size * 2 * 64 * 2 * 2  # two KV heads of 64: every layer's page (the mamba page padded to it)
    specs = vllm_specs(pattern, block_size, page)
    groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(specs)
    config = VllmConfig()
    config.cache_config.kv_cache_layout = "LBNHC"
    memory = 3 * 2**30 + 12_345
    theirs = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, memory)

    token_bytes = 2 * (64 + 64) * 2
    ours_specs = [
        kv_specs.attention_spec(2, 64, 2) if kind == "a" else kv_specs.LayerCacheSpec("mamba", state_bytes=page // 3)
        for kind in pattern
    ]
    layout = kv_specs.cache_layout(ours_specs, block_size, 32, 32)
    assert layout.page_bytes == block_size * token_bytes == page
    assert len(layout.groups) == len(groups)
    assert [g.layers for g in layout.groups] == [len(g.layer_names) for g in groups]
    assert layout.num_blocks(memory) == theirs.num_blocks


def test_mamba_refusal_is_vllms_message() -> None:
    source = inspect.getsource(CompilationConfig.resolve_cudagraph_mode_and_sizes)
    message = mamba_blocks_message(1024, 87)
    assert "exceeds available Mamba cache" in source and "Each decode sequence" in source
    assert message.startswith("max_num_seqs (1024) exceeds available Mamba cache blocks (87).")
    assert "lower max_num_seqs to at most 87" in message

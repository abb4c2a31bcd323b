"""vLLM's cache for a gated-DeltaNet hybrid as the simulator sizes it (``kv_cache.kv_cache_size`` over
``kv_specs``): the seed model's aligned block size, its groups and state blocks, vLLM's start-up check
(``vllm_startup``) that ``max_num_seqs`` fits the mamba blocks under CUDA graphs, and a dense model's cache unchanged.
(``tests/test_kv_specs_vllm.py`` holds the specs to vLLM's own code; ``tests/real/test_vllm_scheduler_oracle.py``
the state blocks' scheduling to vLLM's scheduler.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim_plugins.sim.service.inference.kv_cache import kv_cache_size
from skyrl_sim_plugins.sim.service.inference.vllm_startup import vllm_start

GIB = 2**30


def endpoint(model: Any, profile: str = "h200", **inference: object) -> Endpoint:
    return Endpoint.model_validate(
        {
            "name": "t",
            "model": model,
            "hardware": {"profile": profile, "device_memory_gib": 139.8, "reserve_gib": 1.8, "devices": 1},
            "parallelism": {"tp": 1},
            "inference": inference,
        }
    )


def test_the_seed_models_block_holds_a_deltanet_state() -> None:
    """Qwen3.6-27B at TP 1: a DeltaNet layer's state is the conv state [3, 10,240] bf16 and the recurrent state
    [48, 128, 128] fp32 (3,207,168 bytes); an attention token is K and V of 4 heads of 256 (4,096 bytes), so the
    block grows from 16 to 16 x ceil(3,207,168 / 65,536) = 784 tokens, and the 48 DeltaNet layers make 3 groups of
    16 beside the 16 attention layers: every sequence holds 3 state blocks."""
    e = endpoint("qwen3.6-27b", kv_cache_memory_bytes=60 * GIB)
    size = kv_cache_size(e, resolve_model(e.model, Path(".")))
    assert size.block_size == 784
    assert size.bytes_per_block == 16 * 784 * 4096
    assert (size.layer_groups, size.state_blocks_per_sequence) == (4, 3)
    assert size.num_blocks == 60 * GIB // size.bytes_per_block
    assert size.tokens == (size.num_blocks - 1 - 3) * 784


def test_a_bf16_state_halves_the_page() -> None:
    e = endpoint("qwen3.6-27b", kv_cache_memory_bytes=60 * GIB, mamba_ssm_cache_dtype="bfloat16")
    size = kv_cache_size(e, resolve_model(e.model, Path(".")))
    assert size.block_size == 16 * -(-(3 * 10240 * 2 + 48 * 128 * 128 * 2) // (16 * 4096))  # 400


def test_max_num_seqs_past_the_mamba_blocks_refuses_to_start() -> None:
    """SkyRL's default max_num_seqs (1024) and a cache of fewer blocks: vLLM's start fails at its CUDA graphs (the pool
    of 104 blocks, its null block counted as vLLM counts it); enforce_eager, a CPU engine, or max_num_seqs within the
    blocks start."""
    model = resolve_model("qwen3.6-27b", Path("."))
    # max_model_len 8,192: 104 blocks cannot hold one request of the model's 262,144 tokens, refused before the graphs
    small = {"kv_cache_memory_bytes": 5 * GIB, "max_model_len": 8192}
    start = vllm_start(endpoint("qwen3.6-27b", **small), model)
    failure = start.first_failure(start.total - start.context)
    assert start.kv is not None and start.kv.num_blocks == 104
    assert failure is not None and (failure.step, failure.check) == ("cuda_graphs", "mamba_cache_blocks")
    assert failure.message.startswith("max_num_seqs (1024) exceeds available Mamba cache blocks (104).")
    assert not vllm_start(endpoint("qwen3.6-27b", enforce_eager=True, **small), model).mamba_blocks_short
    assert not vllm_start(endpoint("qwen3.6-27b", max_num_seqs=104, **small), model).mamba_blocks_short
    assert vllm_start(endpoint("qwen3.6-27b", max_num_seqs=105, **small), model).mamba_blocks_short


def test_a_dense_models_cache_is_unchanged() -> None:
    e = endpoint("qwen3-8b", kv_cache_memory_bytes=10 * GIB)
    size = kv_cache_size(e, resolve_model(e.model, Path(".")))
    assert (size.block_size, size.state_blocks_per_sequence, size.layer_groups) == (16, 0, 0)
    assert size.bytes_per_block == 36 * 2 * 16 * 8 * 128 * 2
    assert "layer_groups" not in size.as_dict()

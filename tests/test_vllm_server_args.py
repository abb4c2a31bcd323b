"""The vLLM server the real backend starts: the endpoint's ``inference`` section as vLLM's own arguments."""

from __future__ import annotations

import os
from pathlib import Path

from skyrl_sim.schema.inference import Inference
from skyrl_sim_plugins.megatron_vllm.vllm_server import VllmServer, inference_arguments


def test_every_setting_becomes_vllms_argument() -> None:
    args, env = inference_arguments(
        Inference(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            block_size=32,
            num_gpu_blocks_override=48,
            kv_cache_memory_bytes=2**30,
            max_model_len=1024,
            enable_prefix_caching=False,
            model_dtype="float32",
        )
    )
    pairs = dict(zip(args[::1], args[1:], strict=False))
    assert pairs["--max-num-seqs"] == "8" and pairs["--max-num-batched-tokens"] == "64"
    assert pairs["--block-size"] == "32" and pairs["--num-gpu-blocks-override"] == "48"
    assert pairs["--kv-cache-memory-bytes"] == str(2**30) and pairs["--max-model-len"] == "1024"
    assert pairs["--dtype"] == "float32"
    assert "--no-enable-prefix-caching" in args and "--enable-chunked-prefill" in args
    assert env == {"VLLM_CPU_KVCACHE_SPACE": None}  # it would override the explicit size on the CPU backend


def test_an_unset_setting_is_left_to_vllm_and_an_unset_variable_is_removed(tmp_path: Path, monkeypatch) -> None:
    args, env = inference_arguments(Inference())
    assert "--block-size" not in args and "--kv-cache-memory-bytes" not in args and env == {}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    server = VllmServer(tmp_path, tmp_path, env={"VLLM_CPU_KVCACHE_SPACE": None, "EXTRA": "1"})
    environment = server.environment()
    assert "VLLM_CPU_KVCACHE_SPACE" not in environment and environment["EXTRA"] == "1"
    assert environment["HF_HUB_OFFLINE"] == os.environ.get("HF_HUB_OFFLINE", "1")

"""Model shapes several tests size vLLM's start with, one definition each."""

from __future__ import annotations

from typing import Any

QWEN3_06B: dict[str, Any] = {
    "preset": "qwen3-8b",
    "name": "qwen3-0.6b",
    "hidden_size": 1024,
    "ffn_hidden_size": 3072,
    "num_layers": 28,
    "num_attention_heads": 16,
    "num_kv_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tied_embeddings": True,
}
"""Qwen3-0.6B's config (``Qwen/Qwen3-0.6B``) over the qwen3-8b preset: the small model of SkyRL PR #2051's L4 case."""

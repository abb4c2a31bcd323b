"""Run by ``tests/test_lora_slots.py`` in a process of its own: builds vLLM's own linear, embedding and logits layers on
the meta device (no memory, no GPU), wraps each in the LoRA layer vLLM's model manager picks for it, calls its
``create_lora_weights`` and prints, as JSON, the bytes of the stacked A and B buffers each makes.

Input (argv[1], JSON): ``{"port": N, "max_loras": L, "rank": r, "modules": [[name, kind, args], ...]}`` with kind
``qkv`` (hidden, head_dim, heads, kv_heads: ``MergedQKVParallelLinearWithLoRA``), ``merged`` (input, output sizes:
``MergedColumnParallelLinearWithLoRA``), ``column`` (input, output: ``ColumnParallelLinearWithLoRA``), ``row``
(input, output: ``RowParallelLinearWithLoRA``), ``embedding`` (vocab, hidden: ``VocabParallelEmbeddingWithLoRA``),
``logits`` (vocab, hidden: ``LogitsProcessorWithLoRA``); output: ``{module: bytes}``. vLLM's process group is a
one-rank gloo group; the LoRA dtype is bf16, as ``"auto"`` resolves for a bf16 model.
"""

from __future__ import annotations

import json
import sys

import torch


def stacked_bytes(layer: object) -> int:
    total = 0
    for attr in ("lora_a_stacked", "lora_b_stacked"):
        value = getattr(layer, attr)
        for tensor in value if isinstance(value, tuple) else (value,):
            total += int(tensor.numel() * tensor.element_size())
    return total


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm.config import LoRAConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.lora.layers import (
        ColumnParallelLinearWithLoRA,
        LogitsProcessorWithLoRA,
        MergedColumnParallelLinearWithLoRA,
        MergedQKVParallelLinearWithLoRA,
        RowParallelLinearWithLoRA,
        VocabParallelEmbeddingWithLoRA,
    )
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    config = LoRAConfig(max_lora_rank=spec["rank"], max_loras=spec["max_loras"], lora_dtype=torch.bfloat16)
    out: dict[str, int] = {}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{spec['port']}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1)
        for name, kind, args in spec["modules"]:
            with torch.device("meta"):
                layer: object
                if kind == "qkv":
                    base = QKVParallelLinear(args[0], args[1], args[2], args[3], bias=False, prefix=name)
                    layer = MergedQKVParallelLinearWithLoRA(base)
                elif kind == "merged":
                    base = MergedColumnParallelLinear(args[0], args[1], bias=False, prefix=name)
                    layer = MergedColumnParallelLinearWithLoRA(base)
                elif kind == "column":
                    base = ColumnParallelLinear(args[0], args[1], bias=False, prefix=name)
                    layer = ColumnParallelLinearWithLoRA(base)
                elif kind == "row":
                    base = RowParallelLinear(args[0], args[1], bias=False, prefix=name)
                    layer = RowParallelLinearWithLoRA(base)
                elif kind == "embedding":
                    layer = VocabParallelEmbeddingWithLoRA(VocabParallelEmbedding(args[0], args[1]))
                else:
                    layer = LogitsProcessorWithLoRA(LogitsProcessor(args[0]), args[1], torch.bfloat16,
                                                    torch.device("meta"), None)
                layer.create_lora_weights(spec["max_loras"], config)  # type: ignore[attr-defined]
            out[name] = stacked_bytes(layer)
    print("LORA-LAYERS " + json.dumps(out))


if __name__ == "__main__":
    main()

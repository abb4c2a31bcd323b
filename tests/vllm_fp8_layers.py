"""Run by ``tests/test_fp8_weights.py`` in a process of its own: builds vLLM's own linear layers with an ``Fp8Config``
on the meta device (no memory, no GPU) and prints, as JSON, the bytes of every parameter each registers
(``Fp8LinearMethod.create_weights``, ``Fp8MoEMethod.create_weights``).

Input (argv[1], JSON): ``{"port": N, "cases": [{"quantization_config": {...}, "modules": [[name, kind, args], ...]},
...]}`` with kind ``merged`` (input, output sizes), ``row`` (input, output), ``qkv`` (hidden, head_dim, heads,
kv_heads) or ``moe`` (experts, top_k, hidden, intermediate: ``FusedMoEFactory``'s routed experts); output: one
``{module: {parameter: [bytes, dtype]}}`` per case. vLLM's process group is a one-rank gloo group; the model config
vLLM's FP8 methods read is its dtype alone (``Fp8LinearMethod.__init__`` reads ``model_config.dtype``), as no
checkpoint is loaded.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    vllm_config = VllmConfig()
    object.__setattr__(vllm_config, "model_config", SimpleNamespace(dtype=torch.bfloat16, is_moe=True))
    results = []
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{spec['port']}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1)
        for case in spec["cases"]:
            config = Fp8Config.from_config(case["quantization_config"])
            out: dict[str, dict[str, list[int | str]]] = {}
            for name, kind, args in case["modules"]:
                with torch.device("meta"):
                    if kind == "merged":
                        layer = MergedColumnParallelLinear(args[0], args[1], bias=False, quant_config=config, prefix=name)
                    elif kind == "moe":
                        experts, top_k, hidden, intermediate = args
                        layer = FusedMoEFactory(
                            num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=intermediate,
                            quant_config=config, prefix=f"case{len(results)}.{name}", params_dtype=torch.bfloat16,
                        )
                    elif kind == "row":
                        layer = RowParallelLinear(args[0], args[1], bias=False, quant_config=config, prefix=name)
                    else:
                        heads = (args[0], args[1], args[2], args[3])
                        layer = QKVParallelLinear(*heads, bias=False, quant_config=config, prefix=name)
                out[name] = {
                    param: [int(tensor.numel() * tensor.element_size()), str(tensor.dtype)]
                    for param, tensor in layer.named_parameters()
                }
            results.append(out)
    print("FP8-LAYERS " + json.dumps(results))


if __name__ == "__main__":
    main()

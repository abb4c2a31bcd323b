"""Run by ``tests/test_vision_weights.py`` in a process of its own: builds vLLM's own ``Qwen3_VisionTransformer``
(``vllm/model_executor/models/qwen3_vl.py``) on the meta device (no memory, no GPU) and prints, as JSON, the bytes of
every parameter it registers, per case.

Input (argv[1], JSON): ``{"port": N, "cases": [{"vision_config": {...}, "tp": N, "quantization_config": {...} |
null}, ...]}``; output: one ``{parameter: bytes}`` per case. vLLM's process group is a one-rank gloo group whose
recorded world size is set to the case's TP before the tower is built (the stand-in: every linear layer reads
``get_tensor_model_parallel_world_size()`` when it is built and nothing communicates on the meta device); the model
config vLLM's layers read is its dtype alone, as no checkpoint is loaded.
"""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import torch


def stand_in_torchvision() -> None:
    """The CPU stack has no torchvision (``docs/getting-started.md``), and ``qwen3_vl.py`` imports transformers'
    Qwen2-VL image processor at module level, which imports ``torchvision.transforms.v2.functional``. Only that
    preprocessor calls it (never the tower): an empty module lets the import pass; the tower is vLLM's own code."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        import transformers  # noqa: F401  (asks whether torchvision is installed before the stand-in exists)

        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
            sys.modules[name] = types.ModuleType(name)
        functional = types.ModuleType("torchvision.transforms.v2.functional")
        sys.modules[functional.__name__] = functional
        sys.modules["torchvision.transforms.v2"].functional = functional  # type: ignore[attr-defined]


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    stand_in_torchvision()
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    vllm_config = VllmConfig()
    object.__setattr__(vllm_config, "model_config", SimpleNamespace(dtype=torch.bfloat16, is_moe=False))
    results = []
    torch.set_default_dtype(torch.bfloat16)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{spec['port']}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1)
        for case in spec["cases"]:
            parallel_state.get_tp_group().world_size = case["tp"]
            quant = case["quantization_config"]
            config = Fp8Config.from_config(quant) if quant is not None else None
            vision_config = SimpleNamespace(hidden_act="gelu_pytorch_tanh", **case["vision_config"])
            with torch.device("meta"):
                tower = Qwen3_VisionTransformer(vision_config, norm_eps=1e-6, quant_config=config, prefix="model.visual")
            results.append(
                {name: int(t.numel() * t.element_size()) for name, t in tower.named_parameters()}
            )
    print("VISION-TOWER " + json.dumps(results))


if __name__ == "__main__":
    main()

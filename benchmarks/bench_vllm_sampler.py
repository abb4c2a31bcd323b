"""vLLM sampler costs on this machine: server start, first and steady generate latency, restart on a new checkpoint.

Usage: ``.venv/bin/python benchmarks/bench_vllm_sampler.py [--prompts 8] [--prompt-len 64] [--max-tokens 32]``.
Prints numbers; asserts nothing (speed is measured here, never in tests).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from skyrl_sim.schema.architecture import PRESETS
from skyrl_sim_plugins.megatron_vllm.hf_export import init_hf_weights, write_checkpoint
from skyrl_sim_plugins.megatron_vllm.sampler import VllmSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny-dense")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-samples", type=int, default=2)
    args = parser.parse_args()
    arch = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a = write_checkpoint(init_hf_weights(arch, 1), arch, root / "a", torch.float32)
        b = write_checkpoint(init_hf_weights(arch, 2), arch, root / "b", torch.float32)
        prompts = [[(7 * i + k) % arch.vocab_size for k in range(args.prompt_len)] for i in range(args.prompts)]
        with VllmSampler(root / "work", startup_timeout_s=600) as sampler:
            for label, ckpt in (("first start", a), ("restart (new checkpoint)", b)):
                began = time.perf_counter()
                sampler.sample(ckpt, prompts, args.max_tokens, args.num_samples, seed=0, temperature=1.0)
                total = time.perf_counter() - began
                print(f"{label}: server start {sampler.start_seconds[-1]:.1f} s, start + first call {total:.1f} s")
            for temperature in (0.0, 1.0):
                began = time.perf_counter()
                sampler.sample(b, prompts, args.max_tokens, args.num_samples, seed=1, temperature=temperature)
                elapsed = time.perf_counter() - began
                tokens = args.prompts * args.num_samples * args.max_tokens
                print(
                    f"steady call, temperature {temperature}: {elapsed:.2f} s for {args.prompts} prompts x "
                    f"{args.num_samples} samples x {args.max_tokens} tokens ({tokens / elapsed:.0f} tokens/s)"
                )


if __name__ == "__main__":
    main()

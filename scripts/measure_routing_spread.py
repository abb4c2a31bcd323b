"""Measure how the real backend's routers spread a call's tokens over the experts when nothing replays routes.

Builds the real backend's model of an MoE endpoint (``model_builder.build_gpt_model``: the same seeded base weights,
megatron-core's local MoE layer, its fp32 ``TopKRouter``) in one CPU process, runs each ``forward_backward`` call of a
scenario forward over the call's rows (the same synthetic token ids, ``batch.datum_tokens``), and counts the tokens
each router sends to each expert, per MoE layer and per call. It prints, per call and over all of them:

* ``busiest_expert_load``: the busiest expert's tokens over the even share (``tokens x top_k / experts``), the largest
  over the layers;
* ``busiest_rank_share`` at the endpoint's EP: the busiest rank's (``experts / ep`` consecutive experts) share of the
  token-expert pairs over its even share ``1 / ep``.

The routing depends only on the tokens and the weights, so one process measures what every EP layout routes.

    .venv/bin/python scripts/measure_routing_spread.py --endpoint tiny-moe-cpu-ep2 scenarios/moe_r3_tiny_ep2.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def load_model(arch: Any, seed: int, longest: int) -> Any:
    """The real backend's base model of ``arch`` in this process (gloo, one rank)."""
    from megatron.core import parallel_state, tensor_parallel

    from skyrl_sim_plugins.megatron_vllm.cpu_shims import apply_cpu_shims
    from skyrl_sim_plugins.megatron_vllm.model_builder import build_gpt_model
    from skyrl_sim_plugins.megatron_vllm.single_rank import init_single_rank_group

    init_single_rank_group()
    apply_cpu_shims()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_gpt_model(arch, seed, torch.float32, longest, attention="flash")


def count_routes(model: Any) -> list[torch.Tensor]:
    """Hooks each router to add its routing map's tokens per expert to a counter (one per MoE layer)."""
    from megatron.core.transformer.moe.router import TopKRouter

    counters: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            counter = torch.zeros(module.config.num_moe_experts, dtype=torch.int64)
            counters.append(counter)

            def hook(_: Any, __: Any, output: Any, counter: torch.Tensor = counter) -> None:
                counter += output[1].sum(dim=0).to(torch.int64)  # (probs, routing_map [tokens, experts])

            module.register_forward_hook(hook)
    return counters


def spread(counters: list[torch.Tensor], top_k: int, ep: int) -> tuple[float, float]:
    """(busiest expert load, busiest rank share) over the layers, each over its even share."""
    expert, rank = 0.0, 0.0
    for counts in counters:
        total = int(counts.sum())
        if not total:
            continue
        experts = counts.numel()
        expert = max(expert, float(counts.max()) * experts / total)
        per_rank = counts.view(ep, experts // ep).sum(dim=1)
        rank = max(rank, float(per_rank.max()) * ep / total)
    return expert, rank


def main(argv: list[str] | None = None) -> int:
    from skyrl_sim.schema.scenario import load_scenario
    from skyrl_sim_plugins.megatron_vllm.batch import datum_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", type=Path)
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    scenario = load_scenario(args.scenario, args.endpoint)
    variant = scenario.resolve(next(iter(scenario.scenario.variants)))
    arch, endpoint = variant.model, variant.endpoint
    assert arch.moe is not None, "an MoE endpoint"
    requests = [
        list(p.datums)
        for i in range(len(variant.workload.clients))
        for p in variant.client_requests(i)
        if p.spec.type == "forward_backward"
    ]
    longest = max(max(r) for r in requests) + 1
    model = load_model(arch, args.seed, longest)
    counters = count_routes(model)
    results = []
    with torch.no_grad():
        for index, lengths in enumerate(requests):
            for counter in counters:
                counter.zero_()
            for length in lengths:
                tokens = torch.from_numpy(datum_tokens(args.seed, length, arch.vocab_size)[:-1]).view(1, -1)
                positions = torch.arange(tokens.shape[1]).view(1, -1)
                model(tokens, positions, None)
            expert, rank = spread(counters, arch.moe.top_k, endpoint.parallelism.ep)
            results.append((expert, rank))
            print(f"call {index} ({len(lengths)} rows of {max(lengths)}): busiest expert load "
                  f"{expert:.3f}, busiest rank share at ep {endpoint.parallelism.ep} {rank:.3f}")
    print(f"over the calls: busiest expert load {max(e for e, _ in results):.3f}, "
          f"busiest rank share {max(r for _, r in results):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A seeded synthetic multi-tenant workload, shared by the scale benchmark and the result-identity test.

``TENANTS`` clients, each its own LoRA model on the seed's Qwen3.6-27B H200 TP-4 endpoint (with the request-count cap
and cap-aware padding, the fix the seed describes), submitting training steps at fixed times: a forward_backward of
1-4 datums (512-8,192 tokens each), an optim_step after every ``STEP`` of them, and now and then a
save_weights_for_sampler followed by a sample. Arrivals are spread so the engine stays busy without an unbounded
backlog. Lengths come from a seeded RNG: every call with the same arguments builds the same workload.
"""

from __future__ import annotations

import random
from typing import Any

from skyrl_sim.schema.shipped import REPOSITORY

ROOT = REPOSITORY
ENDPOINT = str(ROOT / "scenarios" / "endpoints" / "qwen3.6-27b-h200-tp4.yaml")
TENANTS = 20
STEP = 4
SAMPLE_EVERY = 40
VARIANT = "capped"


def tenant_requests(
    rng: random.Random, count: int, name: str, samples: bool = True
) -> tuple[list[dict[str, Any]], list[float]]:
    """``count`` requests of one tenant and their submission times (seconds after the tenant starts); without
    ``samples``, training requests only (the same passes, lengths and times, no sampler saves or samples)."""
    requests: list[dict[str, Any]] = []
    times: list[float] = []
    t = 0.0
    passes = 0
    while len(requests) < count:
        datums = [rng.randint(512, 8192) for _ in range(rng.randint(1, 4))]
        requests.append({"type": "forward_backward", "datums": datums})
        passes += 1
        t += rng.uniform(40.0, 80.0)
        times.append(t)
        if len(requests) < count and passes % STEP == 0:
            requests.append({"type": "optim_step"})
            times.append(t + 0.01)
        if samples and len(requests) + 1 < count and passes % SAMPLE_EVERY == 0:
            checkpoint = f"{name}-{passes}"
            requests.append({"type": "save_weights_for_sampler", "checkpoint": checkpoint})
            times.append(t + 0.02)
            requests.append({"type": "sample", "checkpoint": checkpoint, "prompt_tokens": 512, "max_tokens": 256})
            times.append(t + 0.03)
    return requests[:count], times[:count]


def multi_tenant_document(total: int, seed: int = 0, endpoint: str = ENDPOINT, samples: bool = True) -> dict[str, Any]:
    """A scenario document (the mapping a scenario file holds) of ``total`` requests over ``TENANTS`` tenants; without
    ``samples``, a training-only workload (``tenant_requests``)."""
    rng = random.Random(seed)
    clients = []
    for i in range(TENANTS):
        share = total // TENANTS + (1 if i < total % TENANTS else 0)
        name = f"tenant-{i}"
        requests, times = tenant_requests(rng, share, name, samples)
        clients.append(
            {
                "name": name,
                "model_id": name,
                "start_s": round(rng.uniform(0, 5), 3),
                "submit": {"mode": "at_times", "gap_s": 0.005, "times_s": times},
                "requests": requests,
            }
        )
    return {
        "name": f"multi_tenant_{total}" if samples else f"multi_tenant_training_{total}",
        "endpoint": endpoint,
        "workload": {"clients": clients},
        "variants": {
            VARIANT: {
                "set": {"engine.forward_backward_max_request_count": 8, "engine.cap_aware_padding": True},
                "expect": {"all_completed": True},
            }
        },
    }

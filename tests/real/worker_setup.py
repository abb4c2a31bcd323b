"""Training workers for the real-backend tests: one tiny variant's endpoint and model, 512-token rows, no memory
limit, timeouts generous enough for a loaded 2-core machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from skyrl_sim.schema.variant import ResolvedVariant
from skyrl_sim_plugins.megatron_vllm.backend import worker_endpoint
from skyrl_sim_plugins.megatron_vllm.workers import WorkerGroup


def worker_group(variant: ResolvedVariant, run_dir: Path, seed: int = 5, model_ids: Sequence[str] = ("m",)) -> WorkerGroup:
    """The workers of ``variant``'s endpoint (one rank per tensor-parallel rank), not started until entered."""
    config = {
        "endpoint": worker_endpoint(variant.endpoint),
        "arch": dataclasses.asdict(variant.model),
        "seed": seed,
        "model_ids": list(model_ids),
        "max_sequence_length": 512,
        "memory_limit_bytes": None,
        "idle_timeout_s": 600,
    }
    return WorkerGroup(config, variant.endpoint.parallelism.tp, run_dir, startup_timeout_s=240, call_timeout_s=240)

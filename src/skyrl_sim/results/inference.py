"""What a run's ``inference`` section says, in the numbers two backends can be compared on.

``RunResult.inference`` holds the vLLM side of a run: the sampling mode, the KV cache (``kv_cache``: ``num_blocks``
and ``usable_blocks``, the simulator's sizing or vLLM's ``cache_config_info``), and per engine (``engines``) the
counters vLLM exports (``preemptions``, prompt and generation tokens, prefix-cache hits) and a ``timeline`` (``t``,
``running``, ``waiting``, ``kv_usage``, ``preemptions``, ``kv_blocks``). The simulator writes it from its model
(``skyrl_sim_plugins.sim.service.inference.vllm_sampler``), the real backend from the server's ``/metrics``
(``skyrl_sim_plugins.megatron_vllm.vllm_metrics``). Per sample, ``RequestRecord.outputs["vllm"]`` holds when it was
sent to vLLM and when it finished (the simulator also: scheduled, first token, preemptions).
"""

from __future__ import annotations

import statistics
from typing import Any

from skyrl_sim.results.result import RunResult


def inference_summary(result: RunResult) -> dict[str, Any] | None:
    """The run's vLLM numbers (None when no sample ran on vLLM): blocks, preemptions, the highest running and waiting
    counts and KV usage any engine reached, and the samples' latency (submission to result) median."""
    section = result.inference
    if not section:
        return None
    engines = section.get("engines", [])

    def peak(key: str) -> float | None:
        values = [v for e in engines for v in e.get("timeline", {}).get(key, [])]
        return max(values) if values else None

    latencies = sorted(
        r.completed_s - r.submitted_s
        for r in result.requests
        if r.type == "sample" and r.status == "completed" and r.completed_s is not None and r.submitted_s is not None
    )
    kv = section.get("kv_cache", {})
    return {
        "mode": section.get("mode"),
        "num_blocks": kv.get("num_blocks"),
        "preemptions": sum(int(e.get("preemptions") or 0) for e in engines),
        "running_max": peak("running"),
        "waiting_max": peak("waiting"),
        "kv_usage_max": peak("kv_usage"),
        "samples": len(latencies),
        "sample_latency_p50_s": statistics.median(latencies) if latencies else None,
    }


def preemptions_agree(model: int, reference: int) -> bool:
    """The validation target for preemption counts: within 2 or 10% of the reference, whichever is larger."""
    return abs(model - reference) <= max(2.0, 0.1 * reference)

"""Per-tenant numbers of a run and its adapter store's cost: one definition, read by ``run``, ``compare``, ``replay``
and the RunResult JSON (``summary["tenancy"]``).

- **Per tenant** (model id): requests, completed, failed, latency p50 / p95 (completed requests, submission to
  result), queue wait p95 (submission to the start of the call that ran it); the same definitions as the run's
  summary, over one model's requests.
- **Fairness**: the worst tenant's latency p95 over the best tenant's (1.0 is fair; None with fewer than two tenants
  that completed a request).
- **Swaps**: the adapter swaps the run's calls made (``CallRecord.extra["swap"]``: what was saved, what was restored,
  its bytes both ways and seconds), their time and its share of the engine's busy time.
- **Host memory**: one adapter slot's bytes per worker, the most the slots held at once (the pristine slot included)
  and the endpoint's ``tenancy.host_memory_gib`` (``RunResult.tenancy``, written by the backend).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from skyrl_sim.results.records import CallRecord, RequestTimes
from skyrl_sim.units import GIB

if TYPE_CHECKING:
    from skyrl_sim.schema.endpoint import Endpoint


class TenantRun(Protocol):
    """What ``tenancy_summary`` reads of a run: a ``result.RunResult`` (which builds its summary from this module,
    so this module names only what it reads)."""

    @property
    def calls(self) -> Sequence[CallRecord]: ...

    @property
    def tenancy(self) -> dict[str, Any]: ...

    def request_models(self) -> Iterable[str]: ...

    def request_times(self) -> Iterable[RequestTimes]: ...


def nearest_rank(values: list[float], q: float) -> float | None:
    """The ``q`` percentile of sorted ``values`` by the nearest rank (exact; None when empty)."""
    if not values:
        return None
    index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[index]


def tenant_rows(models: Iterable[str], times: Iterable[RequestTimes]) -> dict[str, dict[str, Any]]:
    """Per model id, in order of its first request: requests, completed, failed, latency p50/p95, queue wait p95."""
    latencies: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    counts: dict[str, list[int]] = {}
    for model, (submitted, started, completed, status) in zip(models, times, strict=True):
        count = counts.setdefault(model, [0, 0, 0])
        count[0] += 1
        count[1] += status == "completed"
        count[2] += status == "failed"
        if submitted is not None and completed is not None and status == "completed":
            latencies.setdefault(model, []).append(completed - submitted)
        if submitted is not None and started is not None:
            waits.setdefault(model, []).append(started - submitted)
    rows: dict[str, dict[str, Any]] = {}
    for model, (requests, done, failed) in counts.items():
        lat = sorted(latencies.get(model, []))
        wait = sorted(waits.get(model, []))
        rows[model] = {
            "requests": requests,
            "completed": done,
            "failed": failed,
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p95_s": nearest_rank(lat, 0.95),
            "queue_wait_p95_s": nearest_rank(wait, 0.95),
        }
    return rows


def fairness_p95(rows: dict[str, dict[str, Any]]) -> float | None:
    """The worst tenant's latency p95 over the best's (None with fewer than two tenants that completed something)."""
    p95 = [row["latency_p95_s"] for row in rows.values() if row["latency_p95_s"] is not None]
    if len(p95) < 2 or min(p95) <= 0:
        return None
    return max(p95) / min(p95)


def swap_totals(calls: Sequence[CallRecord]) -> dict[str, Any]:
    """The run's adapter swaps: how many, their bytes (both ways), their seconds, and that time's share of the
    engine's busy time (the calls' durations, the swaps inside them)."""
    swaps = [call.extra["swap"] for call in calls if call.extra.get("swap")]
    seconds = sum(float(s["seconds"]) for s in swaps)
    busy = sum(call.duration_s for call in calls)
    return {
        "swaps": len(swaps),
        "swap_bytes": sum(int(s["bytes"]) for s in swaps),
        "swap_s": seconds,
        "swap_share_of_engine": seconds / busy if busy else 0.0,
    }


def tenancy_section(endpoint: Endpoint, store: dict[str, Any]) -> dict[str, Any]:
    """``RunResult.tenancy``: the store's host memory as a backend measured or modelled it (``slot_bytes``,
    ``host_bytes_peak``), with the endpoint's host memory per worker (None: unlimited)."""
    limit = endpoint.tenancy.host_memory_gib
    return {**store, "host_memory_bytes": int(limit * GIB) if limit is not None else None}


def tenancy_summary(result: TenantRun) -> dict[str, Any]:
    """``summary["tenancy"]``: the per-tenant rows, fairness, swaps and host memory of one run."""
    rows = tenant_rows(result.request_models(), result.request_times())
    return {
        "tenants": rows,
        "fairness_p95": fairness_p95(rows),
        **swap_totals(result.calls),
        "slot_bytes": result.tenancy.get("slot_bytes"),
        "host_bytes_peak": result.tenancy.get("host_bytes_peak"),
        "host_memory_bytes": result.tenancy.get("host_memory_bytes"),
    }

"""Checks a RunResult against a variant's expectations; each unmet expectation becomes one readable line.

Nothing is met vacuously (``schema.expect`` says what each key means): an expectation with no completion key and no
OOM expected requires every request to complete, ``all_completed: false`` requires a request that did not, ``oom``
requires at least one call out of memory, and ``min_headroom_gib`` fails a run whose calls report no peak."""

from __future__ import annotations

from skyrl_sim.results.result import RunResult
from skyrl_sim.results.tenants import tenancy_summary
from skyrl_sim.schema.expect import Expectations
from skyrl_sim.units import GIB


def unmet(result: RunResult, expect: Expectations) -> list[str]:
    """The expectations this result does not meet (empty when it meets all of them)."""
    expect = expect.effective()
    problems: list[str] = []
    failed = result.failed
    completed = result.completed
    if expect.all_completed and (failed or len(completed) != len(result.requests)):
        first = min(failed, key=lambda r: r.id, default=None)
        why = f" (the first, request {first.id} {first.type}: {first.error})" if first is not None and first.error else ""
        problems.append(f"expected every request to complete; {len(failed)} failed{why}, {len(completed)} completed")
    if expect.all_completed is False and len(completed) == len(result.requests):
        problems.append(f"expected some request not to complete; all {len(completed)} completed")
    if expect.completed is not None and len(completed) != expect.completed:
        problems.append(f"expected {expect.completed} completed requests, got {len(completed)}")
    if expect.failed is not None and len(failed) != expect.failed:
        problems.append(f"expected {expect.failed} failed requests, got {len(failed)}")
    if expect.failed_requests is not None and sorted(r.id for r in failed) != sorted(expect.failed_requests):
        problems.append(f"expected failed requests {expect.failed_requests}, got {[r.id for r in failed]}")
    if expect.calls is not None and len(result.calls) != expect.calls:
        problems.append(f"expected {expect.calls} backend calls, got {len(result.calls)}")
    if expect.oom_calls is not None and len(result.oom_calls) != expect.oom_calls:
        problems.append(f"expected {expect.oom_calls} calls to run out of memory, got {len(result.oom_calls)}")
    if expect.padded_rows is not None:
        got = [c.padded_rows for c in result.calls if c.kind in ("forward_backward", "forward")]
        if got != expect.padded_rows:
            problems.append(f"expected padded rows {expect.padded_rows}, got {got}")
    if expect.oom is not None:
        if not result.oom_calls:
            problems.append(f"expected a call to run out of memory{oom_where(expect)}; none did")
        for call in result.oom_calls:
            assert call.oom is not None
            where = call.oom.where
            gib = call.oom.attempted_bytes / GIB
            if expect.oom.phase is not None and where.get("phase") != expect.oom.phase:
                problems.append(f"call {call.index}: expected the OOM in {expect.oom.phase}, got {where.get('phase')}")
            if expect.oom.op_contains is not None and expect.oom.op_contains not in str(where.get("op", "")):
                problems.append(
                    f"call {call.index}: expected the OOM at an op containing '{expect.oom.op_contains}', "
                    f"got '{where.get('op')}'"
                )
            if expect.oom.attempted_gib is not None and not expect.oom.attempted_gib.contains(gib):
                r = expect.oom.attempted_gib
                problems.append(f"call {call.index}: attempted {gib:.2f} GiB, expected within [{r.min}, {r.max}]")
    if expect.request_metrics is not None:
        for request_id, metrics in expect.request_metrics.items():
            try:
                record = result.request(request_id)
            except KeyError:
                problems.append(f"request {request_id} does not exist")
                continue
            for key, value in metrics.items():
                got = record.metrics.get(key)
                if got is None:
                    has = ", ".join(sorted(record.metrics)) or "none"
                    problems.append(f"request {request_id}: expected {key} = {value}; it has no such metric (it has: {has})")
                elif abs(got - value) > 1e-6 * max(1.0, abs(value)):
                    problems.append(f"request {request_id}: expected {key} = {value}, got {got}")
    if expect.min_headroom_gib is not None:
        peaks = [c.peak_bytes for c in result.calls if c.peak_bytes is not None]
        if result.capacity_bytes is None or not peaks:
            problems.append(
                f"expected at least {expect.min_headroom_gib} GiB headroom; unknown: "
                + ("the run reports no capacity" if result.capacity_bytes is None else "no call reports its peak")
            )
        else:
            headroom = (result.capacity_bytes - max(peaks)) / GIB
            if headroom < expect.min_headroom_gib:
                problems.append(f"expected at least {expect.min_headroom_gib} GiB headroom, got {headroom:.2f} GiB")
    if expect.makespan_s is not None and not expect.makespan_s.contains(result.makespan_s):
        problems.append(f"makespan {result.makespan_s:.2f} s outside [{expect.makespan_s.min}, {expect.makespan_s.max}]")
    if expect.swaps is not None or expect.host_memory_peak_gib is not None:
        problems += tenancy_unmet(result, expect)
    return problems


def oom_where(expect: Expectations) -> str:
    """`` (in backward, at an op containing 'fc1')``: what an expected OOM must match, for the line that none ran out."""
    oom = expect.oom
    parts = []
    if oom is not None and oom.phase:
        parts.append(f"in {oom.phase}")
    if oom is not None and oom.op_contains:
        parts.append(f"at an op containing '{oom.op_contains}'")
    return f" ({', '.join(parts)})" if parts else ""


def tenancy_unmet(result: RunResult, expect: Expectations) -> list[str]:
    """The adapter store's expectations: how many swaps, and the slots' peak host memory per worker."""
    tenancy = tenancy_summary(result)
    problems: list[str] = []
    if expect.swaps is not None and tenancy["swaps"] != expect.swaps:
        problems.append(f"expected {expect.swaps} adapter swaps, got {tenancy['swaps']}")
    wanted = expect.host_memory_peak_gib
    if wanted is not None:
        peak = tenancy["host_bytes_peak"]
        if peak is None or not wanted.contains(peak / GIB):
            got = "none (no adapter store)" if peak is None else f"{peak / GIB:.3f} GiB"
            problems.append(f"adapter slots' host memory peak {got}, expected within [{wanted.min}, {wanted.max}]")
    return problems

"""Pairing two runs' calls by the requests they hold, for runs whose calls are not formed the same way.

``compare`` pairs calls by position: two backends that share the engine rules make the same calls in the same order,
and a broken pairing is the first finding. A replay compares the simulator with what a live service did, and the two
may cut a burst of requests differently (SkyRL's JAX backend took 14 requests as one call while it compiled; the
simulator, which models no compilation, took them as four). Paired by position, every call after the first such
split is compared with the wrong one. ``align_calls`` pairs a call of A with the first call of B after the last pair
that has the same kind and shares a request with it; a call with no such twin stands alone (its other side missing),
and the pairs keep both runs' order. Calls without request ids (a log that does not name them) are paired by
position. Linear in the number of request ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from skyrl_sim.results.result import CallRecord

CallPair = tuple[CallRecord | None, CallRecord | None]


def align_calls(a: Sequence[CallRecord], b: Sequence[CallRecord]) -> list[CallPair]:
    """A's and B's calls as pairs in order (A's order; B's calls that pair with none stand where B ran them)."""
    if not any(c.request_ids for c in a) or not any(c.request_ids for c in b):
        count = max(len(a), len(b))
        return [(a[i] if i < len(a) else None, b[i] if i < len(b) else None) for i in range(count)]
    calls_of: dict[tuple[str, int], list[int]] = {}  # (kind, request id) -> B's calls holding it, in order
    for j, call in enumerate(b):
        for request_id in call.request_ids:
            calls_of.setdefault((call.kind, request_id), []).append(j)
    twin: list[int | None] = []
    last = -1
    for call in a:
        later = [j for r in call.request_ids for j in calls_of.get((call.kind, r), ()) if j > last]
        chosen = min(later) if later else None
        if chosen is not None:
            last = chosen
        twin.append(chosen)
    pairs: list[CallPair] = []
    j = 0
    for i, chosen in enumerate(twin):
        if chosen is None:
            pairs.append((a[i], None))
            continue
        pairs.extend((None, b[k]) for k in range(j, chosen))  # B's calls that ran before this pair and pair with none
        pairs.append((a[i], b[chosen]))
        j = chosen + 1
    pairs.extend((None, b[k]) for k in range(j, len(b)))
    return pairs

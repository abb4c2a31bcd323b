"""A scenario with one variant applied (``ResolvedVariant``, what a backend runs), and its requests as planned before
submission (``PlannedRequest``, one per API request, the Tinker SDK's shaping applied)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.expect import Expectations
from skyrl_sim.schema.requests import DATUM_TYPES, RequestSpec
from skyrl_sim.schema.scenario_spec import Scenario
from skyrl_sim.schema.tinker_sdk import sdk_requests
from skyrl_sim.schema.workload import Client, Workload


class PlannedRequest(NamedTuple):
    """A request before submission: its client, its position, and what it asks. (Immutable, and a tuple: a run makes
    one per request, at a fraction of a frozen dataclass's cost.)"""

    client_index: int
    index: int
    spec: RequestSpec
    datums: tuple[int, ...]
    is_blocker: bool = False
    call: int = -1  # the client's call (scenario entry) it belongs to: the SDK turns one call into several requests
    phase: int = 0  # within its call: a later phase is submitted once every request of the earlier ones is done


def counted_requests(client: Client) -> Iterator[tuple[RequestSpec, tuple[int, ...], int]]:
    """A client's requests as (spec, datum lengths, how many of them), the ``count`` of an entry not expanded (a long
    workload's totals without a list of its million requests; ``Client.expanded`` gives them one by one)."""
    if client.trace is not None:
        for spec, datums in client.expanded():
            yield spec, datums, 1
        return
    for spec in client.requests:
        if spec.lengths is not None:
            for length in spec.lengths:
                yield spec, (length,), spec.count
        else:
            yield spec, tuple(spec.datums or ()), spec.count


@dataclass
class ResolvedVariant:
    """A scenario with one variant applied: what a backend runs."""

    scenario: Scenario
    variant_name: str
    endpoint: Endpoint
    model: ModelArch
    workload: Workload
    expectations: Expectations
    source: str
    endpoint_source: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)  # the command line's --set, applied on top of the variant

    def client_requests(self, client_index: int) -> list[PlannedRequest]:
        """Requests of one client in submission order, the blocker first."""
        client = self.workload.clients[client_index]
        planned: list[PlannedRequest] = []
        if client.blocker is not None:
            spec = RequestSpec(type="forward_backward", lengths=[client.blocker.tokens])
            planned.append(PlannedRequest(client_index, 0, spec, (client.blocker.tokens,), is_blocker=True))
        if client.sdk == "none":
            for spec, datums in client.expanded():
                planned.append(PlannedRequest(client_index, len(planned), spec, datums))
            return planned
        for call, (spec, datums) in enumerate(client.expanded()):
            for phase, sent, chunk in sdk_requests(spec, datums):
                planned.append(PlannedRequest(client_index, len(planned), sent, chunk, call=call, phase=phase))
        return planned

    def request_count(self) -> int:
        """Requests the workload submits, blockers included (request ids run from 1 to this)."""
        count = 0
        for index, client in enumerate(self.workload.clients):
            if client.sdk == "none":  # trace clients too, without expanding them
                count += client.request_count() + (client.blocker is not None)
            else:  # the SDK's shaping decides how many requests a call becomes
                count += len(self.client_requests(index))
        return count

    def forward_pass_requests(self) -> int:
        """How many forward and forward_backward requests the workload submits (blockers included): a call holds at
        least one request and a request is in one call, so no run makes more forward-pass calls."""
        return sum(
            p.spec.type in ("forward", "forward_backward")
            for index in range(len(self.workload.clients))
            for p in self.client_requests(index)
        )

    def request_types(self) -> frozenset[str]:
        """The types of the requests the workload submits (the SDK's shaping applied, blockers included)."""
        return frozenset(p.spec.type for index in range(len(self.workload.clients)) for p in self.client_requests(index))

    def workload_totals(self) -> dict[str, int]:
        """Requests and tokens of the workload (blockers excluded), and the repro's unpadded slot count."""
        requests = 0
        tokens = 0
        longest = 0
        for client in self.workload.clients:
            if client.trace is None:  # the same sums as ``counted_requests`` gives, a spec's lengths at once
                for spec in client.requests:
                    if spec.type not in DATUM_TYPES:
                        continue
                    count = spec.count
                    if spec.lengths is not None:  # one request of one datum per length
                        lengths: list[int] | tuple[int, ...] = spec.lengths
                        requests += count * len(lengths)
                    else:  # one request of these datums
                        lengths = spec.datums or ()
                        requests += count
                    if lengths:
                        tokens += count * sum(lengths)
                        longest = max(longest, max(lengths))
                continue
            for spec, datums, count in counted_requests(client):
                if spec.type not in DATUM_TYPES:
                    continue
                requests += count
                tokens += count * sum(datums)
                if datums:
                    longest = max(longest, max(datums))
        return {"requests": requests, "tokens": tokens, "unpadded_slots": requests * longest}

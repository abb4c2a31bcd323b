"""What a scenario client does, as a sequence of actions any clock can drive.

The simulator drives these actions on a simpy clock, the real backend on the wall clock; both get the same order of
submissions and waits from one definition. A client submits its blocker (then waits ``lead_s``), its warm-up
requests one at a time (each awaited), then the rest by its pattern, and finally awaits every result.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

from skyrl_sim.engine.frozen import quick_init
from skyrl_sim.schema.variant import PlannedRequest, ResolvedVariant


@quick_init
@dataclass(frozen=True, slots=True)
class Sleep:
    """Let ``seconds`` pass on the clock."""

    seconds: float


@quick_init
@dataclass(frozen=True, slots=True)
class Idle(Sleep):
    """The engine's sleep when nothing is pending. Until something else happens on the clock, each of these ends in
    another, so a simulated clock may pass a run of them at once (``driver.idle_delay``); a real one just sleeps."""


@quick_init
@dataclass(frozen=True, slots=True)
class SleepUntil:
    """Let the clock reach ``at_s`` (seconds since the run started); no wait if it already has."""

    at_s: float


@quick_init
@dataclass(frozen=True, slots=True)
class Submit:
    """Submit one request (the driver has already charged the submission cost); the driver sends back its id."""

    planned: PlannedRequest


@quick_init
@dataclass(frozen=True, slots=True)
class Await:
    """Wait until the request's result can be retrieved."""

    request_id: int


Action = Sleep | SleepUntil | Submit | Await
ClientScript = Generator[Action, int | None, None]


def opening(
    variant: ResolvedVariant, client_index: int, gap: Sleep | None, rest: list[PlannedRequest]
) -> Generator[Action, int | None, list[int]]:
    """What every client does first: wait its ``start_s``, then submit its blocker (taken off ``rest``) and wait the
    blocker's lead time. Returns the ids it submitted (the blocker's, or none)."""
    client = variant.workload.clients[client_index]
    if client.start_s:
        yield Sleep(client.start_s)
    ids: list[int] = []
    if rest and rest[0].is_blocker:
        if gap is not None:
            yield gap
        request_id = yield Submit(rest.pop(0))
        assert request_id is not None
        ids.append(request_id)
        assert client.blocker is not None
        yield Sleep(client.blocker.lead_s)
    return ids


def client_script(variant: ResolvedVariant, client_index: int) -> ClientScript:
    """The actions of one client, in order. ``Submit`` receives the assigned request id.

    One generator, no helper generators inside: every clock resumes it once per action, and a long run has millions
    of them. The gap before each submission is one shared ``Sleep`` (actions are immutable)."""
    client = variant.workload.clients[client_index]
    if client.sdk != "none":
        yield from sdk_client_script(variant, client_index)
        return
    submit = client.submit
    gap = Sleep(submit.gap_s) if submit.gap_s else None
    rest = variant.client_requests(client_index)
    ids = yield from opening(variant, client_index, gap, rest)
    for item in rest[: submit.warmup]:
        if gap is not None:
            yield gap
        request_id = yield Submit(item)
        assert request_id is not None
        ids.append(request_id)
        yield Await(request_id)
    at_times = submit.mode == "at_times"
    after_previous = submit.mode == "after_previous"
    times = list(submit.times_s or [])
    for position, item in enumerate(rest[submit.warmup :], start=submit.warmup):
        if at_times:
            yield SleepUntil(client.start_s + times[position])
        if gap is not None:
            yield gap
        request_id = yield Submit(item)
        assert request_id is not None
        ids.append(request_id)
        if after_previous:
            yield Await(request_id)
    for request_id in ids:
        yield Await(request_id)


def sdk_client_script(variant: ResolvedVariant, client_index: int) -> ClientScript:
    """The actions of a client that calls through the Tinker SDK (``sdk: tinker-0.25``): each scenario entry is one
    SDK call, the requests it becomes (``scenario.sdk_requests``) submitted together, without time between them (the
    SDK sends them concurrently: one ``gap_s`` a call), and awaited together where the pattern awaits a call. A
    later phase of a call (the custom forward_backward's backward) goes out once its earlier phase is done."""
    client = variant.workload.clients[client_index]
    submit = client.submit
    gap = Sleep(submit.gap_s) if submit.gap_s else None
    rest = variant.client_requests(client_index)
    ids = yield from opening(variant, client_index, gap, rest)
    calls: list[list[PlannedRequest]] = []
    for item in rest:
        if not calls or calls[-1][0].call != item.call:
            calls.append([])
        calls[-1].append(item)
    times = list(submit.times_s or [])
    for position, members in enumerate(calls):
        warm = position < submit.warmup
        if submit.mode == "at_times" and not warm:
            yield SleepUntil(client.start_s + times[position])
        if gap is not None:
            yield gap
        sent: list[int] = []
        phase = 0
        for item in members:
            if item.phase > phase:  # the SDK awaits the earlier phase's results (the custom loss runs in between)
                for request_id in sent:
                    yield Await(request_id)
                phase = item.phase
            request_id = yield Submit(item)
            assert request_id is not None
            sent.append(request_id)
            ids.append(request_id)
        if warm or submit.mode == "after_previous":
            for request_id in sent:
                yield Await(request_id)
    for request_id in ids:
        yield Await(request_id)

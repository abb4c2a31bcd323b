"""SkyRL's Tinker engine scheduling rules as pure functions: which pending requests form the next backend calls.

Every backend (the simulator, the real megatron backend) calls ``plan_iteration`` on the same snapshot of pending
requests and runs what it returns, so the two can only differ in what a call costs, never in what a call is.
The rules follow SkyRL's engine (see the README's "Engine rules" section):

- a model's destructive barrier is its smallest pending ``optim_step`` / ``load_weights`` id; passes below it batch;
- the first pass at or after the barrier is blocked, and that model's singles after it wait for the next iteration;
- forward_backward calls: the set in id order, cut into chunks of at most ``forward_backward_max_request_count``,
  each chunk grouped per model (groups in order of first appearance, ids in order inside);
- forward: the same grouping, never chunked;
- sample: per model only the first seen non-empty checkpoint; serial mode runs one batch across models after the
  passes, continuous mode admits (when other work exists) only samples older than all of it, one call each, first;
- singles run one at a time in id order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from skyrl_sim.endpoint import Engine
from skyrl_sim.scenario import BARRIERS, BATCHABLE, PASSES, Request


@dataclass(frozen=True)
class BatchCall:
    """One backend call: a kind, the model it runs on (None for a cross-model sample batch) and its requests."""

    kind: str
    model_id: str | None
    requests: tuple[Request, ...]

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests]


@dataclass(frozen=True)
class IterationPlan:
    """What one engine iteration runs, phase by phase, in execution order."""

    early_samples: tuple[BatchCall, ...] = ()
    forward_backward: tuple[BatchCall, ...] = ()
    forward: tuple[BatchCall, ...] = ()
    samples: tuple[BatchCall, ...] = ()
    singles: tuple[Request, ...] = ()
    log: tuple[str, ...] = field(default=())

    def batch_calls(self) -> list[BatchCall]:
        """Batch calls in the order the engine runs them."""
        return [*self.early_samples, *self.forward_backward, *self.forward, *self.samples]

    def request_ids(self) -> list[int]:
        return [r.id for call in self.batch_calls() for r in call.requests] + [r.id for r in self.singles]


def barriers(pending: Iterable[Request]) -> dict[str, int]:
    """Per model, the smallest pending optim_step / load_weights id."""
    out: dict[str, int] = {}
    for request in pending:
        if request.type in BARRIERS and request.id < out.get(request.model_id, math.inf):
            out[request.model_id] = request.id
    return out


def first_blocked_pass(pending: Iterable[Request], barrier: dict[str, int]) -> dict[str, int]:
    """Per model, the id of the first pass at or after its barrier (the singles after it wait)."""
    out: dict[str, int] = {}
    for request in pending:
        limit = barrier.get(request.model_id)
        if (
            request.type in PASSES
            and limit is not None
            and request.id >= limit
            and request.id < out.get(request.model_id, math.inf)
        ):
            out[request.model_id] = request.id
    return out


def group_by_model(kind: str, requests: Sequence[Request]) -> list[BatchCall]:
    """One call per model, in order of first appearance, ids in order inside."""
    groups: dict[str, list[Request]] = {}
    for request in requests:
        groups.setdefault(request.model_id, []).append(request)
    return [BatchCall(kind, model_id, tuple(group)) for model_id, group in groups.items()]


def chunk(requests: Sequence[Request], cap: int | None) -> list[list[Request]]:
    """Consecutive chunks of at most ``cap`` requests (one chunk when uncapped)."""
    if cap is None or len(requests) <= cap:
        return [list(requests)] if requests else []
    return [list(requests[i : i + cap]) for i in range(0, len(requests), cap)]


def select_samples(pending: Sequence[Request]) -> list[Request]:
    """Every pending sample, but per model only the first seen non-empty checkpoint."""
    chosen: dict[str, str] = {}
    out: list[Request] = []
    for request in pending:
        if request.type != "sample":
            continue
        if request.checkpoint:
            first = chosen.setdefault(request.model_id, request.checkpoint)
            if first != request.checkpoint:
                continue
        out.append(request)
    return out


def plan_iteration(pending: Sequence[Request], engine: Engine) -> IterationPlan:
    """The engine's choice for one iteration from a snapshot of pending requests (any order; sorted by id here)."""
    snapshot = sorted(pending, key=lambda r: r.id)
    barrier = barriers(snapshot)
    blocked = first_blocked_pass(snapshot, barrier)

    def below_barrier(request: Request) -> bool:
        return request.id < barrier.get(request.model_id, math.inf)

    fb_set = [r for r in snapshot if r.type == "forward_backward" and below_barrier(r)]
    fwd_set = [r for r in snapshot if r.type == "forward" and below_barrier(r)]
    singles = [r for r in snapshot if r.type not in BATCHABLE and r.id < blocked.get(r.model_id, math.inf)]
    sample_set = select_samples(snapshot)

    log: list[str] = []
    fb_chunks = chunk(fb_set, engine.forward_backward_max_request_count)
    if len(fb_chunks) > 1:
        log.append(f"forward_backward request batch split {len(fb_chunks)}")
    fb_calls = [call for part in fb_chunks for call in group_by_model("forward_backward", part)]
    fwd_calls = group_by_model("forward", fwd_set)

    early: list[BatchCall] = []
    late: list[BatchCall] = []
    if engine.sampling == "continuous":
        other = [r.id for r in (*fb_set, *fwd_set, *singles)]
        if other:
            oldest = min(other)
            admitted = [r for r in sample_set if r.id < oldest]
        else:
            admitted = sample_set
        early = [BatchCall("sample", r.model_id, (r,)) for r in admitted]
    else:
        if engine.sample_max_num_sequences is not None:
            sample_set = sample_set[: engine.sample_max_num_sequences]
        if sample_set:
            late = [BatchCall("sample", None, tuple(sample_set))]

    return IterationPlan(
        early_samples=tuple(early),
        forward_backward=tuple(fb_calls),
        forward=tuple(fwd_calls),
        samples=tuple(late),
        singles=tuple(singles),
        log=tuple(log),
    )

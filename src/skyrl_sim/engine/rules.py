"""SkyRL's Tinker engine scheduling rules as pure functions: which pending requests form the next backend calls.

Every backend (the simulator, the real megatron backend) calls ``plan_iteration`` on the same snapshot of pending
requests and runs what it returns, so the two can only differ in what a call costs, never in what a call is.
The rules follow SkyRL's engine (see the manual's engine rules, docs/engine-rules.md):

- a model's destructive barrier is its smallest pending ``optim_step`` / ``load_weights`` id; passes below it batch;
- the first pass at or after the barrier is blocked, and that model's singles after it wait for the next iteration;
- forward_backward calls: the set in id order, cut into chunks of at most ``forward_backward_max_request_count``,
  each chunk grouped per model (groups in order of first appearance, ids in order inside);
- forward: the same grouping, never chunked;
- sample: per model only the first seen non-empty checkpoint (samples in flight are not seen); how they run is the
  sampling mode (``sampling_mode``): serial runs one batch across models after the passes; continuous admits them to
  the sampler, where they run concurrently (when other work exists only the samples older than all of it, and then
  every sample in flight is drained before that work); forwarded never sees them (they go around the engine);
- singles run one at a time in id order;
- model lifecycle: a model is loaded by a processed ``create_model`` and unloaded by ``unload_model``. A batch's
  request whose model is not loaded fails without a call (SkyRL's ``_filter_valid_requests``: a pass, or a sample
  from a checkpoint; a base-model sample names no model); a single fails in its ``process_*`` check, except
  ``create_model`` (loads it) and ``unload_model`` (ignored when not loaded). The loaded set changes only in the
  singles phase, so every batch of an iteration sees the set the iteration started with.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from operator import attrgetter
from typing import Literal

from skyrl_sim.engine.frozen import quick_init
from skyrl_sim.engine.request import BARRIERS, Request
from skyrl_sim.schema.endpoint import Endpoint, Engine
from skyrl_sim.schema.requests import PASSES

SamplingMode = Literal["serial", "continuous", "forwarded"]
SKYRL_TRAIN_STRATEGIES = frozenset({"megatron", "fsdp"})
"""The backends with SkyRL's awaitable per-request sample path (``sample_batch_async``, ``prepare_for_sampling``):
SkyRL-Train's. The engine samples continuously only with them, and the API forwards samples only for them."""


def sampling_mode(endpoint: Endpoint) -> SamplingMode:
    """How the endpoint's samples run, as SkyRL 0.4.0 decides it unless ``engine.sampling`` says.

    - forwarded: a SkyRL-Train backend with ``placement.colocate_all`` false (``api.py``:
      ``_should_forward_sample_requests``; the engine runs in the combined role here): ``/asample`` goes from the API
      straight to vLLM and never enters the engine's queue;
    - continuous: a SkyRL-Train backend otherwise (``engine.py``: ``SKYRL_TINKER_CONTINUOUS_SAMPLING``, on by
      default, and the backend's ``sample_batch_async``);
    - serial: any other backend (the JAX backend has no per-request path): one wave per iteration.
    """
    if endpoint.engine.sampling is not None:
        return endpoint.engine.sampling
    if endpoint.trainer.strategy not in SKYRL_TRAIN_STRATEGIES:
        return "serial"
    return "continuous" if endpoint.placement.colocate_all else "forwarded"


@quick_init
@dataclass(frozen=True, slots=True)
class BatchCall:
    """One backend call: a kind, the model it runs on (None for a cross-model sample batch) and its requests."""

    kind: str
    model_id: str | None
    requests: tuple[Request, ...]

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests]


@quick_init
@dataclass(frozen=True, slots=True)  # one per engine iteration
class IterationPlan:
    """What one engine iteration runs, phase by phase, in execution order.

    Continuous sampling: ``admitted`` samples go to the sampler first (they run concurrently and each completes on
    its own); then, when ``drain`` names blocking work, the engine waits for every sample in flight (SkyRL's
    ``_ContinuousSampler.drain(reason)``, the reason being these names joined) before the passes and singles."""

    admitted: tuple[Request, ...] = ()
    drain: tuple[str, ...] = ()
    forward_backward: tuple[BatchCall, ...] = ()
    forward: tuple[BatchCall, ...] = ()
    samples: tuple[BatchCall, ...] = ()
    singles: tuple[Request, ...] = ()
    rejected: tuple[Request, ...] = ()
    log: tuple[str, ...] = field(default=())

    def batch_calls(self) -> list[BatchCall]:
        """Batch calls in the order the engine runs them."""
        return [*self.forward_backward, *self.forward, *self.samples]

    def request_ids(self) -> list[int]:
        batched = [r.id for r in self.admitted] + [r.id for call in self.batch_calls() for r in call.requests]
        return batched + [r.id for r in self.singles] + [r.id for r in self.rejected]


REQUEST_ID = attrgetter("id")  # a request's id, the order the engine reads the queue in
ALL_LOADED = None  # ``loaded=None``: every model counts as loaded (no lifecycle in the workload)


def not_loaded_error(model_id: str, single: bool = False) -> str:
    """SkyRL's failure text for a request whose model is not loaded: the batch filter's, or a single's check."""
    text = f"Model {model_id} not loaded"
    return f"{text} (likely stale request from previous server)" if single else text


def needs_loaded_model(request: Request) -> bool:
    """Whether SkyRL checks that the request's model is loaded: every request of a model but ``create_model`` and
    ``unload_model``, and a sample only when it names a checkpoint (a base-model sample has no model id)."""
    if request.type in ("create_model", "unload_model"):
        return False
    if request.type == "sample":
        return bool(request.checkpoint)
    return True


def is_loaded(request: Request, loaded: Collection[str] | None) -> bool:
    """The request passes SkyRL's loaded-model check (always, when ``loaded`` is None)."""
    return loaded is None or not needs_loaded_model(request) or request.model_id in loaded


def apply_single(request: Request, loaded: frozenset[str] | None) -> tuple[frozenset[str] | None, str | None]:
    """A single's effect on the loaded set and its failure (None when it runs).

    ``create_model`` loads its model, ``unload_model`` unloads it (a model not loaded is ignored, not failed), every
    other single fails when its model is not loaded.
    """
    if loaded is None:
        return None, None
    if request.type == "create_model":
        return loaded | {request.model_id}, None
    if request.type == "unload_model":
        return loaded - {request.model_id}, None
    if not is_loaded(request, loaded):
        return loaded, not_loaded_error(request.model_id, single=True)
    return loaded, None


def split_loaded(requests: Sequence[Request], loaded: Collection[str] | None) -> tuple[list[Request], list[Request]]:
    """A batch's requests as (valid, rejected) by the loaded-model check, order kept."""
    if loaded is None:
        return list(requests), []
    valid: list[Request] = []
    rejected: list[Request] = []
    for request in requests:
        (valid if is_loaded(request, loaded) else rejected).append(request)
    return valid, rejected


def barriers(pending: Iterable[Request]) -> dict[str, int]:
    """Per model, the smallest pending optim_step / load_weights id."""
    out: dict[str, int] = {}
    for request in pending:
        if request.type in BARRIERS and request.id < out.get(request.model_id, math.inf):
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


def actionable(
    model_queues: Iterable[Iterable[Request]], samples: Iterable[Request], continuous: bool = False
) -> list[Request]:
    """The pending requests ``plan_iteration`` can act on, given each model's pending requests other than samples
    (one iterable per model, in id order) and every pending sample (in id order): a model's requests before its first
    pass at or after its barrier, and the samples. ``plan_iteration`` plans the same calls from this list as from the
    whole queue (``tests/test_engine_rules.py``), and it costs per model what the model can run, not its blocked
    backlog.

    What is left out cannot change the plan: that pass is blocked, and so is every later pass of the model; its later
    singles wait for the next iteration (a model is blocked from its first blocked pass on). In ``continuous`` mode
    only the samples below the first blocking request are admitted (every request kept from a model's queue is a pass
    or a single the plan selects, so the first blocking one is the smallest first id of a queue), and a later sample
    cannot change which of those are (a model's sample checkpoint is its first sample's): the samples from there on
    are left out too, so a backlog of samples waiting behind blocking work is not walked either."""
    out: list[Request] = []
    first_blocking = math.inf
    for queue in model_queues:
        behind_barrier = False
        for request in queue:
            kind = request.type
            if kind in PASSES:
                if behind_barrier:
                    break
            elif kind in BARRIERS:
                behind_barrier = True
            if request.id < first_blocking:
                first_blocking = request.id
            out.append(request)
    if continuous and first_blocking != math.inf:
        out.extend(takewhile(lambda r: r.id < first_blocking, samples))
    else:
        out.extend(samples)
    return out


BLOCKERS = (("forward_backward", "forward_backward"), ("forward", "forward"), ("single requests", "single"))
"""The names SkyRL's continuous sampler drains for (``process_pending_requests_once``), in its order."""


def plan_iteration(
    pending: Sequence[Request],
    engine: Engine,
    loaded: Collection[str] | None = ALL_LOADED,
    mode: SamplingMode | None = None,
    in_flight: Collection[int] = (),
) -> IterationPlan:
    """The engine's choice for one iteration from a snapshot of pending requests (any order; sorted by id here).

    ``loaded`` is the set of loaded models when the iteration starts (None: all). Batch requests of a model that is
    not loaded are ``rejected`` (they fail without a call; they still count in the sets SkyRL selects, so they still
    cut forward_backward chunks and hold samples back in continuous mode). Singles are checked one by one as they run
    (``apply_single``), since a ``create_model`` among them changes the set for the ones after it.

    ``mode`` is the sampling mode (the loop passes ``sampling_mode(endpoint)``; None: ``engine.sampling``, else
    continuous, SkyRL-Train's default). ``in_flight``: ids of samples already admitted to the sampler and not yet
    finished; they are still pending (SkyRL's rows stay PENDING until written) but not seen (``find_batchable_sample``
    skips ``inflight_ids``).

    One pass in id order sorts the snapshot into the sets: a model's barrier (``barriers``) is the first barrier seen
    for it, so a pass is below it exactly when none has been seen yet, and a single waits exactly when the model's
    first pass at or after its barrier came before it. Samples: every pending sample, but per model only the first
    seen non-empty checkpoint.

    Continuous mode (``_admit_samples_continuous``): with blocking work (a pass or a single selected), only the
    samples with an id below the first blocking id are admitted, and every sample in flight is drained before the
    blocking work (``drain``); without, every selected sample is admitted. Serial mode: one sample batch across
    models after the passes, at most ``sample_max_num_sequences`` requests (the JAX backend's cap). Forwarded mode:
    samples never reach the engine; any in ``pending`` are ignored."""
    mode = mode or engine.sampling or "continuous"
    snapshot = sorted(pending, key=REQUEST_ID)
    barrier: set[str] = set()  # models whose barrier has been seen
    blocked: set[str] = set()  # models whose first pass at or after the barrier has been seen
    chosen: dict[str, str] = {}  # the first non-empty sample checkpoint per model
    fb_set: list[Request] = []
    fwd_set: list[Request] = []
    singles: list[Request] = []
    sample_set: list[Request] = []
    for request in snapshot:
        kind = request.type
        model = request.model_id
        if kind in PASSES:
            if model in barrier:
                blocked.add(model)
            elif kind == "forward_backward":
                fb_set.append(request)
            else:
                fwd_set.append(request)
        elif kind == "sample":
            if mode == "forwarded" or request.id in in_flight:
                continue
            if request.checkpoint and chosen.setdefault(model, request.checkpoint) != request.checkpoint:
                continue
            sample_set.append(request)
        else:
            if kind in BARRIERS:
                barrier.add(model)
            if model not in blocked:
                singles.append(request)

    log: list[str] = []
    rejected: list[Request] = []

    def valid(requests: Sequence[Request]) -> list[Request]:
        kept, dropped = split_loaded(requests, loaded)
        rejected.extend(dropped)
        return kept

    fb_chunks = chunk(fb_set, engine.forward_backward_max_request_count)
    if len(fb_chunks) > 1:
        log.append(f"forward_backward request batch split {len(fb_chunks)}")
    fb_calls = [call for part in fb_chunks for call in group_by_model("forward_backward", valid(part))]
    fwd_calls = group_by_model("forward", valid(fwd_set)) if fwd_set else []

    admitted: list[Request] = []
    drain: tuple[str, ...] = ()
    late: list[BatchCall] = []
    if mode == "continuous":
        present = {"forward_backward": fb_set, "forward": fwd_set, "single": singles}
        drain = tuple(name for name, kind in BLOCKERS if present[kind])
        if drain:
            first_blocking = min(r.id for r in (*fb_set, *fwd_set, *singles))
            # sample_set is in id order: the samples before the first blocking request are a prefix of it
            admitted = valid(list(takewhile(lambda r: r.id < first_blocking, sample_set)))
        else:
            admitted = valid(sample_set)
    elif mode == "serial":
        if engine.sample_max_num_sequences is not None:
            sample_set = sample_set[: engine.sample_max_num_sequences]
        sample_set = valid(sample_set)
        if sample_set:
            late = [BatchCall("sample", None, tuple(sample_set))]

    return IterationPlan(
        admitted=tuple(admitted),
        drain=drain,
        forward_backward=tuple(fb_calls),
        forward=tuple(fwd_calls),
        samples=tuple(late),
        singles=tuple(singles),
        rejected=tuple(sorted(rejected, key=REQUEST_ID)) if rejected else (),
        log=tuple(log),
    )


"""``skyrl-sim advise``: the fastest configuration that completes a scenario with no OOM and a safe headroom.

The settings an operator can change on a deployment are searched on the simulator, against the scenario's workload:

- engine: the request-count cap (``engine.forward_backward_max_request_count``), cap-aware padding, the sampling mode
  and ``sample_max_num_sequences`` (the last two only when the workload samples). The cap and cap-aware padding are
  PR #1874's, in no SkyRL release: on an endpoint whose ``skyrl_version`` lacks them they are searched as a what-if
  and labelled in every output, and ``--released-only`` leaves them off (searches only what the version has);
- trainer: the micro batch size, ``max_tokens_per_microbatch``, ``remove_microbatch_padding``, recompute granularity
  and the number of recomputed layers;
- parallelism: every TP x DP split of the endpoint's devices that the model's heads allow.

It is not a brute-force grid. What the model knows prunes the search:

- memory is monotone in rows and tokens: a setting that fails on a call fails on every larger call. So the cap is
  found by **bisection** (the largest cap whose calls all fit with the margin, over a geometric ladder of caps, then
  exactly between the last safe and the first unsafe rung), and a structure that is unsafe at cap 1, the smallest call
  it can make, is rejected after one run; on a monotone axis (micro size, token budget, recompute: values ordered by
  memory) every larger value is then skipped;
- cap-aware padding never pads more rows than plain padding (``min(rows, micro)`` against ``micro``), so it is searched
  on, and the scenario's own setting is kept as the baseline;
- the other axes are searched one at a time from the best configuration so far (coordinate descent, two rounds).

Every evaluated configuration keeps its objective and its headroom; the **Pareto front** over the two is reported, and
the recommendation is the best objective among configurations with no OOM, every request completed and every call's
headroom at least the margin (the endpoint's memory band unless ``--margin`` says otherwise; see ``skyrl_sim.results.band``).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
import yaml

from skyrl_sim.commands import sweep as sweeping
from skyrl_sim.commands.executors import EXECUTORS, Executor, RayExecutor, watch_parent
from skyrl_sim.engine.rules import SKYRL_TRAIN_STRATEGIES
from skyrl_sim.errors import UserError
from skyrl_sim.reports.progress import tracking
from skyrl_sim.results.band import GIB, Margin, band_for, held_bytes, parse_margin
from skyrl_sim.results.outputs import Output, check_outputs, write_atomic
from skyrl_sim.results.verdict import AT_RISK, FAIL, PASS, Status
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario
from skyrl_sim.schema.skyrl_versions import PR_SETTING_LABEL, PR_SETTINGS, has_setting, setting_label
from skyrl_sim.schema.variant import ResolvedVariant

SCHEMA = "skyrl-sim/advise/1"
Objective = Literal["makespan", "p95", "waste"]
OBJECTIVES: dict[str, str] = {"makespan": "makespan_s", "p95": "latency_p95_s", "waste": "padding_waste"}
"""Each objective and the RunResult summary number it minimises."""
CAP = "engine.forward_backward_max_request_count"
CAP_AWARE = "engine.cap_aware_padding"
ROUNDS = 2


@dataclass(frozen=True)
class AxisChoice:
    """One searched setting: its name and its values, each a set of dotted overrides; ordered by memory when
    ``monotone`` (a value that fails makes every later one fail)."""

    name: str
    values: tuple[dict[str, Any], ...]
    monotone: bool = False


def _key(settings: dict[str, Any]) -> str:
    return repr(sorted(settings.items(), key=lambda kv: kv[0]))


def dotted_get(data: dict[str, Any], dotted: str) -> Any:
    """A dotted key's value in a nested mapping (None when a part is missing)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def pass_requests(variant: ResolvedVariant) -> int:
    """forward_backward/forward requests in the workload: a cap at or above it never cuts a set."""
    count = 0
    for index in range(len(variant.workload.clients)):
        count += sum(1 for p in variant.client_requests(index) if p.spec.type in ("forward_backward", "forward"))
    return max(1, count)


def samples(variant: ResolvedVariant) -> bool:
    return any(r.type == "sample" for c in variant.workload.clients for r in c.requests)


def longest_row(variant: ResolvedVariant) -> int:
    return max(
        [
            p_len + 1
            for index in range(len(variant.workload.clients))
            for p in variant.client_requests(index)
            for p_len in p.datums
        ]
        or [1]
    )


def cap_ladder(n: int) -> list[int | None]:
    """Caps to bisect over: 1, 2, 3, 4, 6, 8, 12, ... below ``n``, then unlimited (None, the same as ``n``)."""
    ladder: list[int] = []
    value = 1
    while value < n:
        ladder.append(value)
        value = value + 1 if value < 4 else (value * 3 // 2 if value & (value - 1) == 0 else value * 4 // 3)
    return [*ladder, None]


def search_axes(variant: ResolvedVariant, fixed: Sequence[str]) -> list[AxisChoice]:
    """The structural axes (everything but the cap) for this endpoint and workload; ``fixed`` keys stay as they are."""
    ep = variant.endpoint
    model = variant.model
    t = ep.trainer
    axes: list[AxisChoice] = []

    micro_now = t.micro_train_batch_size_per_gpu
    micros = sorted({m for m in (1, 2, 4, 8, 16, 32) if m <= max(micro_now, 16)} | {micro_now})
    axes.append(AxisChoice("micro batch", tuple({"trainer.micro_train_batch_size_per_gpu": m} for m in micros), True))

    longest = longest_row(variant)
    budget = int(math.ceil(longest / 1024) * 1024)
    budgets = [-1] if t.max_tokens_per_microbatch == -1 else [t.max_tokens_per_microbatch]
    budgets += [b for b in (budget, 2 * budget) if b not in budgets]
    axes.append(AxisChoice("token budget", tuple({"trainer.max_tokens_per_microbatch": b} for b in budgets)))

    # megatron-core's local attention cannot run packed (THD) micro-batches: only the TransformerEngine spec may pack
    packs = [False, True] if t.layer_spec == "transformer_engine" else [t.remove_microbatch_padding]
    axes.append(AxisChoice("microbatch padding", tuple({"trainer.remove_microbatch_padding": v} for v in packs)))

    layers = model.num_layers
    recompute: list[dict[str, Any]] = [
        {"trainer.recompute.granularity": "full", "trainer.recompute.method": "uniform", "trainer.recompute.num_layers": 1}
    ]
    for n in sorted({layers * 3 // 4, layers // 2}, reverse=True):
        if 0 < n < layers:
            recompute.append(
                {
                    "trainer.recompute.granularity": "full",
                    "trainer.recompute.method": "block",
                    "trainer.recompute.num_layers": n,
                }
            )
    for granularity in ("selective", "none"):
        recompute.append(
            {
                "trainer.recompute.granularity": granularity,
                "trainer.recompute.method": "uniform",
                "trainer.recompute.num_layers": 1,
            }
        )
    axes.append(AxisChoice("recompute", tuple(recompute), True))

    p = ep.parallelism
    width = p.tp * p.dp
    splits = []
    for tp in range(1, width + 1):
        if width % tp or model.num_attention_heads % tp or model.num_kv_heads % tp:
            continue
        splits.append(
            {
                "parallelism.tp": tp,
                "parallelism.dp": width // tp,
                "parallelism.sequence_parallel": tp > 1 and p.sequence_parallel,
            }
        )
    if len(splits) > 1:
        axes.append(AxisChoice("parallelism", tuple(splits)))

    if samples(variant):
        axes.append(AxisChoice("sampling", ({"engine.sampling": "continuous"}, {"engine.sampling": "serial"})))
        sizes = [ep.engine.sample_max_num_sequences] + [n for n in (8, 32) if n != ep.engine.sample_max_num_sequences]
        axes.append(AxisChoice("sample batch", tuple({"engine.sample_max_num_sequences": n} for n in sizes)))

    if samples(variant) and ep.trainer.strategy in SKYRL_TRAIN_STRATEGIES:
        axes.extend(inference_axes(variant))

    kept = []
    for axis in axes:
        if any(k in fixed for value in axis.values for k in value):
            continue
        kept.append(axis)
    return kept


def inference_axes(variant: ResolvedVariant) -> list[AxisChoice]:
    """vLLM's settings for a workload that samples on a SkyRL-Train endpoint (``sim.colocation``): its memory
    utilization (on shared devices: what its start, wakes and the trainer's backloads must fit beside), CUDA graphs
    (``enforce_eager`` gives their memory back), and the placement (``colocate_all: false`` gives vLLM devices of its
    own, ``num_engines x tensor_parallel_size`` more of them, and forwards samples around the engine)."""
    inference = variant.endpoint.inference
    utilizations = [inference.gpu_memory_utilization]
    utilizations += [u for u in (0.9, 0.8, 0.7, 0.6, 0.5) if u != inference.gpu_memory_utilization]
    eager = inference.enforce_eager
    shared = variant.endpoint.placement.colocate_all
    return [
        AxisChoice("vLLM memory", tuple({"inference.gpu_memory_utilization": u} for u in utilizations)),
        AxisChoice("CUDA graphs", tuple({"inference.enforce_eager": v} for v in (eager, not eager))),
        AxisChoice("placement", tuple({"placement.colocate_all": v} for v in (shared, not shared))),
    ]


def current_choice(axis: AxisChoice, endpoint: dict[str, Any]) -> int:
    """The index of the endpoint's own value on an axis (0 when none matches)."""
    for i, value in enumerate(axis.values):
        if all(dotted_get(endpoint, k) == v for k, v in value.items()):
            return i
    return 0


@dataclass
class Candidate:
    """One evaluated configuration: its overrides and what the simulator made of it."""

    settings: dict[str, Any]
    summary: dict[str, Any]
    capacity_bytes: int
    margin_bytes: int
    band_bytes: int
    verdict: Status
    """PASS, AT RISK or FAIL: ``results.verdict.judge`` against ``COMPLETION`` with the configuration's own band (a
    configuration that changes ``tp`` has its own) or ``--margin``. Not the variant's expectations: they pin the
    calls and padded rows of the variant's settings, which the search changes; so the search asks what ``sweep
    --require completed`` asks, with the same per-call margin ``check`` applies."""

    @property
    def oom_calls(self) -> int:
        return int(self.summary.get("oom_calls") or 0)

    @property
    def completes(self) -> bool:
        s = self.summary
        return s["failed"] == 0 and s["completed"] == s["requests"] and self.oom_calls == 0

    @property
    def peak_bytes(self) -> int | None:
        return self.summary.get("peak_bytes_max")

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity minus the most any completed call held (allocator pages included): the Pareto front's axis, a
        number to trade against the objective, not the verdict (a call at risk always leaves the run's headroom under
        ``margin_bytes``, the margin at the highest peak)."""
        held = self.summary.get("held_bytes_max")
        return None if held is None else self.capacity_bytes - held

    @property
    def at_risk(self) -> bool:
        return self.verdict == AT_RISK

    @property
    def safe(self) -> bool:
        return self.verdict == PASS

    def objective(self, objective: Objective) -> float:
        value = self.summary.get(OBJECTIVES[objective])
        return math.inf if value is None else float(value)

    def to_dict(self, objective: Objective, base: dict[str, Any] | None = None, version: str = "") -> dict[str, Any]:
        labels = settings_labels(self.settings, version) if version else {}
        return {
            "settings": self.settings,
            **({"labels": labels} if labels else {}),
            "changes": changes(self.settings, base) if base is not None else None,
            "verdict": self.verdict,
            "objective": None if math.isinf(self.objective(objective)) else self.objective(objective),
            "makespan_s": self.summary.get("makespan_s"),
            "latency_p95_s": self.summary.get("latency_p95_s"),
            "padding_waste": self.summary.get("padding_waste"),
            "oom_calls": self.oom_calls,
            "completed": self.summary.get("completed"),
            "requests": self.summary.get("requests"),
            "peak_bytes": self.peak_bytes,
            "band_bytes": self.band_bytes,
            "margin_bytes": self.margin_bytes,
            "headroom_bytes": self.headroom_bytes,
            "capacity_bytes": self.capacity_bytes,
        }


SEPARATE_DEVICES_LABEL = "vLLM on devices of its own: num_engines x tensor_parallel_size more devices"
"""What ``placement.colocate_all: false`` costs that the objective does not show: the search keeps the trainer's
devices, and separate engines need their own."""


def settings_labels(settings: dict[str, Any], version: str) -> dict[str, str]:
    """The settings that ``version`` lacks, turned on (a cap set, cap-aware padding true), with their label; and
    vLLM moved to devices of its own, which needs more hardware."""
    on = {k: v for k, v in settings.items() if v is not None and v is not False}
    labels = {k: setting_label(version, k) for k in on if setting_label(version, k)}
    if settings.get("placement.colocate_all") is False:
        labels["placement.colocate_all"] = SEPARATE_DEVICES_LABEL
    return labels


def changes(settings: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The overrides whose value differs from the base endpoint's."""
    return {k: v for k, v in sorted(settings.items()) if dotted_get(base, k) != v}


def pareto_front(candidates: Sequence[Candidate], objective: Objective) -> list[Candidate]:
    """Configurations that complete with no OOM and that no other beats on both objective and headroom, by objective."""
    pool = []
    seen: set[tuple[float, int]] = set()
    for c in sorted(candidates, key=lambda c: len(c.settings)):  # of equal points, the one with fewest overrides
        point = (c.objective(objective), c.headroom_bytes or 0)
        if c.completes and c.headroom_bytes is not None and point not in seen:
            seen.add(point)
            pool.append(c)
    front = []
    for c in pool:
        dominated = any(
            o is not c
            and o.objective(objective) <= c.objective(objective)
            and (o.headroom_bytes or 0) >= (c.headroom_bytes or 0)
            and (o.objective(objective) < c.objective(objective) or (o.headroom_bytes or 0) > (c.headroom_bytes or 0))
            for o in pool
        )
        if not dominated:
            front.append(c)
    return sorted(front, key=lambda c: (c.objective(objective), -(c.headroom_bytes or 0)))


def best(candidates: Sequence[Candidate], objective: Objective) -> Candidate | None:
    """The safe configuration with the best objective (more headroom breaks ties)."""
    safe = [c for c in candidates if c.safe]
    return min(safe, key=lambda c: (c.objective(objective), -(c.headroom_bytes or 0)), default=None)


def run_config(job: sweeping.Job) -> dict[str, Any]:
    """One configuration on the simulator (in a worker process): the sweep's summary numbers, the most memory any
    completed call held, and its verdict with the margin and band at its highest peak (``sweep.judge_point``)."""
    try:
        scenario = sweeping.cached_scenario(job.scenario, job.endpoint)
        variant = scenario.resolve(job.variant, {**job.sets, **job.settings})
        result = sweeping.cached_host().run(variant, "sim")
    except UserError as exc:
        raise UserError(f"advise configuration {job.settings}: {exc}") from None
    full = result.summary()
    summary = {k: full.get(k) for k in sweeping.SUMMARY_KEYS}
    held = [h for c in result.calls if c.oom is None and not c.error and (h := held_bytes(c)) is not None]
    summary["held_bytes_max"] = max(held) if held else None
    verdict = sweeping.judge_point(result, variant, job, str(scenario.path))
    peak = summary.get("peak_bytes_max") or 0
    summary["verdict"] = verdict.status
    summary["margin_bytes"] = verdict.margin.bytes_at(peak)
    summary["band_bytes"] = verdict.margin.band.bytes_at(peak)
    return summary


TIE = 0.01
"""Objectives within 1% of the best count as equal: of those, the configuration that changes the fewest settings is
recommended (a smaller patch to review and deploy; the simulator's time model is not finer than that)."""


def recommend(
    candidates: Sequence[Candidate], objective: Objective, base: dict[str, Any], reference: Candidate | None = None
) -> Candidate | None:
    """The safe configuration to recommend: within ``TIE`` of the best objective (and never worse than a safe
    ``reference``, cap 1 with cap-aware padding), the fewest changes, then the best."""
    top = best(candidates, objective)
    if top is None:
        return None
    limit = top.objective(objective) * (1 + TIE) if top.objective(objective) > 0 else top.objective(objective)
    if reference is not None and reference.safe:
        limit = max(top.objective(objective), min(limit, reference.objective(objective)))
    near = [c for c in candidates if c.safe and c.objective(objective) <= limit]
    return min(near, key=lambda c: (len(changes(c.settings, base)), c.objective(objective), -(c.headroom_bytes or 0)))


class Evaluator:
    """Runs configurations on the simulator (in worker processes), once each, and keeps them."""

    def __init__(
        self,
        scenario: ScenarioFile,
        endpoint: str | None,
        variant: str,
        sets: dict[str, Any],
        margin: Margin,
        workers: int,
        executor: Executor | None = None,
        on_evaluated: Callable[[int], None] | None = None,
        margin_text: str | None = None,
    ) -> None:
        self.on_evaluated = on_evaluated  # told how many configurations have run so far (the CLI's progress)
        self.scenario = scenario
        self.endpoint = endpoint
        self.variant = variant
        self.sets = sets
        self.margin = margin
        self.margin_text = margin_text  # ``--margin`` as given: each configuration's own band when None
        self.cache: dict[str, Candidate] = {}
        self.lock = threading.Lock()
        self.pending: dict[str, threading.Event] = {}
        self.executor = executor  # Ray tasks (``--executor ray``); None: local processes
        context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        local = executor is None and workers > 1
        self.pool = (
            ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=watch_parent, initargs=(os.getpid(),))
            if local
            else None
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def __call__(self, settings: dict[str, Any]) -> Candidate:
        key = _key(settings)
        with self.lock:
            if key in self.cache:
                return self.cache[key]
            event = self.pending.get(key)
            owner = event is None
            if owner:
                event = self.pending[key] = threading.Event()
        assert event is not None
        if not owner:
            event.wait()
            return self.cache[key]
        try:
            resolved = self.scenario.resolve(self.variant, {**self.sets, **settings})  # a bad value: one clear error
            job = sweeping.Job(
                str(self.scenario.path), self.endpoint, self.variant, self.sets, settings, "completed", self.margin_text
            )
            if self.executor is not None:
                summary = self.executor.map(run_config, [job])[0]
            else:
                summary = self.pool.submit(run_config, job).result() if self.pool else run_config(job)
            margin_bytes, band_bytes = summary.pop("margin_bytes"), summary.pop("band_bytes")
            verdict = summary.pop("verdict")
            candidate = Candidate(
                dict(settings), summary, resolved.endpoint.capacity_bytes, margin_bytes, band_bytes, verdict
            )
            with self.lock:
                self.cache[key] = candidate
                evaluated = len(self.cache)
            if self.on_evaluated is not None:
                self.on_evaluated(evaluated)
        finally:
            event.set()
            with self.lock:
                self.pending.pop(key, None)
        return self.cache[key]


@dataclass
class Frontier:
    """What a structure (every setting but the cap) allows: its largest safe cap (None: unlimited; "none": no cap)."""

    structure: dict[str, Any]
    max_safe_cap: int | None | Literal["none"]


def bisect_cap(
    evaluate: Callable[[dict[str, Any]], Candidate],
    structure: dict[str, Any],
    n: int,
    known_safe: int = 0,
    known_unsafe: int | None = None,
) -> Frontier:
    """The largest safe cap of one structure: unlimited first (one run when it fits), then cap 1 (one run rejects the
    structure), then bisection over a geometric ladder of caps and exactly between its last safe and first unsafe rung.
    Assumes safety is monotone in the cap (a larger cap makes calls of more rows and tokens).

    ``known_safe`` / ``known_unsafe``: caps already known to fit / not to fit (from a structure that uses more / less
    memory on a monotone axis); those runs are skipped. The largest safe cap is always run, so every structure kept
    has at least one simulated configuration behind it."""
    unsafe = n + 1 if known_unsafe is None else known_unsafe

    def cap_of(value: int) -> int | None:
        return None if value >= n else value

    def safe(value: int) -> bool:
        return evaluate({**structure, CAP: cap_of(value)}).safe

    def done(value: int) -> Frontier:
        if value >= 1:
            evaluate({**structure, CAP: cap_of(value)})
        return Frontier(structure, "none" if value < 1 else cap_of(value))

    if known_safe >= n:
        return done(n)
    if unsafe > n:
        if safe(n):
            return Frontier(structure, None)
        unsafe = n
    if known_safe < 1:
        if unsafe <= 1 or not safe(1):
            return Frontier(structure, "none")
        known_safe = 1
    rungs = [r if r is not None else n for r in cap_ladder(n)]
    points = [known_safe, *[r for r in rungs if known_safe < r < unsafe], unsafe]
    good, bad = 0, len(points) - 1
    while bad - good > 1:
        middle = (good + bad) // 2
        if safe(points[middle]):
            good = middle
        else:
            bad = middle
    lo, hi = points[good], points[bad]
    while hi - lo > 1:
        middle = (lo + hi) // 2
        if safe(middle):
            lo = middle
        else:
            hi = middle
    return done(lo)


def known_caps(
    structure: dict[str, Any], axes: Sequence[AxisChoice], frontiers: dict[str, Frontier], n: int
) -> tuple[int, int | None]:
    """Bounds on a structure's largest safe cap from explored structures that differ on one monotone axis: what fits
    with more memory fits here (a lower bound), what fails with less memory fails here (an upper bound). A bound only
    skips runs; whatever is recommended was simulated."""
    safe, unsafe = 0, None
    for axis in axes:
        if not axis.monotone:
            continue
        here = next((i for i, v in enumerate(axis.values) if all(structure.get(k) == x for k, x in v.items())), None)
        if here is None:
            continue
        for i, value in enumerate(axis.values):
            if i == here:
                continue
            frontier = frontiers.get(_key({**structure, **value}))
            if frontier is None:
                continue
            top = n if frontier.max_safe_cap is None else (0 if frontier.max_safe_cap == "none" else frontier.max_safe_cap)
            if i > here:  # that one needs more memory: whatever fits there fits here
                safe = max(safe, top)
            elif top < n:  # that one needs less memory: whatever fails there fails here
                unsafe = top + 1 if unsafe is None else min(unsafe, top + 1)
    if unsafe is not None and safe >= unsafe:  # the axis was not monotone here after all: trust neither
        return 0, None
    return safe, unsafe


@dataclass
class Advice:
    """The outcome of a search: the recommendation, the front, the baseline, every configuration tried."""

    scenario: str
    variant: str
    endpoint: str
    endpoint_source: str
    objective: Objective
    margin: Margin
    base_endpoint: dict[str, Any]
    baseline: Candidate
    reference: Candidate | None
    recommended: Candidate | None
    front: list[Candidate]
    candidates: list[Candidate]
    axes: list[AxisChoice]
    fixed: list[str]
    rejected_structures: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    skyrl_version: str = ""
    released_only: bool = False

    def labels(self) -> dict[str, str]:
        """The recommendation's changed settings that the endpoint's SkyRL version lacks, with their label."""
        if self.recommended is None:
            return {}
        return settings_labels(self.overrides(), self.skyrl_version)

    @property
    def objective_key(self) -> str:
        """The RunResult summary key the objective reads (what the Pareto plot's axis shows)."""
        return OBJECTIVES[self.objective]

    def overrides(self) -> dict[str, Any]:
        return changes(self.recommended.settings, self.base_endpoint) if self.recommended else {}

    def set_flags(self) -> list[str]:
        return [f"--set {k}={_yaml_scalar(v)}" for k, v in self.overrides().items()]

    def endpoint_patch(self) -> str:
        """The recommendation as a YAML fragment to merge into the endpoint file."""
        nested: dict[str, Any] = {}
        for dotted, value in self.overrides().items():
            node = nested
            parts = dotted.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        return yaml.safe_dump(nested, sort_keys=False).rstrip() if nested else ""

    def to_dict(self) -> dict[str, Any]:
        base, version = self.base_endpoint, self.skyrl_version
        return {
            "schema": SCHEMA,
            "scenario": self.scenario,
            "variant": self.variant,
            "endpoint": self.endpoint,
            "endpoint_file": self.endpoint_source,
            "skyrl_version": version,
            "released_only": self.released_only,
            "labels": self.labels(),
            "objective": self.objective,
            "objective_key": self.objective_key,
            "margin": self.margin.to_dict(),
            "band": self.margin.band.to_dict(),
            "recommended": self.recommended.to_dict(self.objective, base, version) if self.recommended else None,
            "set": self.set_flags(),
            "endpoint_patch": self.endpoint_patch(),
            "baseline": self.baseline.to_dict(self.objective, base, version),
            "reference_cap1_cap_aware": self.reference.to_dict(self.objective, base, version) if self.reference else None,
            "front": [c.to_dict(self.objective, base, version) for c in self.front],
            "evaluated": len(self.candidates),
            "candidates": [c.to_dict(self.objective, base, version) for c in self.candidates],
            "axes": {a.name: list(a.values) for a in self.axes},
            "fixed": self.fixed,
            "rejected_structures": self.rejected_structures,
            "elapsed_s": self.elapsed_s,
        }

    def write(self, path: str | Path) -> None:
        write_atomic(path, orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def advise(
    scenario_path: str,
    *,
    endpoint: str | None = None,
    variant: str | None = None,
    sets: dict[str, Any] | None = None,
    objective: Objective = "makespan",
    margin: str | None = None,
    fixed: Sequence[str] = (),
    workers: int | None = None,
    rounds: int = ROUNDS,
    executor: Executor | None = None,
    released_only: bool = False,
    on_evaluated: Callable[[int], None] | None = None,
) -> Advice:
    """Search the operator's settings for the scenario's workload; see the module docstring for how. Configurations
    run in local worker processes, or as tasks of ``executor`` (``executors.RayExecutor``) when given.
    ``released_only``: search only what the endpoint's SkyRL version has (PR #1874's settings stay off where it
    lacks them)."""
    started = time.perf_counter()
    if objective not in OBJECTIVES:
        raise UserError(f"--objective {objective}: expected one of {', '.join(OBJECTIVES)}")
    scenario = load_scenario(scenario_path, endpoint)
    name = variant or scenario.variant_names[0]
    if name not in scenario.variant_names:
        raise UserError(f"{scenario.path}: no variant '{name}' (known: {', '.join(scenario.variant_names)})")
    sets = dict(sets or {})
    base = scenario.resolve(name, sets)
    if released_only:
        sets = released_sets(sets, base.endpoint.skyrl_version)
        base = scenario.resolve(name, sets)
    the_margin = parse_margin(margin, band_for(base.endpoint, scenario.path))
    base_endpoint = base.endpoint.model_dump()
    for key in fixed:
        parent = dotted_get(base_endpoint, key.rpartition(".")[0]) if "." in key else base_endpoint
        if not isinstance(parent, dict) or key.rpartition(".")[2] not in parent:
            raise UserError(f"--fix {key}: not an endpoint setting (for example engine.cap_aware_padding)")
    fixed = [*fixed, *(k for k in sets if k not in fixed)]  # a --set value is kept as given, not searched
    axes = search_axes(base, fixed)
    n = pass_requests(base)
    evaluate = Evaluator(
        scenario,
        endpoint,
        name,
        sets,
        the_margin,
        workers or sweeping.default_workers(),
        executor,
        on_evaluated,
        margin_text=margin,
    )
    try:
        baseline = evaluate({})
        start = {k: v for axis in axes for k, v in axis.values[current_choice(axis, base_endpoint)].items()}
        if CAP_AWARE not in fixed:
            start[CAP_AWARE] = True
        search_cap = CAP not in fixed
        frontiers: dict[str, Frontier] = {}
        bounds_lock = threading.Lock()
        rejected: list[dict[str, Any]] = []

        def explore(structure: dict[str, Any]) -> Frontier:
            key = _key(structure)
            if key not in frontiers:
                if search_cap:
                    with bounds_lock:
                        known_safe, known_unsafe = known_caps(structure, axes, frontiers, n)
                    frontier = bisect_cap(evaluate, structure, n, known_safe, known_unsafe)
                else:
                    c = evaluate(structure)
                    frontier = Frontier(structure, "none" if not c.safe else dotted_get(base_endpoint, CAP))
                with bounds_lock:
                    if frontier.max_safe_cap == "none":
                        rejected.append(structure)
                    frontiers[key] = frontier
            return frontiers[key]

        def best_of(structure: dict[str, Any]) -> Candidate | None:
            key = _key(structure)
            return best([c for c in evaluate.cache.values() if _key(_without_cap(c.settings)) == key], objective)

        def score(candidate: Candidate | None) -> tuple[float, int]:
            if candidate is None:
                return (math.inf, 0)
            return (candidate.objective(objective), -(candidate.headroom_bytes or 0))

        def run_chain(chain: list[dict[str, Any]]) -> None:
            for structure in chain:
                if explore(structure).max_safe_cap == "none" and len(chain) > 1 and _more_memory(chain, axes):
                    break

        threads = ThreadPoolExecutor(max_workers=max(1, workers or sweeping.default_workers()))
        try:
            current = dict(start)
            first = [[current]] + ([[{**start, CAP: 1}]] if search_cap else [])  # the cap-1 reference, beside it
            list(threads.map(lambda chain: evaluate(chain[0]) if CAP in chain[0] else run_chain(chain), first))
            for _ in range(max(1, rounds)):
                batch = [{**current, **value} for axis in axes for value in axis.values]
                batch = [b for b in batch if _key(b) != _key(current)]
                list(threads.map(run_chain, search_tasks(batch, axes, current)))
                # one move per axis was tried; combine each axis's best move (if it beat the current structure)
                combined = dict(current)
                for axis in axes:
                    moves = [v for v in axis.values if _key({**current, **v}) != _key(current)]
                    scored = [(score(best_of({**current, **v})), i) for i, v in enumerate(moves)]
                    if scored and min(scored)[0] < score(best_of(current)):
                        combined.update(moves[min(scored)[1]])
                explore(combined)
                winner = best(list(evaluate.cache.values()), objective)
                if winner is None or _key(_without_cap(winner.settings)) == _key(current):
                    break
                current = _without_cap(winner.settings)
        finally:
            threads.shutdown()
        reference = evaluate.cache.get(_key({**start, CAP: 1})) if search_cap else None
        candidates = list(evaluate.cache.values())
    finally:
        evaluate.close()
    return Advice(
        scenario=str(scenario_path),
        variant=name,
        endpoint=base.endpoint.name,
        endpoint_source=scenario.endpoint_source,
        objective=objective,
        margin=the_margin,
        base_endpoint=base_endpoint,
        baseline=baseline,
        reference=reference,
        recommended=recommend(candidates, objective, base_endpoint, reference),
        front=pareto_front(candidates, objective),
        candidates=candidates,
        axes=axes,
        fixed=fixed,
        rejected_structures=rejected,
        elapsed_s=time.perf_counter() - started,
        skyrl_version=base.endpoint.skyrl_version,
        released_only=released_only,
    )


def released_sets(sets: dict[str, Any], version: str) -> dict[str, Any]:
    """``sets`` with every PR #1874 setting ``version`` lacks held off (no cap, no cap-aware padding), so the search
    keeps them as given; a ``--set`` that turns one on contradicts ``--released-only``."""
    out = dict(sets)
    for key in PR_SETTINGS:
        if has_setting(version, key):
            continue
        off = None if key == CAP else False
        for given in (key, f"endpoint.{key}"):
            if given in out and out[given] != off:
                raise UserError(f"--released-only: --set {given}={out[given]} is {PR_SETTING_LABEL} (SkyRL {version})")
            out.pop(given, None)
        out[key] = off
    return out


def _without_cap(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k != CAP}


def _more_memory(chain: list[dict[str, Any]], axes: Sequence[AxisChoice]) -> bool:
    """Whether a chain walks a monotone axis towards more memory (then a rejection ends it)."""
    for axis in axes:
        if not axis.monotone:
            continue
        index = [next((i for i, v in enumerate(axis.values) if all(s.get(k) == x for k, x in v.items())), -1) for s in chain]
        if len(set(index)) == len(index) and -1 not in index:
            return index == sorted(index)
    return True


def search_tasks(batch: list[dict[str, Any]], axes: list[AxisChoice], current: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The structures to explore in one round, as chains run in parallel: a structure on its own, or, on a monotone
    axis, the values above the current one in order of memory, where a rejection at cap 1 ends the chain (every
    larger value would fail too), and the values below it in reverse order (each starts from the caps the one before
    it fits)."""
    tasks: list[list[dict[str, Any]]] = []
    chained: set[str] = set()
    for axis in axes:
        if not axis.monotone:
            continue
        at = next((i for i, v in enumerate(axis.values) if all(current.get(k) == x for k, x in v.items())), 0)
        up = [{**current, **v} for v in axis.values[at + 1 :]]
        down = [{**current, **v} for v in reversed(axis.values[:at])]
        for chain in (up, down):
            if chain:
                tasks.append(chain)
                chained.update(_key(c) for c in chain)
    tasks.extend([s] for s in batch if _key(s) not in chained)
    return tasks


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _short(changes_: dict[str, Any], version: str = "") -> str:
    """The changes in a cell; a setting ``version`` lacks is marked ``*`` (the table's caption says why)."""
    if not changes_:
        return "(as the endpoint)"
    marked = settings_labels(changes_, version) if version else {}
    return ", ".join(f"{k.split('.')[-1]}={v}{' *' if k in marked else ''}" for k, v in changes_.items())


def advice_table(advice: Advice, top: int = 6) -> Any:
    """Evidence: the scenario's settings, the cap-1 reference, the recommendation and the front, side by side."""
    from rich.table import Table

    table = Table(
        title=f"advise {advice.scenario} / {advice.variant} on {advice.endpoint}: objective {advice.objective} "
        f"({OBJECTIVES[advice.objective]}), {len(advice.candidates)} configurations evaluated",
        title_justify="left",
    )
    for column in ("", "changes from the endpoint", "verdict", "OOM", "done", "makespan s", "p95 lat s", "waste"):
        table.add_column(column, justify="left" if column in ("", "changes from the endpoint", "verdict") else "right")
    table.add_column("peak ± band GiB", justify="right")
    table.add_column("headroom GiB", justify="right")
    rows: list[tuple[str, Candidate]] = [("current", advice.baseline)]
    if advice.reference is not None:
        rows.append(("cap 1 + cap-aware", advice.reference))
    marked = set()
    if advice.recommended is not None:
        rows.append(("[bold]recommended[/bold]", advice.recommended))
    shown = {(c.objective(advice.objective), c.headroom_bytes) for _, c in rows}
    rows += [("front", c) for c in advice.front if (c.objective(advice.objective), c.headroom_bytes) not in shown][:top]
    colours = {PASS: "green", AT_RISK: "yellow", FAIL: "red"}
    for label, c in rows:
        s = c.summary

        def sec(key: str, s: dict[str, Any] = s) -> str:
            return "-" if s.get(key) is None else f"{s[key]:.2f}"

        cell_changes = changes(c.settings, advice.base_endpoint)
        marked |= set(settings_labels(cell_changes, advice.skyrl_version))
        table.add_row(
            label,
            _short(cell_changes, advice.skyrl_version),
            f"[{colours[c.verdict]}]{c.verdict}[/{colours[c.verdict]}]",
            str(c.oom_calls),
            f"{s.get('completed')}/{s.get('requests')}",
            sec("makespan_s"),
            sec("latency_p95_s"),
            f"{s.get('padding_waste', 0):.1%}",
            "-" if c.peak_bytes is None else f"{_gib(c.peak_bytes)} ± {_gib(c.band_bytes)}",
            "-" if c.oom_calls else _gib(c.headroom_bytes),
        )
    if marked:
        table.caption = f"* {', '.join(sorted(marked))}: {PR_SETTING_LABEL} (SkyRL {advice.skyrl_version})"
    return table


def print_advice(console: Any, advice: Advice) -> None:
    console.print(advice_table(advice))
    console.print(f"{advice.margin.band.describe()}; {advice.margin.describe()}")
    if advice.recommended is None:
        console.print("[red]no configuration completes every request with the margin[/red]")
        return
    r = advice.recommended
    console.print(
        f"[bold]recommended[/bold]: {OBJECTIVES[advice.objective]} {r.objective(advice.objective):.3g} "
        f"(current: {advice.baseline.verdict}, {advice.baseline.objective(advice.objective):.3g}), "
        f"headroom {_gib(r.headroom_bytes)} GiB >= margin {_gib(r.margin_bytes)} GiB, 0 OOM"
    )
    if advice.set_flags():
        console.print("  " + " ".join(advice.set_flags()))
        for key, label in advice.labels().items():
            version = advice.skyrl_version
            note = f"{key}: {label}; SkyRL {version} has no such setting (--released-only searches without it)"
            console.print(f"  note: {note}")
        console.print(f"endpoint-file patch ({advice.endpoint_source}):")
        console.print("\n".join("  " + line for line in advice.endpoint_patch().splitlines()), highlight=False)
    else:
        console.print("  the endpoint's own settings are already the best found")
    console.print(f"search: {len(advice.candidates)} simulator runs in {advice.elapsed_s:.1f} s")


def cmd_advise(args: Any, console: Any) -> int:
    """``skyrl-sim advise``: exit 0 with a recommendation, 1 when nothing is safe, 2 on bad input."""
    from skyrl_sim.commands.cli_args import parse_sets, scenario_inputs

    sweeping.check_jobs(args.jobs)
    check_outputs([Output("--json", args.json), Output("--plots", args.plots, "dir", stdout=False)], scenario_inputs(args))
    if args.address and args.executor != "ray":
        raise UserError("--address needs --executor ray")
    options: dict[str, Any] = dict(
        endpoint=args.endpoint,
        variant=args.variant,
        sets=parse_sets(args.set),
        objective=args.objective,
        margin=args.margin,
        fixed=args.fix,
        workers=args.jobs,
        released_only=args.released_only,
    )
    with tracking(f"advise {Path(args.scenario).stem}: configurations simulated", None, "runs") as runs:
        options["on_evaluated"] = runs.update
        if args.executor == "ray":
            ray = RayExecutor(address=args.address, num_cpus=args.jobs or sweeping.default_workers())
            with ray.session():
                advice = advise(args.scenario, executor=ray, **options)
        else:
            advice = advise(args.scenario, **options)
    print_advice(console, advice)
    if args.json:
        advice.write(args.json)
        if args.json != "-":
            console.print(f"json: {args.json}")
    if args.plots:
        from skyrl_sim.reports.plots import plot_pareto

        console.print(f"pareto plot: {plot_pareto(advice, Path(args.plots) / 'pareto.png')}")
    return 0 if advice.recommended is not None else 1


def add_parser(sub: Any) -> None:
    """``skyrl-sim advise``: registered by the CLI."""
    p = sub.add_parser(
        "advise",
        help="search engine, trainer and parallelism settings for the best objective with no OOM and a safe headroom",
        description="Exit 0 with a recommendation, 1 when no configuration is safe, 2 on bad input.",
    )
    p.add_argument("scenario", help="scenario YAML file")
    p.add_argument("--variant", help="the variant whose settings are the starting point (default: the first)")
    p.add_argument("--endpoint", help="endpoint name or path, replacing the scenario's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override kept as given (not searched)")
    p.add_argument("--objective", default="makespan", choices=list(OBJECTIVES), help="what to minimise")
    p.add_argument("--margin", metavar="GiB|%", help="headroom a configuration needs: GiB or %% of the peak (default: band)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY", help="keep a setting as it is (repeatable)")
    p.add_argument(
        "--released-only",
        action="store_true",
        help="search only what the endpoint's skyrl_version has: no PR #1874 cap or cap-aware padding where it lacks them",
    )
    p.add_argument("--jobs", type=int, default=None, metavar="N", help="worker processes (default: CPU count)")
    p.add_argument(
        "--executor", choices=EXECUTORS, default="local", help="where configurations run: local processes or Ray tasks"
    )
    p.add_argument("--address", metavar="ADDR", help="with --executor ray: an existing Ray cluster (default: local)")
    p.add_argument("--json", metavar="PATH", help="write the advice (schema skyrl-sim/advise/1)")
    p.add_argument("--plots", metavar="DIR", help="write the Pareto plot (objective against headroom) into DIR")
    p.set_defaults(func=cmd_advise)

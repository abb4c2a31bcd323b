"""How ``advise`` searches the space (``advise_space``) for the fastest safe configuration.

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

The search is a set of tasks, each a generator that yields the configurations it needs next and is sent their
candidates: a cap bisection, a chain of structures, one configuration. ``run_tasks`` advances every live task
together, so each step's configurations run as one batch on the executor (``advise_evaluation.Evaluator``). The order
of evaluations depends on nothing but the scenario, so any number of workers, local or on Ray, makes the same search.
A stop signal ends it with the configurations that finished (``AdviseInterrupted``).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from skyrl_sim.commands.advise_evaluation import OBJECTIVES, Candidate, Evaluator, Objective
from skyrl_sim.commands.advise_report import Advice
from skyrl_sim.commands.advise_space import (
    CAP,
    CAP_AWARE,
    AxisChoice,
    cap_ladder,
    changes,
    current_choice,
    dotted_get,
    held_sets,
    mode_allows,
    pass_requests,
    search_axes,
    settings_key,
    without_cap,
)
from skyrl_sim.commands.executors import Executor, Interrupted, LocalExecutor, default_workers, stop_signals
from skyrl_sim.commands.knobs import BY_KEY, devices_needed, knob_of, unpriced_changes
from skyrl_sim.errors import UserError
from skyrl_sim.results.band import band_for, parse_margin
from skyrl_sim.schema.scenario import load_scenario

ROUNDS = 2
T = TypeVar("T")
Ask = list[dict[str, Any]]
"""The configurations a task needs next."""
Task = Generator[Ask, list[Candidate], T]
"""A search task: yields what it needs, is sent the candidates in the same order, returns its answer."""


def run_tasks(evaluate: Callable[[Ask], list[Candidate]], tasks: Sequence[Task[Any]]) -> list[Any]:
    """Every task's answer, in order: each step, what all live tasks ask for is evaluated as one batch."""
    answers: list[Any] = [None] * len(tasks)
    asks: dict[int, Ask] = {}

    def advance(index: int, sent: list[Candidate] | None) -> None:
        try:
            asks[index] = tasks[index].send(sent)  # type: ignore[arg-type]  # None starts a generator
        except StopIteration as stop:
            asks.pop(index, None)
            answers[index] = stop.value

    for index in range(len(tasks)):
        advance(index, None)
    while asks:
        step = dict(asks)
        candidates = evaluate([settings for ask in step.values() for settings in ask])
        at = 0
        for index, ask in step.items():
            advance(index, candidates[at : at + len(ask)])
            at += len(ask)
    return answers


def one(settings: dict[str, Any]) -> Task[Candidate]:
    """The task of one configuration."""
    (candidate,) = yield [settings]
    return candidate


@dataclass
class Frontier:
    """What a structure (every setting but the cap) allows: its largest safe cap (None: unlimited; "none": no cap)."""

    structure: dict[str, Any]
    max_safe_cap: int | None | Literal["none"]


def bisection(
    structure: dict[str, Any], n: int, known_safe: int = 0, known_unsafe: int | None = None
) -> Task[Frontier]:
    """The largest safe cap of one structure: unlimited first (one run when it fits), then cap 1 (one run rejects the
    structure), then bisection over a geometric ladder of caps and exactly between its last safe and first unsafe rung.
    Assumes safety is monotone in the cap (a larger cap makes calls of more rows and tokens).

    ``known_safe`` / ``known_unsafe``: caps already known to fit / not to fit (from a structure that uses more / less
    memory on a monotone axis); those runs are skipped. The largest safe cap is always run, so every structure kept
    has at least one simulated configuration behind it."""
    unsafe = n + 1 if known_unsafe is None else known_unsafe

    def cap_of(value: int) -> int | None:
        return None if value >= n else value

    def safe(value: int) -> Task[bool]:
        candidate = yield from one({**structure, CAP: cap_of(value)})
        return candidate.safe

    def done(value: int) -> Task[Frontier]:
        if value >= 1:
            yield from one({**structure, CAP: cap_of(value)})
        return Frontier(structure, "none" if value < 1 else cap_of(value))

    if known_safe >= n:
        return (yield from done(n))
    if unsafe > n:
        if (yield from safe(n)):
            return Frontier(structure, None)
        unsafe = n
    if known_safe < 1:
        if unsafe <= 1 or not (yield from safe(1)):
            return Frontier(structure, "none")
        known_safe = 1
    rungs = [r if r is not None else n for r in cap_ladder(n)]
    points = [known_safe, *[r for r in rungs if known_safe < r < unsafe], unsafe]
    good, bad = 0, len(points) - 1
    while bad - good > 1:
        middle = (good + bad) // 2
        if (yield from safe(points[middle])):
            good = middle
        else:
            bad = middle
    lo, hi = points[good], points[bad]
    while hi - lo > 1:
        middle = (lo + hi) // 2
        if (yield from safe(middle)):
            lo = middle
        else:
            hi = middle
    return (yield from done(lo))


def bisect_cap(
    evaluate: Callable[[dict[str, Any]], Candidate],
    structure: dict[str, Any],
    n: int,
    known_safe: int = 0,
    known_unsafe: int | None = None,
) -> Frontier:
    """``bisection`` with each configuration answered by ``evaluate``, one at a time."""
    task = bisection(structure, n, known_safe, known_unsafe)
    (frontier,) = run_tasks(lambda batch: [evaluate(settings) for settings in batch], [task])
    return frontier


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
            frontier = frontiers.get(settings_key({**structure, **value}))
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


def more_memory(chain: list[dict[str, Any]], axes: Sequence[AxisChoice]) -> bool:
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
                chained.update(settings_key(c) for c in chain)
    tasks.extend([s] for s in batch if settings_key(s) not in chained)
    return tasks


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


def priced(candidates: Sequence[Candidate], base: dict[str, Any]) -> list[Candidate]:
    """The safe configurations, without those that change a setting to a value whose cost the time model does not
    price (``knobs.unpriced_changes``: eager vLLM) unless no other is safe: the objective of such a configuration is
    better than it would really be, so it is never ranked against one whose cost is all priced."""
    safe = [c for c in candidates if c.safe]
    return [c for c in safe if not unpriced_changes(changes(c.settings, base))] or safe


def best(candidates: Sequence[Candidate], objective: Objective, base: dict[str, Any]) -> Candidate | None:
    """The safe configuration with the best objective (more headroom breaks ties), among the ``priced`` ones."""
    return min(priced(candidates, base), key=lambda c: (c.objective(objective), -(c.headroom_bytes or 0)), default=None)


TIE = 0.01
"""Objectives within 1% of the best count as equal: of those, the configuration that changes the fewest settings is
recommended (a smaller patch to review and deploy; the simulator's time model is not finer than that)."""


def recommend(
    candidates: Sequence[Candidate], objective: Objective, base: dict[str, Any], reference: Candidate | None = None
) -> Candidate | None:
    """The safe configuration to recommend: within ``TIE`` of the best objective (and never worse than a safe
    ``reference``, cap 1 with cap-aware padding), the fewest settings the endpoint's SkyRL version lacks (``--what-if``:
    a what-if is recommended only where it does better than what the version has), the fewest changes, then the
    best."""
    pool = priced(candidates, base)
    top = best(pool, objective, base)
    if top is None:
        return None
    limit = top.objective(objective) * (1 + TIE) if top.objective(objective) > 0 else top.objective(objective)
    if reference is not None and reference in pool:
        limit = max(top.objective(objective), min(limit, reference.objective(objective)))
    near = [c for c in pool if c.objective(objective) <= limit]
    version = base.get("skyrl_version")  # a whole endpoint's dump has it

    def rank(c: Candidate) -> tuple[int, int, float, int]:
        changed = changes(c.settings, base)
        lacked = 0 if version is None else sum(1 for k in changed if (kb := knob_of(k)) and not kb.available(version))
        return (lacked, len(changed), c.objective(objective), -(c.headroom_bytes or 0))

    return min(near, key=rank)


class Search:
    """One search's state: the evaluator, the axes, and each explored structure's frontier."""

    def __init__(
        self, evaluate: Evaluator, axes: list[AxisChoice], n: int, search_cap: bool, base_endpoint: dict[str, Any]
    ) -> None:
        self.evaluate = evaluate
        self.axes = axes
        self.n = n
        self.search_cap = search_cap
        self.base_endpoint = base_endpoint
        self.frontiers: dict[str, Frontier] = {}
        self.rejected: list[dict[str, Any]] = []

    def run(self, tasks: Sequence[Task[Any]]) -> list[Any]:
        return run_tasks(self.evaluate, tasks)

    def explore(self, structure: dict[str, Any]) -> Task[Frontier]:
        """A structure's frontier: its cap bisected (starting from the bounds its explored neighbours give), or, with
        the cap fixed, one run."""
        key = settings_key(structure)
        if key in self.frontiers:
            return self.frontiers[key]
        if self.search_cap:
            known_safe, known_unsafe = known_caps(structure, self.axes, self.frontiers, self.n)
            frontier = yield from bisection(structure, self.n, known_safe, known_unsafe)
        else:
            candidate = yield from one(structure)
            frontier = Frontier(structure, "none" if not candidate.safe else dotted_get(self.base_endpoint, CAP))
        if key not in self.frontiers:  # another task may have explored it in the same steps
            if frontier.max_safe_cap == "none":
                self.rejected.append(structure)
            self.frontiers[key] = frontier
        return self.frontiers[key]

    def chain(self, structures: list[dict[str, Any]]) -> Task[None]:
        """Structures explored in order; a rejection ends a walk towards more memory on a monotone axis."""
        for structure in structures:
            frontier = yield from self.explore(structure)
            if frontier.max_safe_cap == "none" and len(structures) > 1 and more_memory(structures, self.axes):
                break

    def best_of(self, structure: dict[str, Any], objective: Objective) -> Candidate | None:
        key = settings_key(structure)
        same = [c for c in self.evaluate.cache.values() if settings_key(without_cap(c.settings)) == key]
        return best(same, objective, self.base_endpoint)

    def descend(
        self,
        start: dict[str, Any],
        rounds: int,
        objective: Objective,
        within: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        """Coordinate descent from ``start``: per round, every axis's moves from the current structure (monotone axes
        as chains), then each axis's best move combined; stop when the best configuration (of those ``within`` the
        space searched, when given) stays on this structure."""

        def score(candidate: Candidate | None) -> tuple[bool, float, int]:
            if candidate is None:
                return (True, math.inf, 0)
            unpriced = bool(unpriced_changes(changes(candidate.settings, self.base_endpoint)))
            return (unpriced, candidate.objective(objective), -(candidate.headroom_bytes or 0))

        current = dict(start)
        for _ in range(max(1, rounds)):
            batch = [{**current, **value} for axis in self.axes for value in axis.values]
            batch = [b for b in batch if settings_key(b) != settings_key(current)]
            self.run([self.chain(chain) for chain in search_tasks(batch, self.axes, current)])
            # one move per axis was tried; combine each axis's best move (if it beat the current structure)
            combined = dict(current)
            for axis in self.axes:
                moves = [v for v in axis.values if settings_key({**current, **v}) != settings_key(current)]
                scored = [(score(self.best_of({**current, **v}, objective)), i) for i, v in enumerate(moves)]
                if scored and min(scored)[0] < score(self.best_of(current, objective)):
                    combined.update(moves[min(scored)[1]])
            self.run([self.explore(combined)])
            kept = [c for c in self.evaluate.cache.values() if within is None or within(c.settings)]
            winner = best(kept, objective, self.base_endpoint)
            if winner is None or settings_key(without_cap(winner.settings)) == settings_key(current):
                break
            current = without_cap(winner.settings)


class AdviseInterrupted(Exception):  # noqa: N818 - the user asked for it
    """SIGINT or SIGTERM stopped the search: ``advice`` holds the configurations that finished (marked partial)."""

    def __init__(self, signum: int, advice: Advice) -> None:
        self.signum = signum
        self.advice = advice
        super().__init__(f"advise stopped by signal {signum} after {len(advice.candidates)} configurations")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


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
    what_if: bool = False,
    devices: int | None = None,
    on_evaluated: Callable[[int], None] | None = None,
) -> Advice:
    """Search the operator's settings for the scenario's workload; see the module docstring for how. Configurations
    run on ``executor`` (``executors.RayExecutor``), or in ``workers`` local worker processes (default: one per CPU).

    What may change (``advise_space.MODES``): the knobs the endpoint's SkyRL version has (default); with
    ``released_only`` only those some SkyRL release has too; with ``what_if`` also those the version lacks (PR
    #1874's on 0.4.0), labelled. ``devices``: the most devices a configuration may need (default: what the starting
    configuration needs), and every objective counts them. Raises ``AdviseInterrupted`` with the partial advice when
    SIGINT or SIGTERM stops the search."""
    started = time.perf_counter()
    if objective not in OBJECTIVES:
        raise UserError(f"--objective {objective}: expected one of {', '.join(OBJECTIVES)}")
    if released_only and what_if:
        raise UserError("--released-only and --what-if contradict each other: give one")
    mode = "released" if released_only else "what-if" if what_if else "version"
    scenario = load_scenario(scenario_path, endpoint)
    name = variant or scenario.variant_names[0]
    if name not in scenario.variant_names:
        raise UserError(f"{scenario.path}: no variant '{name}' (known: {', '.join(scenario.variant_names)})")
    sets = dict(sets or {})
    version = scenario.resolve(name, sets).endpoint.skyrl_version
    sets = held_sets(sets, version, mode)
    base = scenario.resolve(name, sets)
    needed = devices_needed(base.endpoint)
    limit = needed if devices is None else devices
    if limit < needed:
        raise UserError(f"--devices {limit}: the starting configuration already needs {needed} devices")
    the_margin = parse_margin(margin, band_for(base.endpoint, scenario.path))
    base_endpoint = base.endpoint.model_dump()
    for key in fixed:
        parent = dotted_get(base_endpoint, key.rpartition(".")[0]) if "." in key else base_endpoint
        if not isinstance(parent, dict) or key.rpartition(".")[2] not in parent:
            raise UserError(f"--fix {key}: not an endpoint setting (for example engine.cap_aware_padding)")
    fixed = [*fixed, *(k for k in sets if k not in fixed)]  # a --set value is kept as given, not searched
    allowed = mode_allows(version, mode)

    def fits(value: dict[str, Any]) -> bool:
        return devices_needed(scenario.resolve(name, {**sets, **value}).endpoint) <= limit

    axes = search_axes(base, fixed, allowed, fits)
    runner = executor or LocalExecutor(workers or default_workers())
    evaluate = Evaluator(scenario, endpoint, name, sets, runner, on_evaluated, margin_text=margin, device_limit=limit)
    search_cap = CAP not in fixed and allowed(BY_KEY[CAP])
    search = Search(evaluate, axes, pass_requests(base), search_cap, base_endpoint)
    start = {k: v for axis in axes for k, v in axis.values[current_choice(axis, base_endpoint)].items()}
    if CAP_AWARE not in fixed and allowed(BY_KEY[CAP_AWARE]):
        start[CAP_AWARE] = True
    reference_settings = {**start, CAP: 1}  # cap 1 with cap-aware padding: the safe choice to beat
    stopped_by: int | None = None
    with stop_signals(raise_at_once=True) as flag:
        try:
            first = [one({}), search.chain([start])] + ([one(reference_settings)] if search_cap else [])
            search.run(first)
            search.descend(start, rounds, objective)
            if start.get(CAP_AWARE) and not BY_KEY[CAP_AWARE].available(base.endpoint.skyrl_version):
                # a what-if (--what-if on a version without it): search what the version has too, so a released
                # setting that does as well is there to be recommended instead (``recommend``)
                own = {**start, CAP_AWARE: False}
                search.run([search.chain([own])])
                search.descend(own, rounds, objective, within=lambda settings: not settings.get(CAP_AWARE))
        except Interrupted as stop:  # a batch was stopped: the evaluator kept what finished
            flag(stop.signum, None)  # so the handlers stay ignored while the partial advice is reported
            stopped_by = stop.signum
        except KeyboardInterrupt:  # the signal came between batches
            stopped_by = flag.signum or signal.SIGINT
    candidates = list(evaluate.cache.values())
    reference = evaluate.cache.get(settings_key(reference_settings)) if search_cap else None
    advice = Advice(
        scenario=str(scenario_path),
        variant=name,
        endpoint=base.endpoint.name,
        endpoint_source=scenario.endpoint_source,
        objective=objective,
        margin=the_margin,
        base_endpoint=base_endpoint,
        baseline=evaluate.cache.get(settings_key({})),
        reference=reference,
        recommended=recommend(candidates, objective, base_endpoint, reference),
        front=pareto_front(candidates, objective),
        candidates=candidates,
        axes=axes,
        fixed=fixed,
        rejected_structures=search.rejected,
        elapsed_s=time.perf_counter() - started,
        skyrl_version=base.endpoint.skyrl_version,
        released_only=released_only,
        mode=mode,
        devices=needed,
        device_limit=limit,
        given=sets,
        partial=stopped_by is not None,
    )
    if stopped_by is not None:
        raise AdviseInterrupted(stopped_by, advice)
    return advice

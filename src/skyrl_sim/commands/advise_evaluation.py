"""How ``advise`` evaluates a configuration: one simulator run per configuration, judged, kept as a ``Candidate``.

The evaluator takes the configurations the search asks for in batches and runs each batch on a shared executor
(``commands.executors``, the ones ``sweep`` uses: local worker processes by default, or Ray tasks), each configuration
once (``commands.points``: the same job, run and verdict as a sweep point). SIGINT or SIGTERM during a batch stops its
workers, keeps the configurations that finished and raises ``executors.Interrupted``; the search then reports what it
has (``advise_search.AdviseInterrupted``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from skyrl_sim.commands.advise_space import changes, settings_key, settings_labels
from skyrl_sim.commands.executors import Executor, Interrupted
from skyrl_sim.commands.knobs import devices_needed
from skyrl_sim.commands.points import Job, cached_host, cached_scenario, run_job, summary_numbers
from skyrl_sim.results.band import held_bytes
from skyrl_sim.results.verdict import AT_RISK, PASS, Status
from skyrl_sim.schema.scenario import ScenarioFile

Objective = Literal["makespan", "p95", "waste"]
OBJECTIVES: dict[str, str] = {"makespan": "makespan_s", "p95": "latency_p95_s", "waste": "padding_waste"}
"""Each objective and the RunResult summary number it reads. What the search minimises is that number times the
devices the configuration needs (``Candidate.objective``: for ``makespan``, GPU-seconds), so a configuration that
needs more hardware is never ranked as if it were free."""


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
    devices: int = 1
    """The devices the configuration needs (``knobs.devices_needed``)."""
    device_limit: int | None = None
    """``advise --devices``: a configuration that needs more is never safe (never recommended)."""

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
    def within_limit(self) -> bool:
        return self.device_limit is None or self.devices <= self.device_limit

    @property
    def safe(self) -> bool:
        """PASS and within the device limit: what may be recommended."""
        return self.verdict == PASS and self.within_limit

    def metric(self, objective: Objective) -> float:
        """The summary number the objective reads (``makespan_s``, ...), per run."""
        value = self.summary.get(OBJECTIVES[objective])
        return math.inf if value is None else float(value)

    def objective(self, objective: Objective) -> float:
        """What the search minimises: the objective's number times the devices the configuration needs (makespan:
        GPU-seconds), so more hardware is paid for."""
        return self.metric(objective) * self.devices

    def to_dict(self, objective: Objective, base: dict[str, Any] | None = None, version: str = "") -> dict[str, Any]:
        labels = settings_labels(self.settings, version) if version else {}
        return {
            "settings": self.settings,
            **({"labels": labels} if labels else {}),
            "changes": changes(self.settings, base) if base is not None else None,
            "verdict": self.verdict,
            "objective": None if math.isinf(self.objective(objective)) else self.objective(objective),
            "devices": self.devices,
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


def run_config(job: Job) -> dict[str, Any]:
    """One configuration on the simulator (in a worker process): the sweep's summary numbers, the most memory any
    completed call held, and its verdict with the margin and band at its highest peak (``points.judge_point``)."""
    result, verdict, _ = run_job(job, "advise configuration")
    summary = summary_numbers(result)
    held = [h for c in result.calls if c.oom is None and not c.error and (h := held_bytes(c)) is not None]
    summary["held_bytes_max"] = max(held) if held else None
    peak = summary.get("peak_bytes_max") or 0
    summary["verdict"] = verdict.status
    summary["margin_bytes"] = verdict.margin.bytes_at(peak)
    summary["band_bytes"] = verdict.margin.band.bytes_at(peak)
    summary.update(vllm_numbers(result))
    return summary


def vllm_numbers(result: Any) -> dict[str, Any]:
    """What a vLLM setting costs or buys: the KV blocks per engine, the generated tokens per second of the run, and
    the step where vLLM's start ran out (None when it started)."""
    inference = result.inference or {}
    start = (inference.get("colocation") or {}).get("start") or inference.get("start") or {}
    kv = inference.get("kv_cache") or {"num_blocks": start.get("kv_blocks")}
    generated = sum(e.get("generation_tokens", 0) for e in inference.get("engines", ()))
    makespan = result.summary().get("makespan_s") or 0
    start_oom = next(
        (c.oom.where.get("start_step") for c in result.calls if c.oom and c.oom.where.get("phase") == "vllm_start"),
        None,
    )
    return {
        "vllm_kv_blocks": kv.get("num_blocks"),
        "generated_tokens_per_s": generated / makespan if makespan else None,
        "vllm_start_oom": start_oom,
    }


class Evaluator:
    """Runs configurations on the simulator in batches on ``executor``, once each, and keeps them (``cache``, by
    ``settings_key``)."""

    def __init__(
        self,
        scenario: ScenarioFile,
        endpoint: str | None,
        variant: str,
        sets: dict[str, Any],
        executor: Executor,
        on_evaluated: Callable[[int], None] | None = None,
        margin_text: str | None = None,
        device_limit: int | None = None,
    ) -> None:
        self.scenario = scenario
        self.endpoint = endpoint
        self.variant = variant
        self.sets = sets
        self.executor = executor
        self.on_evaluated = on_evaluated  # told how many configurations have run so far (the CLI's progress)
        self.margin_text = margin_text  # ``--margin`` as given: each configuration's own band when None
        self.device_limit = device_limit  # ``--devices``: a configuration that needs more is not safe
        self.cache: dict[str, Candidate] = {}
        self.finished = 0
        # what every job loads, loaded here first: forked workers inherit it instead of loading it for each batch
        cached_scenario(str(scenario.path), endpoint)
        cached_host()

    def __call__(self, batch: Sequence[dict[str, Any]]) -> list[Candidate]:
        """The candidate of each configuration in ``batch``, in order; those not run before run now, together.
        Raises ``Interrupted`` (after keeping the finished ones) when a stop signal ends the batch."""
        todo: dict[str, dict[str, Any]] = {}
        for settings in batch:
            key = settings_key(settings)
            if key not in self.cache:
                todo.setdefault(key, dict(settings))
        if todo:
            keys = list(todo)
            # resolved here first: a bad value is one clear error, and each configuration's capacity is its own
            endpoints = {key: self.scenario.resolve(self.variant, {**self.sets, **todo[key]}).endpoint for key in keys}
            sizes = {key: (e.capacity_bytes, devices_needed(e)) for key, e in endpoints.items()}
            jobs = [self._job(todo[key]) for key in keys]
            try:
                summaries = self.executor.map(run_config, jobs, self._done)
            except Interrupted as stop:
                for index, summary in stop.results.items():
                    self._keep(keys[index], todo[keys[index]], summary, sizes[keys[index]])
                raise
            for key, summary in zip(keys, summaries, strict=True):
                self._keep(key, todo[key], summary, sizes[key])
        return [self.cache[settings_key(settings)] for settings in batch]

    def _job(self, settings: dict[str, Any]) -> Job:
        """A configuration as a point a worker runs: judged against completion, as ``sweep --require completed``."""
        path = str(self.scenario.path)
        return Job(path, self.endpoint, self.variant, self.sets, settings, "completed", self.margin_text)

    def _done(self, count: int) -> None:
        self.finished += count
        if self.on_evaluated is not None:
            self.on_evaluated(self.finished)

    def _keep(self, key: str, settings: dict[str, Any], summary: dict[str, Any], size: tuple[int, int]) -> None:
        """Keep one configuration's candidate; ``size``: its capacity in bytes and the devices it needs."""
        summary = dict(summary)
        margin_bytes, band_bytes = summary.pop("margin_bytes"), summary.pop("band_bytes")
        verdict = summary.pop("verdict")
        capacity_bytes, devices = size
        self.cache[key] = Candidate(
            settings, summary, capacity_bytes, margin_bytes, band_bytes, verdict, devices, self.device_limit
        )

"""One configuration of a scenario on the simulator, as ``sweep`` and ``advise`` run it in a worker.

A ``Job`` is plain data (it pickles cheaply to a worker process or a Ray task): the scenario, the variant, the fixed
``--set`` overrides and the point's own settings. ``run_job`` resolves it, runs it on the ``sim`` backend and judges it
with the same verdict ``check`` gives (``results.verdict``), against the variant's expectations or against completion,
with the point's own memory band or ``--margin``. A worker loads each scenario file, the plugin host and the validated
endpoints once and reuses them for every job it runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from skyrl_sim.commands.knobs import devices_needed
from skyrl_sim.errors import UserError
from skyrl_sim.results.band import Validated, validated_endpoints
from skyrl_sim.results.result import RunResult
from skyrl_sim.results.verdict import COMPLETION, Verdict, judge, variant_margin
from skyrl_sim.schema.scenario import ScenarioFile, load_scenario
from skyrl_sim.schema.variant import ResolvedVariant

Require = Literal["expectations", "completed"]
SUMMARY_KEYS = (
    "requests",
    "completed",
    "failed",
    "calls",
    "oom_calls",
    "makespan_s",
    "latency_p50_s",
    "latency_p95_s",
    "queue_wait_p95_s",
    "padding_waste",
    "tokens_per_s",
    "peak_bytes_max",
)
"""The RunResult summary numbers a point keeps (the whole RunResult would be too much for 100s of points)."""


@dataclass(frozen=True)
class Job:
    """What a worker needs to run one point (plain data, so it pickles cheaply)."""

    scenario: str
    endpoint: str | None
    variant: str
    sets: dict[str, Any]
    settings: dict[str, Any]
    require: Require
    margin: str | None = None
    """``--margin`` as given (None: each point's own memory band)."""


_SCENARIOS: dict[tuple[str, str | None], ScenarioFile] = {}
_HOST: list[Any] = []


def cached_scenario(path: str, endpoint: str | None) -> ScenarioFile:
    """The scenario file, loaded once per worker process."""
    key = (path, endpoint)
    if key not in _SCENARIOS:
        _SCENARIOS[key] = load_scenario(path, endpoint)
    return _SCENARIOS[key]


def cached_host() -> Any:
    """The plugin host, built once per worker process."""
    if not _HOST:
        from skyrl_sim.plugin_host.host import PluginHost

        _HOST.append(PluginHost())
    return _HOST[0]


@functools.lru_cache(maxsize=8)
def cached_validated(scenario_path: str) -> tuple[Validated, ...]:
    """The validated endpoints a scenario's bands come from, read once per worker process."""
    return tuple(validated_endpoints(scenario_path))


def judge_point(result: RunResult, variant: ResolvedVariant, job: Job, scenario_path: str) -> Verdict:
    """A point's verdict (``results.verdict.judge``): against the variant's expectations, or ``COMPLETION`` with
    ``require="completed"``, with the point's own band (or ``--margin``)."""
    margin = variant_margin(variant.endpoint, scenario_path, job.margin, list(cached_validated(scenario_path)))
    return judge(result, COMPLETION if job.require == "completed" else variant.expectations, margin)


def run_job(job: Job, what: str) -> tuple[RunResult, Verdict, int]:
    """The job's run on the simulator, its verdict and the devices its configuration needs
    (``knobs.devices_needed``). A bad setting is a ``UserError`` that names ``what`` ran (``sweep point``, ``advise
    configuration``) and its settings: a plain UserError crosses the process boundary, ScenarioError's signature
    does not."""
    try:
        scenario = cached_scenario(job.scenario, job.endpoint)
        variant = scenario.resolve(job.variant, {**job.sets, **job.settings})
        result = cached_host().run(variant, "sim")
    except UserError as exc:
        raise UserError(f"{what} {job.settings}: {exc}") from None
    return result, judge_point(result, variant, job, str(scenario.path)), devices_needed(variant.endpoint)


def summary_numbers(result: RunResult) -> dict[str, Any]:
    """The ``SUMMARY_KEYS`` numbers of a run."""
    full = result.summary()
    return {k: full.get(k) for k in SUMMARY_KEYS}

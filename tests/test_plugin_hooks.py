"""One test per hook, each exercising its hook through a plugin (datasette's ``test_plugin_hooks_have_tests``): the
hooks are found from the spec module, so a new hook without a test here fails ``test_every_hook_has_a_test``.

Each ``test_hook_<name>`` registers a small plugin implementing that hook and checks what the host does with it
(a backend it runs, options it refuses, a padding rule a run applies, a command the CLI runs, a report the CLI
writes, the observers called in order, the models ``calibrate`` gets, the simulator a backend asks for).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from skyrl_sim.api import (
    BackendOptions,
    BackendSpec,
    CallOutcome,
    PaddingRule,
    ReportWriter,
    RowAlignment,
    RunContext,
    SimpyClock,
    UserError,
    drive,
    hookimpl,
    round_up,
)
from skyrl_sim.cli import main
from skyrl_sim.plugin_host import hookspecs
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.testing import host_with, run_scenario

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "scenarios" / "queue_drain_17.yaml"
VARIANT = "cap-aware"
HOOKS = sorted(name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("skyrl_sim_"))


def test_every_hook_has_a_test() -> None:
    """Every hook of the spec module has its ``test_hook_<name>`` in this module (and no test names a hook that is
    gone)."""
    module = sys.modules[__name__]
    tested = {name.removeprefix("test_hook_") for name in dir(module) if name.startswith("test_hook_")}
    assert len(HOOKS) >= 10
    assert set(HOOKS) - tested == set(), f"hooks without a test: {sorted(set(HOOKS) - tested)}"
    assert tested - set(HOOKS) == set(), f"tests of hooks that do not exist: {sorted(tested - set(HOOKS))}"


class FixedExecutor:
    """Every call takes ``seconds`` and succeeds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def batch(self, call: Any, shape: Any) -> CallOutcome:
        return CallOutcome(duration_s=self.seconds, wait_s=self.seconds)

    def single(self, request: Any) -> CallOutcome:
        return CallOutcome(duration_s=self.seconds, wait_s=self.seconds)


class EverySecondOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = Field(1.0, ge=0)


class EverySecond:
    """A backend: SkyRL's engine on simulated time (the host's run driver), every call ``--option seconds``."""

    name = "every-second"

    def run(self, variant: Any, context: RunContext) -> Any:
        options = context.typed_options(EverySecondOptions, self.name)
        return drive(variant, context, context.new_result(variant, self.name), FixedExecutor(options.seconds), SimpyClock())


class BackendPlugin:
    @hookimpl
    def skyrl_sim_backends(self) -> list[BackendSpec]:
        return [BackendSpec(EverySecond.name, EverySecond, "every call one second")]

    @hookimpl
    def skyrl_sim_backend_options(self) -> list[BackendOptions]:
        return [BackendOptions(EverySecond.name, EverySecondOptions)]


def test_hook_skyrl_sim_backends() -> None:
    host = host_with(BackendPlugin())
    assert EverySecond.name in host.backends
    result = run_scenario(host, SEED, VARIANT, backend=EverySecond.name)
    assert result.backend == EverySecond.name and result.calls
    assert all(call.duration_s == pytest.approx(1.0) for call in result.calls)


def test_hook_skyrl_sim_backend_options() -> None:
    host = host_with(BackendPlugin())
    variant = load_scenario(SEED).resolve(VARIANT)
    result = host.run(variant, EverySecond.name, {"seconds": "2.5"})
    assert all(call.duration_s == pytest.approx(2.5) for call in result.calls)
    with pytest.raises(UserError, match="seconds"):
        host.run(variant, EverySecond.name, {"seconds": "-1"})
    with pytest.raises(UserError, match="colour"):
        host.run(variant, EverySecond.name, {"colour": "red"})


def test_hook_skyrl_sim_padding_rules() -> None:
    """A stack whose rows align to four times the data-parallel size: a run whose endpoint names it pads by it."""

    def align(rows: int, endpoint: Any, kind: str) -> RowAlignment:
        alignment = 4 * endpoint.parallelism.dp
        return RowAlignment(round_up(rows, alignment), alignment)

    class Rules:
        @hookimpl
        def skyrl_sim_padding_rules(self) -> list[PaddingRule]:
            return [PaddingRule("by-four", align, description="rows to 4 x dp")]

    host = host_with(Rules())
    assert host.padding_rule("by-four").name == "by-four"
    variant = load_scenario(SEED).resolve(VARIANT, {"trainer.strategy": "by-four"})
    result = host.run(variant, "sim")
    passes = [call for call in result.calls if call.kind in ("forward", "forward_backward")]
    dp = variant.endpoint.parallelism.dp
    assert passes and all(call.padded_rows % (4 * dp) == 0 for call in passes)


def test_hook_skyrl_sim_commands(capsys: pytest.CaptureFixture[str]) -> None:
    said: list[str] = []

    def hello(args: Any, console: Any) -> int:
        said.append(args.name)
        return 7

    class Commands:
        @hookimpl
        def skyrl_sim_commands(self, subparsers: Any) -> None:
            command = subparsers.add_parser("hello", help="say hello")
            command.add_argument("name")
            command.set_defaults(func=hello)

    assert main(["hello", "world"], host=host_with(Commands())) == 7
    assert said == ["world"]


def test_hook_skyrl_sim_report_writers(tmp_path: Path) -> None:
    written: list[tuple[list[str], str]] = []

    def write(results: list[Any], target: str) -> str:
        written.append(([r.variant for r in results], target))
        Path(target).write_text("calls: " + str(sum(len(r.calls) for r in results)))
        return f"wrote {target}"

    class Writers:
        @hookimpl
        def skyrl_sim_report_writers(self) -> list[ReportWriter]:
            return [ReportWriter("--call-count", "PATH", "the number of calls", write)]

    target = tmp_path / "count.txt"
    assert main(["run", str(SEED), "--variant", VARIANT, "--call-count", str(target)], host=host_with(Writers())) == 0
    assert written == [([VARIANT], str(target))] and target.read_text().startswith("calls: ")


class Observer:
    """The three run hooks, recording their order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    @hookimpl
    def skyrl_sim_run_started(self, variant: Any, backend: str) -> None:
        self.events.append(("started", (variant.variant_name, backend)))

    @hookimpl
    def skyrl_sim_call_finished(self, call: Any, result: Any) -> None:
        self.events.append(("call", call.index))

    @hookimpl
    def skyrl_sim_run_finished(self, result: Any) -> None:
        self.events.append(("finished", len(result.calls)))


def test_hook_skyrl_sim_run_started() -> None:
    observer = Observer()
    run_scenario(host_with(observer), SEED, VARIANT)
    assert observer.events[0] == ("started", (VARIANT, "sim"))
    assert [kind for kind, _ in observer.events].count("started") == 1


def test_hook_skyrl_sim_call_finished() -> None:
    observer = Observer()
    result = run_scenario(host_with(observer), SEED, VARIANT)
    assert [index for kind, index in observer.events if kind == "call"] == [call.index for call in result.calls]


def test_hook_skyrl_sim_run_finished() -> None:
    observer = Observer()
    result = run_scenario(host_with(observer), SEED, VARIANT)
    assert observer.events[-1] == ("finished", len(result.calls))  # after every call, with the finished result


def test_hook_skyrl_sim_cost_models() -> None:
    """The first plugin that answers gives ``calibrate`` its models (the last registered is asked first)."""

    class Time:
        def bind(self, endpoint: Any, model: Any) -> Any:
            return self

    class Memory:
        def bind(self, endpoint: Any, model: Any) -> Any:
            return self

    models = (Time(), Memory())

    class Models:
        @hookimpl
        def skyrl_sim_cost_models(self) -> tuple[Any, Any]:
            return models

    assert host_with(Models()).cost_models() == models
    time, memory = host_with().cost_models()  # the simulator's own
    assert type(time).__name__ == "RooflineTimeModel" and type(memory).__name__ == "AllocationWalk"


def test_hook_skyrl_sim_simulator() -> None:
    """A backend asks for the simulated engine with models of its own (``RunContext.simulator``): the plugin that
    answers gets the models and gives the backend."""
    asked: list[tuple[Any, Any]] = []

    class Simulator:
        @hookimpl
        def skyrl_sim_simulator(self, time: Any, memory: Any) -> Any:
            asked.append((time, memory))
            return EverySecond()

    host = host_with(Simulator())
    marker = object()
    backend = RunContext(host=host, options={}).simulator(time=marker)  # type: ignore[arg-type]
    assert isinstance(backend, EverySecond) and asked == [(marker, None)]
    own = RunContext(host=host_with(), options={}).simulator()
    assert type(own).__name__ == "SimBackend"

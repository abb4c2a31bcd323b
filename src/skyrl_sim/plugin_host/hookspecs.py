"""The plugin interface of skyrl-sim: every hook a plugin may implement, grouped by the phase it belongs to.

A plugin is a module (or object) with functions named like the hooks below and marked with ``@hookimpl``; it comes
in through the ``skyrl_sim`` entry-point group (``[project.entry-points.skyrl_sim]`` in its pyproject) or is
registered by hand with ``PluginHost.register``. The built-in simulator and real backend are plugins of exactly this
kind. Registration hooks return small records; the host refuses two plugins that claim one name.

Phases:

1. **Registration** (once, when the host starts): ``skyrl_sim_backends``, ``skyrl_sim_backend_options``,
   ``skyrl_sim_padding_rules``; ``skyrl_sim_commands`` and ``skyrl_sim_report_writers`` when the CLI builds its
   parser.
2. **Run** (per variant run, in order): ``skyrl_sim_run_started``, ``skyrl_sim_call_finished`` (per backend call),
   ``skyrl_sim_run_finished``. These observe; they may annotate the result but must not change what ran.
3. **Services** (on demand, ``firstresult``: the first plugin that answers wins): ``skyrl_sim_cost_models`` (the
   simulator's time and memory models, for ``calibrate``) and ``skyrl_sim_simulator`` (a simulator backend costing
   calls with a plugin's own models, for backends that reuse the simulated engine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pluggy
from pydantic import BaseModel, ConfigDict

from skyrl_sim.schema.options import validate_options

if TYPE_CHECKING:
    from skyrl_sim.engine.shapes import PaddingRule
    from skyrl_sim.plugin_host.costs import MemoryModel, TimeModel
    from skyrl_sim.results.result import CallRecord, RunResult
    from skyrl_sim.schema.variant import ResolvedVariant

PROJECT = "skyrl_sim"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Backend(Protocol):
    """What every backend is: given a resolved scenario variant, run it and return one RunResult.

    ``run`` must not raise for anything a backend call does (an OOM, a crash): those fail the call's requests and
    are recorded in the result. It raises ``UserError`` only for input it cannot run (a setting it does not support).
    """

    name: str

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult: ...


OptionsT = TypeVar("OptionsT", bound=BaseModel)


@dataclass
class RunContext:
    """What the host hands a backend besides the variant: the hooks to call and the backend's ``--option`` values
    (as given: strings; ``typed_options`` validates them against the backend's schema)."""

    host: object
    options: Mapping[str, str]
    progress: Callable[[int], None] | None = None
    """Told how many of the run's requests are done so far (the run driver calls it after each backend call), for the
    CLI's progress bar; None: nobody asked."""

    def typed_options(self, schema: type[OptionsT], backend: str) -> OptionsT:
        """The options validated against ``schema`` (the one the backend declares); unknown keys and bad values raise
        ``UserError`` naming the option and the backend."""
        return validate_options(backend, schema, self.options)

    def simulator(self, time: TimeModel | None = None, memory: MemoryModel | None = None) -> Backend:
        """A simulator backend costing calls with these models (the simulator's own where None), from whichever
        plugin answers ``skyrl_sim_simulator``."""
        from skyrl_sim.errors import PluginError

        backend = self.host.hook.skyrl_sim_simulator(time=time, memory=memory)  # type: ignore[attr-defined]
        if backend is None:
            raise PluginError("no loaded plugin provides a simulator (skyrl_sim_simulator); is 'sim' disabled?")
        return backend

    def new_result(self, variant: ResolvedVariant, backend: str, **fields: Any) -> RunResult:
        """The RunResult a backend fills for ``variant``: its header (scenario, variant, backend and endpoint names,
        the endpoint's memory capacity) written here once for every backend; ``fields`` set or replace any other
        field (a backend that enforces no memory limit passes ``capacity_bytes=None``)."""
        from skyrl_sim.results.result import RunResult

        header: dict[str, Any] = {
            "scenario": variant.scenario.name,
            "variant": variant.variant_name,
            "backend": backend,
            "endpoint": variant.endpoint.name,
            "capacity_bytes": variant.endpoint.capacity_bytes,
        }
        return RunResult(**{**header, **fields})

    def padding_rule(self, strategy: str) -> PaddingRule:
        """The padding rule of a training stack (an endpoint's ``trainer.strategy``), from whichever plugin registered
        it (``skyrl_sim_padding_rules``)."""
        return self.host.padding_rule(strategy)  # type: ignore[attr-defined]

    def call_finished(self, call: CallRecord, result: RunResult) -> None:
        """Tell the observers a backend call has finished (backends call this once per call)."""
        self.host.hook.skyrl_sim_call_finished(call=call, result=result)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class BackendSpec:
    """A backend a plugin provides: its name (``--backend NAME``), a factory, and one line on what it is."""

    name: str
    factory: Callable[[], Backend]
    description: str = ""


class NoOptions(BaseModel):
    """The options of a backend that takes none: any ``--option`` is an error."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class BackendOptions:
    """The settings a backend reads, declared by the plugin that provides it.

    ``schema``: a pydantic model whose fields are the backend's ``--option`` keys (type, default, constraints, and a
    ``description`` that ``skyrl-sim plugins`` prints). The host refuses unknown keys and bad values before the run.

    ``honours``: for a black-box backend (one that cannot see or change the service's calls, like ``tinker``), the
    dotted scenario keys whose overrides it applies (``workload``, ``lora.rank``, ...; a prefix covers its subkeys).
    The host refuses any other key, in a ``--set`` or in a variant's ``set:``, before the run (``check_settings``).
    None (the default): the backend applies every setting.
    """

    backend: str
    schema: type[BaseModel] = NoOptions
    honours: tuple[str, ...] | None = None

    def applies(self, dotted: str) -> bool:
        """Whether this backend applies an override of ``dotted`` (``endpoint.`` may prefix an endpoint key)."""
        if self.honours is None:
            return True
        key = dotted.removeprefix("endpoint.")
        return any(key == h or key.startswith(h + ".") for h in self.honours)


# ---------------------------------------------------------------- phase 1: registration
# Called by PluginHost when it starts, and again whenever a plugin is registered later (PluginHost.register), over every
# plugin loaded so far. Each implementation's list is collected: none of these hooks is firstresult. None is historic
# either: a plugin registered later is asked when the tables are rebuilt, not replayed to.


@hookspec
def skyrl_sim_backends() -> list[BackendSpec]:  # type: ignore[empty-body]
    """Declare the backends this plugin provides.

    Called by: ``PluginHost`` when it starts and after each ``register``.
    Returns: one ``BackendSpec`` per backend (name for ``--backend``, factory, one-line description); ``[]`` for none.
    The factory is called once per run, so a backend may keep state for a run but must not share it across runs.
    Errors: a name another plugin already claims is refused (``PluginError`` naming both plugins).
    """


@hookspec
def skyrl_sim_backend_options() -> list[BackendOptions]:  # type: ignore[empty-body]
    """Declare the settings of the backends this plugin provides (the way pytest plugins declare their options).

    Called by: ``PluginHost`` when it starts and after each ``register``, after ``skyrl_sim_backends``.
    Returns: one ``BackendOptions`` per backend: its ``--option`` schema (a pydantic model; unknown keys and bad values
    are refused before a run) and, for a black-box backend, the scenario keys whose overrides it applies. A backend
    nobody declares options for takes no options and applies every setting.
    Errors: a declaration for a backend no plugin provides, or a second one for a backend (``PluginError``).
    Shown by: ``skyrl-sim plugins`` (every option with its type, default and description).
    """


@hookspec
def skyrl_sim_padding_rules() -> list[PaddingRule]:  # type: ignore[empty-body]
    """Declare the row/width padding rules of the training stacks this plugin knows.

    Called by: ``PluginHost`` when it starts and after each ``register``.
    Returns: ``PaddingRule``s; an endpoint's ``trainer.strategy`` selects one by name (``megatron``, ``fsdp``,
    ``jax``, ...) and the run driver (``driver.drive``) applies it to every call of a run.
    Errors: a name another plugin already claims (``PluginError``).
    """


@hookspec
def skyrl_sim_commands(subparsers: Any) -> None:
    """Add this plugin's subcommands to ``skyrl-sim`` (reports and tools: ``sweep``, ``compare``, ``calibrate``,
    ``advise`` and the other commands beyond ``run``, ``check`` and ``plugins`` come this way, from the built-in
    commands plugin, ``commands/plugin.py``).

    Called by: ``cli.build_parser``, once per CLI invocation, after the CLI's own ``run``, ``check`` and ``plugins``.
    Parameters: ``subparsers``, the argparse sub-parsers action: call ``subparsers.add_parser(NAME, help=...)``, add
    arguments, and ``set_defaults(func=COMMAND)`` with ``COMMAND(args, console) -> int`` (the exit code; raise
    ``UserError`` for bad input, which the CLI prints and exits 2 on).
    Errors: a command name already taken is refused by argparse.
    """


@dataclass(frozen=True)
class ReportWriter:
    """A view of results that ``run`` and ``check`` write after the run when the user passes ``flag TARGET``.

    ``target`` says what TARGET is (a file, or a directory created if missing); ``stdout`` whether ``-`` may stand
    for standard output. ``write(results, target)`` writes the view and returns a line for the terminal ("" for
    none)."""

    flag: str
    metavar: str
    help: str
    write: Callable[[list[RunResult], str], str]
    target: str = "file"
    stdout: bool = False


@hookspec
def skyrl_sim_report_writers() -> list[ReportWriter]:  # type: ignore[empty-body]
    """Declare views of results that ``run`` and ``check`` can write (``--trace PATH`` and ``--plots DIR`` come this
    way).

    Called by: ``cli.build_parser``, once per CLI invocation, before ``run`` and ``check`` get their arguments; the CLI
    checks every given TARGET before the run starts and calls ``write`` after it, in the order plugins were asked.
    Returns: ``ReportWriter``s; a flag another writer (or a built-in argument) already takes is refused by argparse.
    """


# ---------------------------------------------------------------- phase 2: run
# Called for every implementation, in pluggy's order (last registered first); return values are ignored. Observers:
# they may add notes to the result but must not change what ran.


@hookspec
def skyrl_sim_run_started(variant: ResolvedVariant, backend: str) -> None:
    """A variant is about to run.

    Called by: ``PluginHost.run``, after the options and overrides were checked, before the backend's ``run``. No
    built-in plugin implements it: it is for a plugin that observes runs (``tests/test_plugin_hooks.py``).
    Parameters: ``variant``, the resolved scenario variant (endpoint, model, workload, expectations); ``backend``, the
    backend's name.
    """


@hookspec
def skyrl_sim_call_finished(call: CallRecord, result: RunResult) -> None:
    """A backend call has finished (completed, failed, or out of memory).

    Called by: the engine loop (``driver.drive`` wires it through ``RunContext.call_finished``), once per call, in
    call order, while the run goes on; a black-box backend that cannot see calls does not call it.
    Parameters: ``call``, the finished call's record; ``result``, the run's result so far (its ``calls`` may still be
    empty: the loop fills them at the end).
    """


@hookspec
def skyrl_sim_run_finished(result: RunResult) -> None:
    """A backend has returned its RunResult.

    Called by: ``PluginHost.run``, after the backend's ``run`` and the host's own notes, before any report or
    expectation check reads the result. No built-in plugin implements it: it is for a plugin that observes runs
    (``tests/test_plugin_hooks.py``).
    Parameters: ``result``, the finished RunResult.
    """


# ---------------------------------------------------------------- phase 3: services
# Asked on demand; firstresult: pluggy stops at the first implementation that returns something other than None
# (the last registered plugin is asked first, so a test or a plugin can stand in for the simulator's answer).


@hookspec(firstresult=True)
def skyrl_sim_cost_models() -> tuple[TimeModel, MemoryModel] | None:
    """The simulator's own time and memory models (the ones a calibrated profile corrects).

    Called by: ``PluginHost.cost_models``, which ``calibrate`` uses.
    Returns: ``(time model, memory model)``, or None when this plugin has none. firstresult. Each model follows its
    contract in ``skyrl_sim.api`` (``plugin_host/costs.py``): ``bind(endpoint, model)`` gives the model of one run's
    endpoint and model (a ``BoundTimeModel``: ``call_seconds(shape)``, ``sample_seconds(requests)``,
    ``single_seconds(request)``; a ``BoundMemoryModel``: ``evaluate(shape, carried, device)``, the device's memory
    in bytes, ``DeviceMemory``), made once when a run starts and asked about every call. ``calibrate`` also reads
    ``features(shape, endpoint, model)`` of the time model, the seconds per feature it fits a coefficient for.
    """


@hookspec(firstresult=True)
def skyrl_sim_simulator(time: TimeModel | None, memory: MemoryModel | None) -> Backend | None:
    """A simulator backend costing calls with the given models.

    Called by: ``RunContext.simulator``, which a backend calls to reuse the simulated engine with a model of its own
    (no built-in backend does; ``examples/fixed_time_backend`` runs the host's run driver on a clock of its own
    instead, and ``tests/test_backend_options.py`` holds the two to the same calls).
    Parameters: ``time`` and ``memory``: the models to cost calls with (the contracts of ``skyrl_sim_cost_models``:
    the simulator binds each to the run's endpoint and model when the run starts); None keeps the provider's own.
    Returns: a ``Backend``, or None when this plugin provides no simulator. firstresult.
    """

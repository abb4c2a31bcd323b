"""The plugin interface of skyrl-sim: every hook a plugin may implement, grouped by the phase it belongs to.

A plugin is a module (or object) with functions named like the hooks below and marked with ``@hookimpl``; it comes
in through the ``skyrl_sim`` entry-point group (``[project.entry-points.skyrl_sim]`` in its pyproject) or is
registered by hand with ``PluginHost.register``. The built-in simulator and real backend are plugins of exactly this
kind. Registration hooks return small records; the host refuses two plugins that claim one name.

Phases:

1. **Registration** (once, when the host starts): ``skyrl_sim_backends``, ``skyrl_sim_padding_rules``.
2. **Run** (per variant run, in order): ``skyrl_sim_run_started``, ``skyrl_sim_call_finished`` (per backend call),
   ``skyrl_sim_run_finished``. These observe; they may annotate the result but must not change what ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    from skyrl_sim.result import CallRecord, RunResult
    from skyrl_sim.scenario import ResolvedVariant
    from skyrl_sim.shapes import PaddingRule

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


@dataclass
class RunContext:
    """What the host hands a backend besides the variant: the hooks to call and the backend's options."""

    host: object
    options: dict[str, str]

    def call_finished(self, call: CallRecord, result: RunResult) -> None:
        """Tell the observers a backend call has finished (backends call this once per call)."""
        self.host.hook.skyrl_sim_call_finished(call=call, result=result)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class BackendSpec:
    """A backend a plugin provides: its name (``--backend NAME``), a factory, and one line on what it is."""

    name: str
    factory: Callable[[], Backend]
    description: str = ""


# ---------------------------------------------------------------- phase 1: registration


@hookspec
def skyrl_sim_backends() -> list[BackendSpec]:  # type: ignore[empty-body]
    """Called once when the host starts. Return the backends this plugin provides.

    Each name must be unique across all loaded plugins; the host refuses a second plugin that claims a name already
    taken, naming both plugins.
    """


@hookspec
def skyrl_sim_padding_rules() -> list[PaddingRule]:  # type: ignore[empty-body]
    """Called once when the host starts. Return the row/width padding rules of training stacks this plugin knows.

    An endpoint's ``trainer.strategy`` selects one by name (``megatron``, ``fsdp``, ...); names are unique.
    """


# ---------------------------------------------------------------- phase 2: run


@hookspec
def skyrl_sim_run_started(variant: ResolvedVariant, backend: str) -> None:
    """Called before a backend runs a variant, with the resolved variant and the backend's name (for setup, logging)."""


@hookspec
def skyrl_sim_call_finished(call: CallRecord, result: RunResult) -> None:
    """Called by the backend after each backend call has finished (completed or failed), with the result so far."""


@hookspec
def skyrl_sim_run_finished(result: RunResult) -> None:
    """Called after a backend has returned its RunResult, before any report is made from it."""

"""The public API for plugin authors: what a third-party backend, cost model or command needs, from one import.

These names are the contract with plugins and stay stable; the modules behind them may move. A new backend is

* a clock (``VirtualClock`` for simulated time, as the simulator runs; ``SimpyClock``, the same on simpy;
  ``WallClock`` for real time; or your own ``Clock``),
* a call executor (``CallExecutor``: what one backend call costs or does, as a ``CallOutcome``),
* the pydantic schema of its ``--option`` keys (``BackendOptions``),

and ``drive(variant, context, result, executor, clock)`` runs the scenario's clients and SkyRL's engine loop on them.
``examples/fixed_time_backend`` is a complete one.
"""

from __future__ import annotations

from skyrl_sim.engine.loop import CallExecutor, CallOutcome, pass_metrics
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import BatchCall
from skyrl_sim.engine.shapes import CallShape, MicroBatch, PaddingRule
from skyrl_sim.errors import PluginError, UserError
from skyrl_sim.plugin_host.costs import CarriedMemory, MemoryModel, MemoryReport, TimeModel
from skyrl_sim.plugin_host.driver import Clock, SimpyClock, WallClock, drive
from skyrl_sim.plugin_host.hookspecs import Backend, BackendOptions, BackendSpec, RunContext, hookimpl
from skyrl_sim.plugin_host.virtual_clock import VirtualClock
from skyrl_sim.results.result import CallRecord, OomRecord, RunResult
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.variant import ResolvedVariant

__all__ = [
    "Backend",
    "BackendOptions",
    "BackendSpec",
    "BatchCall",
    "CallExecutor",
    "CallOutcome",
    "CallRecord",
    "CallShape",
    "CarriedMemory",
    "Clock",
    "Endpoint",
    "MemoryModel",
    "MemoryReport",
    "MicroBatch",
    "ModelArch",
    "OomRecord",
    "PaddingRule",
    "PluginError",
    "Request",
    "ResolvedVariant",
    "RunContext",
    "RunResult",
    "SimpyClock",
    "TimeModel",
    "UserError",
    "VirtualClock",
    "WallClock",
    "drive",
    "hookimpl",
    "pass_metrics",
]

"""The public API for plugin authors: what a third-party backend, cost model or command needs, from one import.

These names are the contract with plugins and stay stable; the modules behind them may move. The built-in plugins
(``skyrl_sim_plugins``: the simulator, the real backend, the Tinker client) import the host through this module only
(``tests/test_plugin_contract.py``), so what they need is here, on purpose, in the groups below. A new backend is

* a clock (``VirtualClock`` for simulated time, as the simulator runs; ``SimpyClock``, the same on simpy;
  ``WallClock`` for real time; or your own ``Clock``; ``AsyncioClock`` runs the clients alone against a live service),
* a call executor (``CallExecutor``: what one backend call costs or does, as a ``CallOutcome``),
* the pydantic schema of its ``--option`` keys (``BackendOptions``),

and ``drive(variant, context, result, executor, clock)`` runs the scenario's clients and SkyRL's engine loop on them.
``examples/fixed_time_backend`` is a complete one.

The names, by group (``__all__`` lists them so):

* the plugin interface: the hook marker, a backend's spec, its options' schema, the run context;
* running SkyRL's engine: ``drive``, the clocks, a call executor's outcome, a sample wave's results, the futures table,
  and the clients alone (``client_processes`` on an ``AsyncioClock``, for a backend whose service runs its own engine,
  as the Tinker client does);
* SkyRL's engine rules a backend models: the engine's ``Request``, calls and their shapes and padding, pipeline stages,
  the adapter registry and swaps, the routed-expert wire codec (``r3_codec``);
* cost models: the memory and time contracts, memory carried across calls;
* results: ``RunResult`` and its records, and reading an out-of-memory error's text;
* what the user wrote: the resolved variant, its endpoint (LoRA, recompute, vLLM settings), model, hardware profile,
  the limits that bound them, and the ``--option`` validator;
* traffic: a SkyRL service's log, for a backend that reads one;
* errors and units: ``UserError`` (exit 2), ``PluginError``, GiB and dtype sizes.
"""

from __future__ import annotations

from skyrl_sim.engine import r3_codec
from skyrl_sim.engine.clients import Await, Sleep, SleepUntil, Submit, client_script
from skyrl_sim.engine.futures import FuturesTable
from skyrl_sim.engine.loop import CallExecutor, CallOutcome, pass_metrics
from skyrl_sim.engine.pipeline import (
    Stage,
    event_starts,
    pipeline_stages,
    stage_layers,
    stage_plan,
    warmup_microbatches,
)
from skyrl_sim.engine.recorded_routes import busiest_shares, expert_pairs, synthetic_routes
from skyrl_sim.engine.request import Request
from skyrl_sim.engine.rules import SKYRL_TRAIN_STRATEGIES, BatchCall, sampling_mode
from skyrl_sim.engine.sampler import WaveResults
from skyrl_sim.engine.shapes import CallShape, MicroBatch, PaddingRule, RowAlignment, balanced_pack, round_up
from skyrl_sim.engine.tenancy import AdapterRegistry, Signature, Swap, TenancyError, lora_signature
from skyrl_sim.errors import PluginError, UserError
from skyrl_sim.plugin_host.asyncio_clock import AsyncioClock
from skyrl_sim.plugin_host.costs import (
    BoundMemoryModel,
    BoundTimeModel,
    CarriedMemory,
    DeviceMemory,
    MemoryModel,
    MemoryReport,
    TimeModel,
)
from skyrl_sim.plugin_host.driver import (
    ClientTable,
    Clock,
    MeasuredTime,
    SimpyClock,
    SimulatedTimeExceeded,
    WallClock,
    client_processes,
    drive,
)
from skyrl_sim.plugin_host.hookspecs import Backend, BackendOptions, BackendSpec, ReportWriter, RunContext, hookimpl
from skyrl_sim.plugin_host.virtual_clock import VirtualClock
from skyrl_sim.results.oom_text import attempted_bytes, cpu_oom_message, is_oom_text
from skyrl_sim.results.result import CallRecord, OomRecord, RequestRecord, RunResult
from skyrl_sim.schema.architecture import LinearAttentionDims, MlaDims, ModelArch, MoeDims
from skyrl_sim.schema.endpoint import Endpoint, Lora, MoeRouting, Recompute
from skyrl_sim.schema.hardware import HardwareProfile, load_profile, profile_device
from skyrl_sim.schema.inference import Inference
from skyrl_sim.schema.limits import MAX_SIM_TIME_S, MAX_TIME_S
from skyrl_sim.schema.options import validate_options
from skyrl_sim.schema.quantization import Fp8Checkpoint, QuantLinear, ceil_div, fp8_checkpoint, layer_linears, partition
from skyrl_sim.schema.requests import PASSES
from skyrl_sim.schema.skyrl_versions import ALLOCATOR_NOTE, entropy_chunk_tokens
from skyrl_sim.schema.variant import PlannedRequest, ResolvedVariant
from skyrl_sim.schema.vision_tower import VisionTower, vision_tower
from skyrl_sim.schema.vllm_versions import MRV2_LISTED_ARCHITECTURES, VllmRules, lora_rank_refusal
from skyrl_sim.traffic.service_log import LoggedCall, log_size, logged_call_record, read_service_log
from skyrl_sim.units import DTYPE_BYTES, GIB, MODEL_DTYPE_BYTES, format_size

__all__ = [
    # the plugin interface
    "Backend",
    "BackendOptions",
    "BackendSpec",
    "ReportWriter",
    "RunContext",
    "hookimpl",
    # running SkyRL's engine
    "AsyncioClock",
    "Await",
    "CallExecutor",
    "CallOutcome",
    "ClientTable",
    "Clock",
    "FuturesTable",
    "MeasuredTime",
    "SimpyClock",
    "SimulatedTimeExceeded",
    "Sleep",
    "SleepUntil",
    "Submit",
    "VirtualClock",
    "WallClock",
    "WaveResults",
    "client_processes",
    "client_script",
    "drive",
    "pass_metrics",
    # SkyRL's engine rules
    "AdapterRegistry",
    "BatchCall",
    "CallShape",
    "MicroBatch",
    "PASSES",
    "PaddingRule",
    "RowAlignment",
    "PlannedRequest",
    "Request",
    "SKYRL_TRAIN_STRATEGIES",
    "Signature",
    "Stage",
    "Swap",
    "TenancyError",
    "balanced_pack",
    "lora_signature",
    "pipeline_stages",
    "r3_codec",
    "synthetic_routes",
    "busiest_shares",
    "expert_pairs",
    "round_up",
    "sampling_mode",
    "stage_layers",
    "stage_plan",
    "event_starts",
    "warmup_microbatches",
    # cost models
    "BoundMemoryModel",
    "BoundTimeModel",
    "CarriedMemory",
    "DeviceMemory",
    "MemoryModel",
    "MemoryReport",
    "TimeModel",
    # results
    "CallRecord",
    "OomRecord",
    "RequestRecord",
    "RunResult",
    "attempted_bytes",
    "cpu_oom_message",
    "is_oom_text",
    # what the user wrote
    "Endpoint",
    "HardwareProfile",
    "Inference",
    "LinearAttentionDims",
    "Lora",
    "MAX_SIM_TIME_S",
    "MAX_TIME_S",
    "ModelArch",
    "MlaDims",
    "MoeDims",
    "MoeRouting",
    "Recompute",
    "ResolvedVariant",
    "entropy_chunk_tokens",
    "MRV2_LISTED_ARCHITECTURES",
    "Fp8Checkpoint",
    "QuantLinear",
    "ceil_div",
    "fp8_checkpoint",
    "layer_linears",
    "partition",
    "VllmRules",
    "lora_rank_refusal",
    "load_profile",
    "profile_device",
    "validate_options",
    # traffic
    "LoggedCall",
    "log_size",
    "logged_call_record",
    "read_service_log",
    # errors and units
    "DTYPE_BYTES",
    "GIB",
    "MODEL_DTYPE_BYTES",
    "PluginError",
    "UserError",
    "format_size",
    "ALLOCATOR_NOTE",
    "VisionTower",
    "vision_tower",
]

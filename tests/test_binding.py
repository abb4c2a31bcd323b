"""Models bound once: a run binds its memory and time models to its endpoint when it starts, the bound models answer
every call, the choices along each axis are made there (``bound.binding.Binding``, ``description.axes.Axis``), and
the device memory a call may use travels in bytes (``DeviceMemory``), never as a rewritten user setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_sim.api import DeviceMemory, UserError
from skyrl_sim.engine.shapes import MEGATRON, shape_call
from skyrl_sim.plugin_host.hookspecs import RunContext
from skyrl_sim.plugin_host.host import PluginHost
from skyrl_sim.schema.scenario import load_scenario
from skyrl_sim.units import GIB
from skyrl_sim_plugins.sim.backend import SimBackend, SimExecutor
from skyrl_sim_plugins.sim.bound.binding import Binding
from skyrl_sim_plugins.sim.bound.memory import AllocationWalk
from skyrl_sim_plugins.sim.bound.timing import RooflineTimeModel
from skyrl_sim_plugins.sim.description.axes import Axis
from skyrl_sim_plugins.sim.reference.allocator import CPU_EXACT, CUDA_CACHING
from skyrl_sim_plugins.sim.reference.device_memory import ALLOCATORS

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "scenarios" / "queue_drain_17.yaml"
COLOCATED = ROOT / "scenarios" / "colocated_vllm_start.yaml"


def variant(path: Path = SEED, name: str = "cap-aware"):
    return load_scenario(path).resolve(name)


class CountingModels:
    """A memory and a time model that count their binds and the calls their bound models answer, and keep every
    device memory a call was walked on."""

    def __init__(self) -> None:
        self.walk, self.roofline = AllocationWalk(), RooflineTimeModel()
        self.binds = {"memory": 0, "time": 0}
        self.devices: list[DeviceMemory | None] = []

    def memory(self):
        counting = self

        class Memory:
            def bind(self, endpoint, model):
                counting.binds["memory"] += 1
                bound = counting.walk.bind(endpoint, model)

                class Bound:
                    def evaluate(self, shape, carried=None, device=None):
                        counting.devices.append(device)
                        return bound.evaluate(shape, carried, device)

                return Bound()

        return Memory()

    def time(self):
        counting = self

        class Time:
            def bind(self, endpoint, model):
                counting.binds["time"] += 1
                return counting.roofline.bind(endpoint, model)

        return Time()


def test_a_run_binds_each_model_once_and_asks_the_bound_model_every_call() -> None:
    models = CountingModels()
    resolved = variant()
    run = SimBackend(memory=models.memory(), time=models.time()).run(resolved, RunContext(host=PluginHost(), options={}))
    assert models.binds == {"memory": 1, "time": 1}
    assert len(run.calls) > 1 and models.devices  # many calls, one bind
    own = DeviceMemory.of(resolved.endpoint)
    assert all(device == own for device in models.devices)


def test_device_memory_is_bytes_and_matches_the_endpoint_capacity() -> None:
    endpoint = variant().endpoint
    device = DeviceMemory.of(endpoint)
    assert device.capacity_bytes == endpoint.capacity_bytes
    assert device.reserve_bytes == round(endpoint.hardware.reserve_gib * GIB)
    assert device.at_most(device.total_bytes + 1) is device  # more than the process has: nothing changes
    less = device.at_most(device.total_bytes - 10 * GIB)
    assert less.capacity_bytes == device.capacity_bytes - 10 * GIB and less.reserve_bytes == device.reserve_bytes


def test_a_call_on_less_device_memory_runs_out_where_it_fits_on_its_own() -> None:
    """The bound walk takes the device memory per call: the same call fits the endpoint's device and fails on a
    device with less of it, and the failure names that capacity and total in PyTorch's words."""
    resolved = variant()
    endpoint, model = resolved.endpoint, resolved.model
    bound = AllocationWalk().bind(endpoint, model)
    shape = shape_call("forward_backward", [3000, 2000], endpoint, MEGATRON)
    alone = bound.evaluate(shape)
    assert alone.oom is None
    tight = bound.device.at_most(bound.device.reserve_bytes + alone.peak_bytes - 1)
    squeezed = bound.evaluate(shape, None, tight)
    assert squeezed.oom is not None and squeezed.oom.capacity_bytes == tight.capacity_bytes
    assert f"total capacity of {tight.total_bytes / GIB:.2f} GiB" in squeezed.oom.message
    assert bound.evaluate(shape).oom is None  # the bound model keeps no trace of the smaller device


def test_a_colocated_run_walks_training_calls_on_the_device_less_vllms_share() -> None:
    """Once vLLM started on the shared device, a training call's walk gets the device less what vLLM keeps there
    asleep, in bytes, and the result's capacity is that; the endpoint the executor holds is never rewritten."""
    resolved = variant(COLOCATED, "util-0.90")  # vLLM starts beside the offloaded trainer
    endpoint = resolved.endpoint
    before = endpoint.model_dump_json()
    executor = SimExecutor(endpoint, resolved.model, AllocationWalk(), RooflineTimeModel())
    assert executor.device is not None  # the variant shares the device
    assert executor.training_memory() == DeviceMemory.of(endpoint)
    executor.prepare_sampling([])  # vLLM starts on the shared device
    assert executor.device.started
    shared = executor.training_memory()
    asleep = executor.device.vllm_bytes("asleep1")
    assert shared.total_bytes == min(DeviceMemory.of(endpoint).total_bytes, executor.device.sizes.total - asleep)
    assert shared.capacity_bytes < endpoint.capacity_bytes
    assert endpoint.model_dump_json() == before and executor.endpoint is endpoint


def test_the_binding_makes_each_choice_once_from_the_endpoint() -> None:
    resolved = variant()
    binding = Binding.of(resolved.endpoint, resolved.model)
    assert binding.card.name == resolved.endpoint.hardware.profile
    assert binding.allocator is (CUDA_CACHING if binding.card.device == "cuda" else CPU_EXACT)
    assert binding.device == DeviceMemory.of(resolved.endpoint)
    assert AllocationWalk().bind(resolved.endpoint, resolved.model).binding == binding
    assert RooflineTimeModel().bind(resolved.endpoint, resolved.model).binding == binding


def test_an_axis_picks_by_the_endpoint_and_names_what_it_knows() -> None:
    endpoint = variant().endpoint
    axis: Axis[str] = Axis("card", lambda e, m: e.hardware.profile)
    axis.register(endpoint.hardware.profile, "this one")
    assert axis.choose(endpoint) == "this one"
    with pytest.raises(ValueError, match="registered already"):
        axis.register(endpoint.hardware.profile, "again")
    other = endpoint.model_copy(update={"hardware": endpoint.hardware.model_copy(update={"profile": "cpu"})})
    if other.hardware.profile != endpoint.hardware.profile:
        with pytest.raises(UserError, match="no card 'cpu'"):
            axis.choose(other)
    assert set(ALLOCATORS.options()) == {"cuda", "cuda-classic", "cpu"}

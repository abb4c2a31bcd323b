"""The two cost questions a backend call raises, as interfaces: how much memory, and how long.

The simulator asks a ``MemoryModel`` and a ``TimeModel``; the real backend measures both. Keeping the questions
here lets either model be replaced (by a calibrated one, or a plugin's) without touching the engine loop.

**Bound once.** A model is bound to a run's endpoint and model when the run starts (``bind``), and the bound model
(``BoundMemoryModel``, ``BoundTimeModel``) answers every call of the run: what the endpoint chose (its model family,
trainer, allocator, card) is decided there once, never recognised again call by call. What changes during a run
travels as arguments: the memory earlier calls left (``CarriedMemory``) and the device memory a call may use
(``DeviceMemory``, in bytes: a colocated vLLM asleep on the device leaves the trainer less than the card has).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from skyrl_sim.engine.request import Request
from skyrl_sim.engine.shapes import CallShape
from skyrl_sim.results.result import OomRecord
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.units import GIB


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as the trainer's process sees it, in bytes: what a memory model walks a call against.

    ``total_bytes`` is what the process may count as its device's (PyTorch's "total capacity" in an out-of-memory
    message): the card's memory, or the endpoint's ``memory_limit_gib``, at most what another process leaves it (a
    colocated vLLM asleep keeps its share). ``reserve_bytes`` is the process's own memory outside PyTorch's allocator
    (the CUDA context, NCCL: ``hardware.reserve_gib``). PyTorch's allocator may reserve the rest
    (``capacity_bytes``).
    """

    total_bytes: int
    reserve_bytes: int

    @property
    def capacity_bytes(self) -> int:
        """What PyTorch's allocator may reserve: the total less the process's non-PyTorch memory."""
        return self.total_bytes - self.reserve_bytes

    @classmethod
    def of(cls, endpoint: Endpoint) -> DeviceMemory:
        """The endpoint's device, nothing else on it: its capacity is ``Endpoint.capacity_bytes``."""
        reserve = round(endpoint.hardware.reserve_gib * GIB)
        return cls(endpoint.capacity_bytes + reserve, reserve)

    def at_most(self, total_bytes: int) -> DeviceMemory:
        """This device when no more than ``total_bytes`` of it is the process's (another process holds the rest)."""
        return self if total_bytes >= self.total_bytes else replace(self, total_bytes=total_bytes)


@dataclass(frozen=True)
class CarriedMemory:
    """Device memory a worker process keeps from one call to the next, outside the model's own state.

    ``buffers`` maps (data-parallel rank, buffer name) to the bytes held: megatron-core's ``GlobalMemoryBuffer``
    grows to the largest request a process has seen and never shrinks, so a call carries the largest earlier call's
    buffer. Empty at the start of a run. A memory model returns the state after each call; the simulator hands it to
    the next call, in call order.
    """

    buffers: tuple[tuple[tuple[int, str], int], ...] = ()

    def held(self, rank: int) -> dict[str, int]:
        """Buffer name -> bytes held by one data-parallel rank."""
        return {name: size for (r, name), size in self.buffers if r == rank}

    def total(self, rank: int) -> int:
        return sum(self.held(rank).values())

    def with_rank(self, rank: int, held: dict[str, int]) -> CarriedMemory:
        """This state with one rank's buffers replaced."""
        others = [(key, size) for key, size in self.buffers if key[0] != rank]
        mine = [((rank, name), size) for name, size in held.items()]
        return CarriedMemory(tuple(sorted(others + mine)))


@dataclass
class MemoryReport:
    """The memory walk of one call: its peak, what made the peak, and the failing allocation if capacity ran out.

    ``progress`` is the fraction of the call's work done when it failed (1.0 when it did not), so a failed call
    costs only the time it really ran.
    """

    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    oom: OomRecord | None = None
    progress: float = 1.0
    timeline: list[dict[str, Any]] = field(default_factory=list)
    carried: CarriedMemory = field(default_factory=CarriedMemory)  # what the call leaves for the next one
    stage_peaks: list[int] | None = None  # under pipeline parallelism, each stage's peak (the report is of one stage)
    # The classic caching allocator's view of the call, when the endpoint runs it (trainer.use_expandable_segments
    # false): reserved and reserved-but-unallocated bytes at the call's peak and after it, per the busiest rank.
    allocator: dict[str, Any] | None = None
    # A timeline not made yet (a walk that fitted was answered without one): ``resolve_timeline`` makes it.
    deferred_timeline: Callable[[], list[dict[str, Any]]] | None = field(default=None, repr=False, compare=False)

    @property
    def has_timeline(self) -> bool:
        return bool(self.timeline) or self.deferred_timeline is not None

    def resolve_timeline(self) -> list[dict[str, Any]]:
        """The timeline, made now if it was deferred (and kept)."""
        if self.deferred_timeline is not None:
            self.timeline = self.deferred_timeline()
            self.deferred_timeline = None
        return self.timeline


class BoundMemoryModel(Protocol):
    """A memory model bound to one run's endpoint and model (``MemoryModel.bind``): it answers every call of the run."""

    def evaluate(
        self, shape: CallShape, carried: CarriedMemory | None = None, device: DeviceMemory | None = None
    ) -> MemoryReport:
        """One call's memory, given what earlier calls left on the device (``carried``; none when not given), on
        ``device`` (the endpoint's own, ``DeviceMemory.of``, when not given). A report whose call runs out of memory
        names the failing allocation (``MemoryReport.oom``)."""
        ...


class MemoryModel(Protocol):
    """The memory question of the simulator (``skyrl_sim_cost_models``, ``RunContext.simulator``)."""

    def bind(self, endpoint: Endpoint, model: ModelArch) -> BoundMemoryModel:
        """The model bound to one endpoint and model, once per run (the run's calls all ask the bound model)."""
        ...


class BoundTimeModel(Protocol):
    """A time model bound to one run's endpoint and model (``TimeModel.bind``): it answers every call of the run."""

    def call_seconds(self, shape: CallShape) -> float:
        """A forward_backward or forward call over these shapes."""
        ...

    def sample_seconds(self, requests: list[Request]) -> float:
        """One sampling call over these requests (a backend whose samples run on no vLLM model of their own)."""
        ...

    def single_seconds(self, request: Request) -> float:
        """One single (optim_step, save_weights_for_sampler, ...)."""
        ...


class TimeModel(Protocol):
    """The time question of the simulator (``skyrl_sim_cost_models``, ``RunContext.simulator``)."""

    def bind(self, endpoint: Endpoint, model: ModelArch) -> BoundTimeModel:
        """The model bound to one endpoint and model, once per run (the run's calls all ask the bound model)."""
        ...

"""A simulated device allocator: request rounding, allocated vs reserved bytes, and compiled step arrays.

How a request is sized is the device's ``AllocatorRule``:

- ``CUDA_CACHING``: PyTorch's CUDA caching allocator rounds every request up to a multiple of 512 bytes (what
  ``memory_allocated`` reports), and backs requests larger than 1 MiB with reserved memory in 2 MiB steps (what
  ``memory_reserved`` reports; PyTorch reserves it as *segments*, and with ``expandable_segments`` they grow in 2 MiB
  pages, so reserved memory stays within 2 MiB per live allocation).
- ``CUDA_CLASSIC``: the same rounding for the walk's own check, on a device whose workers run the classic caching
  allocator (no expandable segments): its calls are then replayed through fixed segments
  (``bound.classic_allocator``).
- ``CPU_EXACT``: PyTorch's CPU allocator caches nothing: each tensor storage is its own ``posix_memalign`` of exactly
  its ``nbytes``, freed when the storage dies, so allocated = reserved = the bytes of the live storages. That is also
  what the real backend's CPU tensor limit counts (``megatron_vllm.memory_meter``).

A request fails when the reserved memory would pass the capacity PyTorch may use.

A ``StepArray`` is one segment of a call (a layer's forward, its recompute, its backward, the LM head, ...): a list of
allocations and frees as arrays, compiled into cumulative counters, so applying it to the running state is O(1)
unless it may cross the capacity, in which case it is scanned to name the allocation that fails. A
``StepArraySequence`` (a micro-batch's segments) is applied at once with a few array operations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from operator import add

import numpy as np

ALLOCATION_UNIT_BYTES = 512
"""The caching allocator's allocation unit (c10 ``kMinBlockSize``: PyTorch calls it a block); every request rounds up
to a multiple."""
SMALL_SIZE_BYTES = 1 << 20
"""The largest request served from the small pool (c10 ``kSmallSize``)."""
ROUND_LARGE_BYTES = 2 << 20
"""A large allocation pins reserved memory in multiples of this (c10 ``kRoundLarge``)."""

# ``routed_expert_replay``: an MoE micro-batch's replayed expert ids (R3) and their padding mask (moe_routes).
CATEGORIES: tuple[str, ...] = (
    "weights",
    "adapters",
    "saved_activations",
    "logits",
    "transient",
    "routed_expert_replay",
    "persistent_buffers",
)
CATEGORY_INDEX: dict[str, int] = {name: i for i, name in enumerate(CATEGORIES)}
NO_CATEGORIES: tuple[int, ...] = (0,) * len(CATEGORIES)
NEVER = -(2**62)  # ``StepArray.reserved_to_fit`` of a step array that allocates nothing
ONE_HOT = np.eye(len(CATEGORIES), dtype=np.int64)  # row c: category c's column


def round_allocated(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request: a multiple of 512 (at least one unit)."""
    return max(ALLOCATION_UNIT_BYTES, -(-nbytes // ALLOCATION_UNIT_BYTES) * ALLOCATION_UNIT_BYTES)


def round_reserved(nbytes: int) -> int:
    """Bytes of reserved memory a live allocation pins: large ones in 2 MiB pages, small ones as allocated."""
    allocated = round_allocated(nbytes)
    return -(-allocated // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES if allocated > SMALL_SIZE_BYTES else allocated


def round_allocated_array(nbytes: np.ndarray) -> np.ndarray:
    """``round_allocated`` of every element (int64 bytes): the same rule, for a compiled step array's sizes at once.
    ALLOCATION_UNIT_BYTES is a power of two, so rounding up is adding ALLOCATION_UNIT_BYTES - 1 and clearing the low bits (an
    integer division costs more on arrays)."""
    return np.maximum(ALLOCATION_UNIT_BYTES, (nbytes + (ALLOCATION_UNIT_BYTES - 1)) & -ALLOCATION_UNIT_BYTES)


def round_reserved_array(nbytes: np.ndarray) -> np.ndarray:
    """``round_reserved`` of every element (ROUND_LARGE_BYTES is a power of two too)."""
    return reserved_of_allocated_array(round_allocated_array(nbytes))


def reserved_of_allocated_array(allocated: np.ndarray) -> np.ndarray:
    """``round_reserved`` of requests already rounded by ``round_allocated_array`` (a table rounded both ways rounds
    once)."""
    return np.where(allocated > SMALL_SIZE_BYTES, (allocated + (ROUND_LARGE_BYTES - 1)) & -ROUND_LARGE_BYTES, allocated)


@dataclass(frozen=True)
class AllocatorRule:
    """How one device's allocator sizes a request of ``nbytes``: what it counts as allocated, and as reserved (what the
    capacity is checked against). ``caching`` False: every request is exactly its bytes, reserved = allocated.
    ``replays``: the classic caching allocator (no expandable segments), whose reserve also depends on every earlier
    request: the walk keeps this rule's rounding for its own check, and each call is then replayed through fixed
    segments kept from call to call (``caching_allocator``, ``allocation_replay``, ``bound.classic_allocator``)."""

    name: str
    caching: bool
    replays: bool = False

    def allocated(self, nbytes: int) -> int:
        return round_allocated(nbytes) if self.caching else nbytes

    def reserved(self, nbytes: int) -> int:
        return round_reserved(nbytes) if self.caching else nbytes

    def rounded_arrays(self, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every element of an int64 table of request sizes as (allocated, reserved) bytes."""
        if not self.caching:
            return nbytes, nbytes
        allocated = round_allocated_array(nbytes)
        return allocated, reserved_of_allocated_array(allocated)


CUDA_CACHING = AllocatorRule("cuda_caching", caching=True)
CUDA_CLASSIC = AllocatorRule("cuda_classic", caching=True, replays=True)
CPU_EXACT = AllocatorRule("cpu_exact", caching=False)


def allocator_rule(cuda: bool) -> AllocatorRule:
    """The rule of the device whose kernels run (a hardware profile's ``device``)."""
    return CUDA_CACHING if cuda else CPU_EXACT


@dataclass(frozen=True)
class Step:
    """One allocation (``nbytes`` > 0) or free (``nbytes`` < 0) of a step array, already rounded."""

    key: str
    nbytes: int
    reserved: int
    category: int
    op: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class StepArray:
    """A compiled segment: per step its signed, rounded bytes (allocated and reserved) and category, and their
    cumulative effect on the allocator. The steps themselves (names, shapes) are made only when asked for: a walk
    needs the arrays, and a step's name only for the timeline's peak op or a failing allocation."""

    allocated: np.ndarray
    reserved: np.ndarray
    category: np.ndarray
    describe: Callable[[int], Step]
    work: float = 0.0
    label: Callable[[int], str] | None = None  # step i's op name without making the step (default: ``describe``)
    cum_allocated: np.ndarray = field(init=False)
    cum_reserved: np.ndarray = field(init=False)
    peak_allocated: int = field(init=False, default=0)
    peak_reserved: int = field(init=False, default=0)
    # The highest running reserved total at an allocation: the step array fails where the state's reserved plus this
    # passes the capacity (frees never fail). NEVER when the step array allocates nothing.
    reserved_to_fit: int = field(init=False, default=0)
    peak_index: int = field(init=False, default=-1)  # the first step at the highest running total; -1: never above 0
    end_allocated: int = field(init=False, default=0)
    end_reserved: int = field(init=False, default=0)
    _steps: list[Step] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.cum_allocated = np.cumsum(self.allocated)
        self.cum_reserved = np.cumsum(self.reserved)
        if len(self.allocated):
            first = int(self.cum_allocated.argmax())
            top = int(self.cum_allocated[first])
            if top > 0:
                self.peak_index, self.peak_allocated = first, top
            highest = int(self.cum_reserved.argmax())
            self.peak_reserved = max(0, int(self.cum_reserved[highest]))
            if self.allocated[highest] > 0:  # the highest total is reached at an allocation (unless it is step 0's free)
                self.reserved_to_fit = int(self.cum_reserved[highest])
            else:
                allocating = self.allocated > 0
                self.reserved_to_fit = int(self.cum_reserved[allocating].max()) if allocating.any() else NEVER
            self.end_allocated = int(self.cum_allocated[-1])
            self.end_reserved = int(self.cum_reserved[-1])
        else:
            self.reserved_to_fit = NEVER

    @cached_property
    def categories_at_peak(self) -> tuple[int, ...]:
        """Bytes per category the step array holds at its peak (what its steps up to the peak added)."""
        if self.peak_index < 0:
            return NO_CATEGORIES
        stop = self.peak_index + 1
        return tuple((self.allocated[:stop] @ ONE_HOT[self.category[:stop]]).tolist())

    @cached_property
    def end_categories(self) -> tuple[int, ...]:
        """Bytes per category the step array leaves allocated (negative: it freed more than it allocated)."""
        return tuple((self.allocated @ ONE_HOT[self.category]).tolist()) if len(self.allocated) else NO_CATEGORIES

    @classmethod
    def compile(cls, steps: list[Step], work: float = 0.0) -> StepArray:
        """A step array from its steps (already rounded)."""
        array = cls(
            allocated=np.array([s.nbytes for s in steps], dtype=np.int64),
            reserved=np.array([s.reserved for s in steps], dtype=np.int64),
            category=np.array([s.category for s in steps], dtype=np.int64),
            describe=steps.__getitem__,
            work=work,
        )
        array._steps = steps
        return array

    @property
    def steps(self) -> list[Step]:
        if self._steps is None:
            self._steps = [self.describe(i) for i in range(len(self.allocated))]
        return self._steps

    def step(self, index: int) -> Step:
        return self._steps[index] if self._steps is not None else self.describe(index)

    @cached_property
    def peak_op(self) -> tuple[str, int]:
        """The op and bytes of the allocation at which the step array's own running total peaks (``("", 0)`` when there
        is none), without making the step."""
        if self.peak_index < 0:
            return "", 0
        name = self.label(self.peak_index) if self.label else self.step(self.peak_index).op
        return name, int(self.allocated[self.peak_index])


@dataclass
class StepArraySequence:
    """Programs run back to back (a micro-batch's segments): ``distinct[index[i]]`` runs ``i``-th. A micro-batch
    repeats a few step arrays (one per layer kind) many times, so their totals are gathered into arrays with one entry
    per position, and bytes per category are summed only where a walk asks for them."""

    distinct: list[StepArray]
    index: np.ndarray
    end_allocated: np.ndarray = field(init=False)
    end_reserved: np.ndarray = field(init=False)
    peak_allocated: np.ndarray = field(init=False)
    peak_reserved: np.ndarray = field(init=False)
    reserved_to_fit: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        stats = np.array(
            [(p.end_allocated, p.end_reserved, p.peak_allocated, p.peak_reserved, p.reserved_to_fit) for p in self.distinct],
            dtype=np.int64,
        ).reshape(len(self.distinct), 5)[self.index]
        self.end_allocated, self.end_reserved, self.peak_allocated, self.peak_reserved, self.reserved_to_fit = stats.T

    def __len__(self) -> int:
        return len(self.index)

    def categories_before(self, position: int) -> list[int]:
        """Bytes per category the step arrays before ``position`` leave allocated, together."""
        counts = np.bincount(self.index[:position], minlength=len(self.distinct))
        ends = np.array([p.end_categories for p in self.distinct], dtype=np.int64).reshape(len(self.distinct), -1)
        return (counts @ ends).tolist()

    def categories_at_peak(self, position: int) -> tuple[int, ...]:
        return self.distinct[int(self.index[position])].categories_at_peak


@dataclass(frozen=True, slots=True)
class Effect:
    """What a sequence of allocations and frees does to an allocator, in aggregate: the fields of ``StepArray`` that
    ``AllocatorState.apply`` reads, without the steps. Two effects run back to back compose (``then``) exactly as
    their step arrays would run one after the other, so a micro-batch's whole walk can be kept as one effect and applied
    in O(1) when it fits (``memory_lanes``)."""

    end_allocated: int
    end_reserved: int
    peak_allocated: int  # >= 0: the highest running total above the start (0: never above it)
    peak_reserved: int  # >= 0
    reserved_to_fit: int  # the highest running reserved total at an allocation; NEVER when nothing is allocated
    categories_at_peak: tuple[int, ...]
    end_categories: tuple[int, ...]

    @classmethod
    def of(cls, array: StepArray) -> Effect:
        return cls(
            array.end_allocated,
            array.end_reserved,
            array.peak_allocated,
            array.peak_reserved,
            array.reserved_to_fit,
            array.categories_at_peak,
            array.end_categories,
        )

    def then(self, other: Effect | StepArray) -> Effect:
        """This effect followed by ``other``: the first peak wins a tie, as in a step-by-step walk."""
        shifted = self.end_allocated + other.peak_allocated
        if shifted > self.peak_allocated:
            peak, at_peak = shifted, tuple(a + b for a, b in zip(self.end_categories, other.categories_at_peak, strict=True))
        else:
            peak, at_peak = self.peak_allocated, self.categories_at_peak
        if other.reserved_to_fit == NEVER:
            to_fit = self.reserved_to_fit
        elif self.reserved_to_fit == NEVER:
            to_fit = self.end_reserved + other.reserved_to_fit
        else:
            to_fit = max(self.reserved_to_fit, self.end_reserved + other.reserved_to_fit)
        return Effect(
            self.end_allocated + other.end_allocated,
            self.end_reserved + other.end_reserved,
            peak,
            max(self.peak_reserved, self.end_reserved + other.peak_reserved),
            to_fit,
            at_peak,
            tuple(a + b for a, b in zip(self.end_categories, other.end_categories, strict=True)),
        )


NO_EFFECT = Effect(0, 0, 0, 0, NEVER, NO_CATEGORIES, NO_CATEGORIES)


@dataclass
class Failure:
    """The step that crossed the capacity, with the allocator state just before it."""

    step: Step
    index: int
    allocated_before: int
    reserved_before: int


@dataclass
class AllocatorState:
    """Running totals of one rank's allocator over a call (bytes), and the high-water marks."""

    capacity: int
    rule: AllocatorRule = CUDA_CACHING
    allocated: int = 0
    reserved: int = 0
    categories: list[int] = field(default_factory=lambda: [0] * len(CATEGORIES))
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_categories: tuple[int, ...] = NO_CATEGORIES

    def copy(self) -> AllocatorState:
        """An independent state with the same totals and marks."""
        return AllocatorState(
            self.capacity,
            self.rule,
            self.allocated,
            self.reserved,
            list(self.categories),
            self.peak_allocated,
            self.peak_reserved,
            self.peak_categories,
        )

    def hold(self, nbytes: int, category: str) -> None:
        """A long-lived allocation outside any step array (weights, adapter state)."""
        allocated = self.rule.allocated(nbytes)
        self.allocated += allocated
        self.reserved += self.rule.reserved(nbytes)
        self.categories[CATEGORY_INDEX[category]] += allocated
        self._mark(self.allocated, tuple(self.categories))

    def _mark(self, allocated: int, categories: tuple[int, ...]) -> None:
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
            self.peak_categories = categories
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def fits(self, array: StepArray | Effect) -> bool:
        """Whether every allocation of the step array fits (then ``run`` applies it whole)."""
        return self.reserved + array.reserved_to_fit <= self.capacity

    def run(self, array: StepArray) -> Failure | None:
        """Apply a step array; on the first allocation that does not fit, stop before it and return it."""
        if not self.fits(array):
            over = (array.allocated > 0) & (self.reserved + array.cum_reserved > self.capacity)
            index = int(over.argmax())
            alloc_before = int(array.cum_allocated[index - 1]) if index else 0
            res_before = int(array.cum_reserved[index - 1]) if index else 0
            failure = Failure(array.step(index), index, self.allocated + alloc_before, self.reserved + res_before)
            self._partial(array, index)
            return failure
        self.apply(array)
        return None

    def apply(self, array: StepArray | Effect) -> None:
        """Apply a step array (or its effect) that fits whole (``fits``). Called once per fitting micro-batch, so the
        per-category sums are ``map(add, ...)`` (both sides always have one entry per category)."""
        peak = self.allocated + array.peak_allocated
        if peak > self.peak_allocated:
            self.peak_allocated = peak
            self.peak_categories = tuple(map(add, self.categories, array.categories_at_peak))
        self.peak_reserved = max(self.peak_reserved, self.reserved + array.peak_reserved)
        self.allocated += array.end_allocated
        self.reserved += array.end_reserved
        self.categories = list(map(add, self.categories, array.end_categories))

    def run_sequence(self, sequence: StepArraySequence) -> tuple[int, np.ndarray]:
        """Apply step arrays back to back until one would not fit; the same effect as ``run`` on each in turn.

        Returns how many were applied (the sequence's length when all fit; the next one is then the one to ``run``
        step by step) and the allocated bytes before each step array of the sequence.
        """
        before = np.concatenate([[0], np.cumsum(sequence.end_allocated)]) + self.allocated
        reserved_before = np.concatenate([[0], np.cumsum(sequence.end_reserved)]) + self.reserved
        over = reserved_before[:-1] + sequence.reserved_to_fit > self.capacity
        applied = int(over.argmax()) if over.any() else len(sequence)
        if applied:
            peaks = before[:applied] + sequence.peak_allocated[:applied]
            first = int(peaks.argmax())
            if int(peaks[first]) > self.peak_allocated:
                self.peak_allocated = int(peaks[first])
                at_peak = (
                    a + b for a, b in zip(sequence.categories_before(first), sequence.categories_at_peak(first), strict=True)
                )
                self.peak_categories = tuple(a + b for a, b in zip(self.categories, at_peak, strict=True))
            top_reserved = int((reserved_before[:applied] + sequence.peak_reserved[:applied]).max())
            self.peak_reserved = max(self.peak_reserved, top_reserved)
            self.allocated = int(before[applied])
            self.reserved = int(reserved_before[applied])
            ended = sequence.categories_before(applied)
            self.categories = [a + b for a, b in zip(self.categories, ended, strict=True)]
        return applied, before

    def _partial(self, array: StepArray, stop: int) -> None:
        """Account for the steps before a failure (their peak counts toward the call's peak)."""
        arrays = (array.allocated[:stop], array.reserved[:stop], array.category[:stop])
        steps = zip(*(a.tolist() for a in arrays), strict=True)
        for nbytes, reserved, category in steps:
            self.allocated += nbytes
            self.reserved += reserved
            self.categories[category] += nbytes
            self._mark(self.allocated, tuple(self.categories))

"""A simulated caching allocator: block rounding, allocated vs reserved bytes, and compiled op programs.

PyTorch's CUDA caching allocator rounds every request up to a multiple of 512 bytes (what ``memory_allocated``
reports), and backs requests larger than 1 MiB with segments in 2 MiB steps (what ``memory_reserved`` reports; with
``expandable_segments`` the segments grow in 2 MiB pages, so reserved memory stays within 2 MiB per live block of
allocated memory). A request fails when the reserved memory would pass the capacity PyTorch may use.

A ``Program`` is one segment of a call (a layer's forward, its recompute, its backward, the LM head, ...): a list of
allocations and frees. It is compiled once per micro-batch shape into cumulative counters, so applying it to the
running state is O(1) unless it may cross the capacity, in which case it is scanned step by step to name the
allocation that fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK = 512
LARGE = 1 << 20
PAGE = 2 << 20

# ``routed_expert_replay``: an MoE micro-batch's replayed expert ids (R3) and their padding mask (moe_routes).
CATEGORIES: tuple[str, ...] = ("weights", "adapters", "saved_activations", "logits", "transient", "routed_expert_replay")
CATEGORY_INDEX: dict[str, int] = {name: i for i, name in enumerate(CATEGORIES)}
NO_CATEGORIES: tuple[int, ...] = (0,) * len(CATEGORIES)


def round_allocated(nbytes: int) -> int:
    """Bytes the allocator hands out for a request: a multiple of 512 (at least one block)."""
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK)


def round_reserved(nbytes: int) -> int:
    """Bytes of segment memory a live block pins: large blocks in 2 MiB pages, small ones as allocated."""
    allocated = round_allocated(nbytes)
    return -(-allocated // PAGE) * PAGE if allocated > LARGE else allocated


@dataclass(frozen=True)
class Step:
    """One allocation (``nbytes`` > 0) or free (``nbytes`` < 0) of a program, already rounded."""

    key: str
    nbytes: int
    reserved: int
    category: int
    op: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Program:
    """A compiled segment: its steps and the cumulative effect of each step on allocated/reserved bytes."""

    steps: list[Step] = field(default_factory=list)
    cum_allocated: list[int] = field(default_factory=list)
    cum_reserved: list[int] = field(default_factory=list)
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_index: int = -1
    categories_at_peak: tuple[int, ...] = NO_CATEGORIES
    end_allocated: int = 0
    end_reserved: int = 0
    end_categories: tuple[int, ...] = NO_CATEGORIES
    work: float = 0.0

    @classmethod
    def compile(cls, steps: list[Step], work: float = 0.0) -> Program:
        program = cls(steps=steps, work=work)
        allocated = reserved = 0
        cats = [0] * len(CATEGORIES)
        best = 0
        best_cats = tuple(cats)
        for index, step in enumerate(steps):
            allocated += step.nbytes
            reserved += step.reserved
            cats[step.category] += step.nbytes
            program.cum_allocated.append(allocated)
            program.cum_reserved.append(reserved)
            if allocated > best:
                best = allocated
                best_cats = tuple(cats)
                program.peak_index = index
            program.peak_reserved = max(program.peak_reserved, reserved)
        program.peak_allocated = best
        program.categories_at_peak = best_cats
        program.end_allocated = allocated
        program.end_reserved = reserved
        program.end_categories = tuple(cats)
        return program


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
    allocated: int = 0
    reserved: int = 0
    categories: list[int] = field(default_factory=lambda: [0] * len(CATEGORIES))
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_categories: tuple[int, ...] = NO_CATEGORIES

    def hold(self, nbytes: int, category: str) -> None:
        """A long-lived allocation outside any program (weights, adapter state)."""
        allocated = round_allocated(nbytes)
        self.allocated += allocated
        self.reserved += round_reserved(nbytes)
        self.categories[CATEGORY_INDEX[category]] += allocated
        self._mark(self.allocated, tuple(self.categories))

    def _mark(self, allocated: int, categories: tuple[int, ...]) -> None:
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
            self.peak_categories = categories
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def fits(self, program: Program) -> bool:
        return self.reserved + program.peak_reserved <= self.capacity

    def run(self, program: Program) -> Failure | None:
        """Apply a program; on the first allocation that does not fit, stop before it and return it."""
        if not self.fits(program):
            for index, step in enumerate(program.steps):
                if step.nbytes > 0 and self.reserved + program.cum_reserved[index] > self.capacity:
                    before = index - 1
                    alloc_before = program.cum_allocated[before] if before >= 0 else 0
                    res_before = program.cum_reserved[before] if before >= 0 else 0
                    failure = Failure(step, index, self.allocated + alloc_before, self.reserved + res_before)
                    self._partial(program, index)
                    return failure
        peak = self.allocated + program.peak_allocated
        if peak > self.peak_allocated:
            self.peak_allocated = peak
            self.peak_categories = tuple(a + b for a, b in zip(self.categories, program.categories_at_peak, strict=True))
        self.peak_reserved = max(self.peak_reserved, self.reserved + program.peak_reserved)
        self.allocated += program.end_allocated
        self.reserved += program.end_reserved
        for i, delta in enumerate(program.end_categories):
            self.categories[i] += delta
        return None

    def _partial(self, program: Program, stop: int) -> None:
        """Account for the steps before a failure (their peak counts toward the call's peak)."""
        for step in program.steps[:stop]:
            self.allocated += step.nbytes
            self.reserved += step.reserved
            self.categories[step.category] += step.nbytes
            self._mark(self.allocated, tuple(self.categories))

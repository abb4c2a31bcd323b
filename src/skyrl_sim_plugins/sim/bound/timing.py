"""The time model bound to an endpoint: the reference and the fast paths behind caches, as a run asks for them.

``RooflineTimeModel`` is the ``TimeModel`` the simulator runs (``plugin_host.costs``): a run binds it once to its
endpoint and model (``bind``), and the ``BoundRoofline`` it gets answers a micro-batch from its pass kind's compiled
program (``fast.time_program``) where the program is exact, from its tile of widths when it is a padded one, and
from the reference (``reference.time_model``) anywhere else (a pass with an op that is not affine, context parallel
splitting tokens into fractions, a vocabulary TP does not divide); call costs move as plain tuples. Every cache is a
``BoundedCache``. The numbers are the reference's, bit for bit (``tests/test_timing_fast_path.py``).
"""

from __future__ import annotations

from skyrl_sim.api import CallShape, Endpoint, ModelArch, Request
from skyrl_sim_plugins.sim.bound.binding import Binding
from skyrl_sim_plugins.sim.bound.cache import BoundedCache, EndpointBinding
from skyrl_sim_plugins.sim.description.layer_ops import Setup
from skyrl_sim_plugins.sim.fast.time_program import (
    MAX_TILE_PAIRS,
    MicroBatchProgram,
    NotAffine,
    WidthTile,
    evaluate_width_tile,
    microbatch_program,
)
from skyrl_sim_plugins.sim.fast.width_tile import WIDTH_TILE, tile_first
from skyrl_sim_plugins.sim.reference.time_model import (
    NO_COST,
    Cost,
    Fields,
    TimeReference,
    add_fields,
    microbatch_variables,
    pass_kind,
    total_seconds,
    weighted_seconds,
)

MICROBATCH_CACHE_SIZE = 65536
"""Micro-batch costs an endpoint model keeps (a few hundred bytes each)."""
CALL_CACHE_SIZE = 65536
"""Call durations an endpoint model keeps (by ``call_key``)."""
SAMPLE_CACHE_SIZE = 4096
"""Sample-call durations an endpoint model keeps."""
MAX_WIDTH_TILES = 256
"""Tiles an endpoint model keeps (about 25 kB each)."""


def call_key(shape: CallShape) -> tuple[object, ...]:
    """Everything of a call's shape that its cost reads (``BoundRoofline.call_fields``): the pass kind, the logits
    width, the call's rows (its row overhead), and per micro-batch its data-parallel rank, rows, width and packing,
    with a packed micro-batch's row lengths (its attention pairs are per row)."""
    return (
        pass_kind(shape),
        shape.logits_width,
        shape.rows,
        tuple(
            [
                (mb.dp_rank, mb.rows, mb.width, mb.all_row_tokens) if mb.packed else (mb.dp_rank, mb.rows, mb.width)
                for mb in shape.microbatches
            ]
        ),
    )


class BoundRoofline:
    """The time model bound to one endpoint and model (a ``BoundTimeModel``): the run's choices (``binding``), its
    reference (``reference``), each pass kind's compiled program, and the micro-batch, tile, sample and single costs
    asked for so far."""

    def __init__(self, endpoint: Endpoint, model: ModelArch) -> None:
        self.binding = Binding.of(endpoint, model)  # the run's choices, made once
        self.reference = reference = TimeReference(endpoint, model)
        self.endpoint = endpoint
        self.model = model
        self.profile = reference.profile
        self.tp, self.pp, self.cp, self.dp = reference.tp, reference.pp, reference.cp, reference.dp
        self.weights = reference.weights
        self.call_fixed = reference.call_fixed
        self.gradient_all_reduce_s = reference.gradient_all_reduce_s
        self._programs: BoundedCache[str, MicroBatchProgram | None] = BoundedCache(8)
        self._microbatches: BoundedCache[tuple[str, float, float, float], Fields] = BoundedCache(MICROBATCH_CACHE_SIZE)
        self._width_tiles: BoundedCache[tuple[str, int, int], WidthTile] = BoundedCache(MAX_WIDTH_TILES)
        self._samples: BoundedCache[tuple[tuple[int, int, int, bool, bool], ...], float] = BoundedCache(SAMPLE_CACHE_SIZE)
        self._singles: BoundedCache[str, float] = BoundedCache(64)
        self._calls: BoundedCache[tuple[object, ...], float] = BoundedCache(CALL_CACHE_SIZE)
        self._sampler_setups: BoundedCache[bool, Setup] = BoundedCache(2)

    def microbatch_program(self, kind: str) -> MicroBatchProgram | None:
        """The ``MicroBatchProgram`` of a pass kind, built on first use; None when an op of the pass is not affine
        (``fast.time_program.NotAffine``): that pass is priced by the reference."""
        if kind not in self._programs:
            try:
                program: MicroBatchProgram | None = microbatch_program(self.reference, kind)
            except NotAffine:
                program = None
            self._programs.put(kind, program)
        return self._programs[kind]

    def microbatch_fields(self, kind: str, tokens: float, pairs: float, logits_tokens: float) -> Fields:
        """One micro-batch's cost (the reference's, bit for bit), cached by its variables."""
        key = (kind, tokens, pairs, logits_tokens)
        fields = self._microbatches.get(key)
        if fields is None:
            cp = self.cp
            split_tokens, split_pairs = (tokens, pairs) if cp == 1 else (tokens / cp, pairs / cp)
            program = self._programs.get(kind) or self.microbatch_program(kind)
            if program is not None and program.exact(split_tokens, split_pairs, logits_tokens):
                fields = program.evaluate(split_tokens, split_pairs, logits_tokens)
            else:
                fields = self.reference.microbatch(kind, tokens, pairs, logits_tokens).fields()
            self._microbatches.put(key, fields)
        return fields

    def padded_fields(self, kind: str, rows: int, width: int, logits_width: int) -> Fields | None:
        """The cost of a padded micro-batch (``rows`` rows of ``width`` slots, logits over ``logits_width`` each) whose
        logits width is less than TP below its width (a call's longest row, below its width rounded up to TP): bit
        for bit ``microbatch_fields`` of its variables, read from its tile of widths (``WidthTile``: every such
        logits width of WIDTH_TILE widths), which is evaluated whole on first use. None where no tile applies
        (context parallel, another logits width, a width that is not a multiple of TP, a tile past
        ``MAX_TILE_PAIRS``, a lane the program is not exact on): cost it alone. A call's other micro-batches take
        the call's global width as their logits width, a distance that rarely repeats; a tile evaluated for one of
        them would cost more than the micro-batch alone."""
        tp = self.tp
        distance = width - logits_width
        if self.cp != 1 or width % tp or width <= 0 or not 0 <= distance < tp:
            return None
        first = tile_first(width, tp)
        key = (kind, rows, first)
        tile = self._width_tiles.get(key)
        if tile is None:
            widest = tp * (first + WIDTH_TILE - 1)
            program = self.microbatch_program(kind)
            if rows * widest * widest >= MAX_TILE_PAIRS or program is None:
                return None
            tile = self._width_tiles.put(key, evaluate_width_tile(program, tp, rows, first))
        lane = (width // tp - tile.first) * tp + distance
        if not tile.exact[lane]:
            return None
        return tile.program.fields_of(tile.fields[lane].tolist())

    def call_fields(self, shape: CallShape) -> Fields:
        """A call's cost: the slowest data-parallel rank's micro-batches (one stage's, plus the pipeline bubble), the
        call and row overheads, the LoRA gradients' all-reduce over DP after a forward_backward."""
        kind, logits_width, tp, pp = pass_kind(shape), shape.logits_width, self.tp, self.pp
        # Each rank's micro-batches in call order, added one after the other (``Cost.add`` from zero; a rank's first
        # is taken as it is: 0.0 + x is x, and no cost is negative).
        ranks = [NO_COST] * self.dp
        longest = [0.0] * self.dp
        for mb in shape.microbatches:
            one = None if mb.packed or not logits_width else self.padded_fields(kind, mb.rows, mb.width, logits_width)
            if one is None:
                tokens, pairs = microbatch_variables(mb, tp)
                logits = float(mb.rows * logits_width) if logits_width and not mb.packed else tokens
                one = self.microbatch_fields(kind, tokens, pairs, logits)
            rank = mb.dp_rank
            so_far = ranks[rank]
            ranks[rank] = one if so_far is NO_COST else add_fields(so_far, one)
            if pp > 1:
                longest[rank] = max(longest[rank], total_seconds(one))
        slowest, slowest_s = NO_COST, 0.0
        for rank, rank_cost in enumerate(ranks):
            if pp > 1:
                # Costs above are one stage's; the classic 1F1B bubble adds (pp - 1) slots of the longest micro-batch.
                bubble = rank_cost[4] + (pp - 1) * longest[rank]
                rank_cost = (*rank_cost[:4], bubble, *rank_cost[5:])  # type: ignore[assignment]
            rank_s = total_seconds(rank_cost)
            if rank_s >= slowest_s:
                slowest, slowest_s = rank_cost, rank_s
        matmul_s, attention_s, memory_s, comm_s, fixed_s, flops, moved, ops = slowest
        if kind != "forward" and self.dp > 1:
            comm_s += self.gradient_all_reduce_s
        call_s, row_s = self.call_fixed
        return (matmul_s, attention_s, memory_s, comm_s, fixed_s + (call_s + row_s * shape.rows), flops, moved, ops)

    def call(self, shape: CallShape) -> Cost:
        return Cost(*self.call_fields(shape))

    def call_seconds(self, shape: CallShape) -> float:
        """A call's duration with the profile's calibrated coefficients, kept by everything of the shape the cost
        reads (``call_key``: a service's calls repeat a few hundred shapes)."""
        key = call_key(shape)
        seconds = self._calls.get(key)
        if seconds is None:
            seconds = self._calls.put(key, weighted_seconds(self.weights, self.call_fields(shape)))
        return seconds

    def sample_seconds(self, requests: list[Request]) -> float:
        """A sample call's duration, kept by what ``TimeReference.sample`` reads of its requests, in order (a
        service's sample calls repeat a few prompt and generation lengths)."""
        key = tuple((r.prompt_tokens, r.max_tokens, r.num_samples, bool(r.checkpoint), r.prompt_logprobs) for r in requests)
        seconds = self._samples.get(key)
        if seconds is None:
            with_lora = any(r.checkpoint for r in requests)
            setup = self._sampler_setups.get_or_make(with_lora, lambda: self.reference.sampler_setup(with_lora))
            cost = self.reference.sample(requests, setup)
            seconds = self._samples.put(key, cost.seconds(self.profile.time_coefficients))
        return seconds

    def single_seconds(self, request: Request) -> float:
        """A single request's duration: it depends on the request's type only, so it is kept per type."""
        seconds = self._singles.get(request.type)
        if seconds is None:
            cost = self.reference.single(request)
            seconds = self._singles.put(request.type, cost.seconds(self.profile.time_coefficients))
        return seconds


class RooflineTimeModel:
    """``TimeModel`` from FLOPs, bytes and collectives over the endpoint's hardware profile (``reference.time_model``):
    ``bind`` gives the model of one endpoint (``BoundRoofline``, a ``BoundTimeModel``), which a run makes once and asks
    about every call.

    ``call_cost``, ``features`` and the ``*_seconds`` methods (with an endpoint and model) answer one question
    without keeping the bound model: they bind (the endpoint and model asked about last are recognised by identity,
    any other by its settings) and ask it, for a test, a script or a calibration over many endpoints."""

    def __init__(self) -> None:
        self._binding: EndpointBinding[BoundRoofline] = EndpointBinding(BoundRoofline)

    def bind(self, endpoint: Endpoint, model: ModelArch) -> BoundRoofline:
        """The model bound to ``endpoint`` and ``model`` (made once, kept per settings)."""
        return self._binding.bind(endpoint, model)

    def call_cost(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> Cost:
        return self.bind(endpoint, model).call(shape)

    def features(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> dict[str, float]:
        """A pass call's time terms in seconds on the uncalibrated profile (``calibrate`` fits a factor for each)."""
        return self.call_cost(shape, endpoint, model).features()

    def call_seconds(self, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> float:
        return self.bind(endpoint, model).call_seconds(shape)

    def sample_seconds(self, requests: list[Request], endpoint: Endpoint, model: ModelArch) -> float:
        return self.bind(endpoint, model).sample_seconds(requests)

    def single_seconds(self, request: Request, endpoint: Endpoint, model: ModelArch) -> float:
        return self.bind(endpoint, model).single_seconds(request)


def default_time_model() -> RooflineTimeModel:
    return RooflineTimeModel()

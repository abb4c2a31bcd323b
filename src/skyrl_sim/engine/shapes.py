"""What shapes a backend call becomes on its way to the trainer (SkyRL-Train's batch preparation).

Per call: each datum's row is its input plus the last target token (L + 1); all rows are left-padded to the call's
longest row (the global width S); the rows are padded to the backend's row alignment with copies of row 0 (zero loss
mask, full compute); the batch is cut into DP chunks and each chunk into micro-batches, by rows or by a token budget;
inside a micro-batch the rows are either packed (THD, each row rounded up to TP) or trimmed to the micro-batch's
longest row rounded up to TP. Row alignment differs per training stack, so it is a ``PaddingRule`` plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from skyrl_sim.engine.frozen import quick_init
from skyrl_sim.schema.endpoint import Endpoint


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@quick_init
@dataclass(frozen=True, slots=True)
class RowAlignment:
    """How many rows a call runs as, and why."""

    padded_rows: int
    alignment: int


@dataclass(frozen=True)
class PaddingRule:
    """A training stack's row and width padding.

    ``align_rows(rows, endpoint, kind)`` gives the padded row count; ``row_width(longest_row, endpoint)`` the width
    every row of the call is padded to before micro-batching (the global width S for Megatron and FSDP).
    """

    name: str
    align_rows: Callable[[int, Endpoint, str], RowAlignment]
    row_width: Callable[[int, Endpoint], int] = lambda longest, _endpoint: longest
    description: str = ""
    uniform_microbatch_rows: bool = False
    """Megatron's ``forward_backward_func`` takes one micro-batch size: under token batching the worker pads every
    micro-batch to the same row count (when the endpoint's SkyRL revision does: ``token_batching_pads_rows``)."""
    trims_microbatches: bool = True
    """Megatron's worker trims each micro-batch of padded rows to its longest row (``remove_left_padding``); SkyRL's
    FSDP worker runs every row at the call's width (``SampleBasedBatchIterator`` slices rows, nothing trims them)."""


def call_micro_batch_size(rows: int, endpoint: Endpoint, kind: str) -> int:
    """The micro-batch size a call of ``rows`` rows is padded to and cut by: the endpoint's for the call's kind,
    capped at the call's own row count under PR #1874's cap-aware padding (``engine.cap_aware_padding``: never pad a
    call past its own rows). The one definition of the rule: row alignment and micro-batching both read it."""
    micro = endpoint.micro_batch_size(kind)
    return min(rows, micro) if endpoint.engine.cap_aware_padding else micro


def megatron_align_rows(rows: int, endpoint: Endpoint, kind: str) -> RowAlignment:
    """``_pad_batch``: rows to a multiple of dp x micro (``call_micro_batch_size``)."""
    micro = call_micro_batch_size(rows, endpoint, kind)
    alignment = endpoint.parallelism.dp * micro
    return RowAlignment(round_up(rows, alignment), alignment)


def fsdp_align_rows(rows: int, endpoint: Endpoint, kind: str) -> RowAlignment:
    """FSDP aligns rows to the data-parallel size only."""
    alignment = endpoint.parallelism.dp
    return RowAlignment(round_up(rows, alignment), alignment)


MEGATRON = PaddingRule(
    "megatron", megatron_align_rows, description="rows to dp x micro with copies of row 0", uniform_microbatch_rows=True
)
FSDP = PaddingRule(
    "fsdp", fsdp_align_rows, description="rows to dp with copies of row 0, every row at the call's width",
    trims_microbatches=False,
)


@quick_init
@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch on one DP rank.

    ``row_tokens`` are the real tokens of each row (a pad row is a copy of row 0 and has its tokens);
    ``pad_rows`` how many of them are pad rows; ``width`` the sequence length the model runs over (BSHD: every row;
    THD: the packed total); ``dummy`` marks a 1-token micro-batch that only equalises counts across DP ranks;
    ``dummy_rows`` one-token rows after ``row_tokens`` that pad the micro-batch to its rank's largest row count
    (``_pad_microbatch_to_size`` under token batching: computed, never in the loss).
    """

    dp_rank: int
    row_tokens: tuple[int, ...]
    width: int
    packed: bool
    pad_rows: int = 0
    dummy: bool = False
    dummy_rows: int = 0

    @property
    def rows(self) -> int:
        """Rows the model runs over, dummy rows included."""
        return len(self.row_tokens) + self.dummy_rows

    @property
    def all_row_tokens(self) -> tuple[int, ...]:
        """The tokens of every row the model runs over: ``row_tokens`` then one token per dummy row."""
        return self.row_tokens + (1,) * self.dummy_rows if self.dummy_rows else self.row_tokens

    @property
    def slots(self) -> int:
        """Token positions the model computes."""
        return self.width if self.packed else self.rows * self.width

    @property
    def real_tokens(self) -> int:
        return sum(self.row_tokens)


@quick_init
@dataclass(frozen=True, slots=True)
class CallShape:
    """A call's shapes as they reach the trainer. ``width`` is the global width S (longest row)."""

    kind: str
    rows: int
    padded_rows: int
    alignment: int
    width: int
    row_tokens: tuple[int, ...]
    microbatches: tuple[MicroBatch, ...]
    logits_width: int
    log: tuple[str, ...] = field(default=())
    loss_fn: str = "cross_entropy"

    @property
    def rl_path(self) -> bool:
        """Whether the call takes SkyRL's RL path (``megatron_model_wrapper.loss_func``): a forward_backward whose
        loss is not cross-entropy. It computes an entropy metric over the action logits besides the log-probs.
        (SkyRL runs a whole call with its first request's loss, and a forward never takes a loss.)"""
        return self.kind == "forward_backward" and self.loss_fn != "cross_entropy"

    @property
    def real_tokens(self) -> int:
        """Tokens of the call's own rows (input + 1 each); pad rows are not counted."""
        return sum(self.row_tokens[: self.rows])

    @property
    def slots(self) -> int:
        """Token positions computed, pad rows and width padding included."""
        return sum(mb.slots for mb in self.microbatches)

    def microbatches_of_rank(self, rank: int) -> list[MicroBatch]:
        return [mb for mb in self.microbatches if mb.dp_rank == rank]


def balanced_pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices packed into bins of at most ``budget`` tokens: longest first, each into the least-loaded bin it fits;
    a sequence that fits nowhere opens a bin (an over-budget one gets its own). Bins keep index order inside."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        fits = [b for b in range(len(bins)) if loads[b] + lengths[i] <= budget]
        if fits:
            target = min(fits, key=lambda b: (loads[b], b))
            bins[target].append(i)
            loads[target] += lengths[i]
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def _micro_batch(rank: int, tokens: list[int], pads: int, tp: int, packed: bool, width: int = 0) -> MicroBatch:
    """One micro-batch of ``tokens`` rows: packed, or trimmed to its longest row rounded up to TP (``width`` > 0:
    every row at that width, the call's, as SkyRL's FSDP worker runs them)."""
    if width and not packed:
        return MicroBatch(rank, tuple(tokens), width, False, pads)
    if packed:
        width = sum(-(-t // tp) * tp for t in tokens)
        return MicroBatch(rank, tuple(tokens), width, True, pads)
    return MicroBatch(rank, tuple(tokens), round_up(max(tokens), tp), False, pads)


def pad_to_uniform_rows(batches: list[MicroBatch], tp: int) -> list[MicroBatch]:
    """``_pad_microbatch_to_size``: every micro-batch of one rank padded with one-token dummy rows to the largest
    row count among them. A dummy row adds one token (rounded up to TP) to a packed micro-batch and a row of the
    micro-batch's width to a padded one."""
    most = max(mb.rows for mb in batches)
    out = []
    for mb in batches:
        extra = most - mb.rows
        if not extra:
            out.append(mb)
            continue
        width = mb.width + extra * round_up(1, tp) if mb.packed else mb.width
        out.append(replace(mb, width=width, dummy_rows=mb.dummy_rows + extra))
    return out


@lru_cache(maxsize=4096)
def padding_log(rows: int, padded_rows: int, alignment: int) -> tuple[str, ...]:
    """The engine's log line of a call padded from ``rows`` to ``padded_rows`` rows (one per distinct padding: a long
    run pads a million calls, and the run's log keeps every line)."""
    return (f"Padded batch from {rows} to {padded_rows} (alignment={alignment})",)


def shape_call(
    kind: str, datum_lengths: Sequence[int], endpoint: Endpoint, rule: PaddingRule, loss_fn: str = "cross_entropy"
) -> CallShape:
    """The shapes of a forward_backward or forward call over datums of the given input lengths; ``loss_fn`` is the
    loss the call runs with (its first request's, as SkyRL runs a whole call).

    Rows ``rows`` and after are pad rows, so a micro-batch's pad rows are counted from its index range (a run shapes
    a call per batch, so this stays free of per-row bookkeeping)."""
    if not datum_lengths:
        raise ValueError("a call needs at least one datum")
    real = [length + 1 for length in datum_lengths]
    rows = len(real)
    width = rule.row_width(max(real), endpoint)
    aligned = rule.align_rows(rows, endpoint, kind)
    padded_rows = aligned.padded_rows
    pad_rows = padded_rows - rows
    row_tokens = real + [real[0]] * pad_rows if pad_rows else real
    log = padding_log(rows, padded_rows, aligned.alignment) if pad_rows else ()

    trainer = endpoint.trainer
    parallelism = endpoint.parallelism
    tp = parallelism.tp
    packed = trainer.remove_microbatch_padding
    untrimmed = 0 if rule.trims_microbatches else width  # the FSDP worker's rows stay at the call's width
    dp = parallelism.dp
    per_rank = padded_rows // dp if padded_rows % dp == 0 else -(-padded_rows // dp)
    budget = trainer.max_tokens_per_microbatch
    micro = call_micro_batch_size(rows, endpoint, kind) if budget <= 0 else 0  # rows a micro-batch without a budget
    total = len(row_tokens)
    microbatches: list[MicroBatch] = []
    per_rank_batches: list[list[MicroBatch]] = []
    for rank in range(dp):
        lo, hi = rank * per_rank, min((rank + 1) * per_rank, total)
        if budget > 0:
            tokens = row_tokens[lo:hi]
            batches = [
                _micro_batch(rank, [tokens[i] for i in g], sum(lo + i >= rows for i in g), tp, packed, untrimmed)
                for g in balanced_pack(tokens, budget)
                if g
            ]
            per_rank_batches.append(batches)
            continue
        for start in range(lo, hi, micro):
            end = min(start + micro, hi)
            pads = end - max(start, rows) if end > rows else 0
            microbatches.append(_micro_batch(rank, row_tokens[start:end], pads, tp, packed, untrimmed))
    if budget > 0:
        most = max(len(b) for b in per_rank_batches)
        uniform = rule.uniform_microbatch_rows and endpoint.rules.token_batching_pads_rows
        for rank, batches in enumerate(per_rank_batches):
            batches.extend(MicroBatch(rank, (1,), 1, packed=True, dummy=True) for _ in range(most - len(batches)))
            microbatches.extend(pad_to_uniform_rows(batches, tp) if uniform and batches else batches)
    # positional (a call a batch): kind, rows, padded_rows, alignment, width, row_tokens, microbatches,
    # logits_width, log, loss_fn
    return CallShape(
        kind,
        rows,
        padded_rows,
        aligned.alignment,
        width,
        tuple(row_tokens),
        tuple(microbatches),
        width if not packed else 0,
        log,
        loss_fn,
    )

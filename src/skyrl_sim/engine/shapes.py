"""What shapes a backend call becomes on its way to the trainer (SkyRL-Train's batch preparation).

Per call: each datum's row is its input plus the last target token (L + 1); all rows are left-padded to the call's
longest row (the global width S); the rows are padded to the backend's row alignment with copies of row 0 (zero loss
mask, full compute); the batch is cut into DP chunks and each chunk into micro-batches, by rows or by a token budget;
inside a micro-batch the rows are either packed (THD, each row rounded up to TP) or trimmed to the micro-batch's
longest row rounded up to TP. Row alignment differs per training stack, so it is a ``PaddingRule`` plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from skyrl_sim.schema.endpoint import Endpoint


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
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


def effective_padding_micro_batch_size(batch_size: int, micro: int) -> int:
    """PR #1874's cap-aware padding: never pad a call past its own row count."""
    return min(batch_size, micro)


def megatron_align_rows(rows: int, endpoint: Endpoint, kind: str) -> RowAlignment:
    """``_pad_batch``: rows to a multiple of dp x micro (micro capped at the row count with cap-aware padding)."""
    micro = endpoint.micro_batch_size(kind)
    if endpoint.engine.cap_aware_padding:
        micro = effective_padding_micro_batch_size(rows, micro)
    alignment = endpoint.parallelism.dp * micro
    return RowAlignment(round_up(rows, alignment), alignment)


def fsdp_align_rows(rows: int, endpoint: Endpoint, kind: str) -> RowAlignment:
    """FSDP aligns rows to the data-parallel size only."""
    alignment = endpoint.parallelism.dp
    return RowAlignment(round_up(rows, alignment), alignment)


MEGATRON = PaddingRule("megatron", megatron_align_rows, description="rows to dp x micro with copies of row 0")
FSDP = PaddingRule("fsdp", fsdp_align_rows, description="rows to dp with copies of row 0")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one DP rank.

    ``row_tokens`` are the real tokens of each row (a pad row is a copy of row 0 and has its tokens);
    ``pad_rows`` how many of them are pad rows; ``width`` the sequence length the model runs over (BSHD: every row;
    THD: the packed total); ``dummy`` marks a 1-token micro-batch that only equalises counts across DP ranks.
    """

    dp_rank: int
    row_tokens: tuple[int, ...]
    width: int
    packed: bool
    pad_rows: int = 0
    dummy: bool = False

    @property
    def rows(self) -> int:
        return len(self.row_tokens)

    @property
    def slots(self) -> int:
        """Token positions the model computes."""
        return self.width if self.packed else self.rows * self.width

    @property
    def real_tokens(self) -> int:
        return sum(self.row_tokens)


@dataclass(frozen=True)
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


def _micro_batch(rank: int, tokens: list[int], pads: int, tp: int, packed: bool) -> MicroBatch:
    if packed:
        width = sum(-(-t // tp) * tp for t in tokens)
        return MicroBatch(rank, tuple(tokens), width, packed=True, pad_rows=pads)
    return MicroBatch(rank, tuple(tokens), round_up(max(tokens), tp), packed=False, pad_rows=pads)


def shape_call(kind: str, datum_lengths: Sequence[int], endpoint: Endpoint, rule: PaddingRule) -> CallShape:
    """The shapes of a forward_backward or forward call over datums of the given input lengths.

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
    log: tuple[str, ...] = ()
    if pad_rows:
        log = (f"Padded batch from {rows} to {padded_rows} (alignment={aligned.alignment})",)

    trainer = endpoint.trainer
    tp = endpoint.parallelism.tp
    packed = trainer.remove_microbatch_padding
    dp = endpoint.parallelism.dp
    per_rank = padded_rows // dp if padded_rows % dp == 0 else -(-padded_rows // dp)
    micro = endpoint.micro_batch_size(kind)
    if endpoint.engine.cap_aware_padding:
        micro = effective_padding_micro_batch_size(rows, micro)
    budget = trainer.max_tokens_per_microbatch
    total = len(row_tokens)
    microbatches: list[MicroBatch] = []
    per_rank_batches: list[list[MicroBatch]] = []
    for rank in range(dp):
        lo, hi = rank * per_rank, min((rank + 1) * per_rank, total)
        if budget > 0:
            tokens = row_tokens[lo:hi]
            batches = [
                _micro_batch(rank, [tokens[i] for i in g], sum(lo + i >= rows for i in g), tp, packed)
                for g in balanced_pack(tokens, budget)
                if g
            ]
            per_rank_batches.append(batches)
            continue
        for start in range(lo, hi, micro):
            end = min(start + micro, hi)
            pads = end - max(start, rows) if end > rows else 0
            microbatches.append(_micro_batch(rank, row_tokens[start:end], pads, tp, packed))
    if budget > 0:
        most = max(len(b) for b in per_rank_batches)
        for rank, batches in enumerate(per_rank_batches):
            batches.extend(MicroBatch(rank, (1,), 1, packed=True, dummy=True) for _ in range(most - len(batches)))
            microbatches.extend(batches)
    return CallShape(
        kind=kind,
        rows=rows,
        padded_rows=padded_rows,
        alignment=aligned.alignment,
        width=width,
        row_tokens=tuple(row_tokens),
        microbatches=tuple(microbatches),
        logits_width=width if not packed else 0,
        log=log,
    )

"""SkyRL-Train's batch preparation for one call, driven by the ``CallShape`` the engine rules computed.

The parent sends the call's shape (rows, padded rows, global width, micro-batches) and the datum lengths; every rank
rebuilds the same batch from them, so the real backend runs exactly the shapes the simulator reports:

1. token ids are deterministic pseudo-random ids from (seed, datum length): a datum of input length L is the sequence
   ``x[0..L]``; its input tokens are ``x[:L]``, its targets ``x[1:]`` (input shifted left with the last target
   appended), every target weighted 1.0. Random ids (not one repeated id) so the loss moves when the adapter trains;
   the same length always gives the same datum, so a "fixed datum" is simply a fixed length;
2. each row is ``input + last target`` (L + 1 tokens), left-padded to the call's global width S;
3. rows are padded to ``padded_rows`` with copies of row 0 whose loss mask is zero (full compute, no loss);
4. rows are cut into contiguous DP chunks; each rank's chunk into the shape's micro-batches (consecutive groups of
   ``micro`` rows, or the token-budget packer's bins, ``shapes.balanced_pack``);
5. inside a micro-batch the real tokens move left and the input is trimmed to the micro-batch width ``[mbs, S_mb]``
   (``remove_microbatch_padding: false``); the logits are later re-expanded to the global width S for the log-probs.
   Packed THD micro-batches are refused: megatron-core's local attention cannot run packed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from skyrl_sim.api import CallShape, MicroBatch, UserError, balanced_pack

FIRST_ID = 2  # ids 0 (pad) and 1 (the checkpoint's eos) never appear in synthetic data


def datum_tokens(seed: int, length: int, vocab_size: int) -> np.ndarray:
    """The L + 1 ids of a datum of input length L (see the module docstring)."""
    rng = np.random.default_rng([seed, length])
    return rng.integers(FIRST_ID, vocab_size, size=length + 1, dtype=np.int64)


@dataclass
class MicroBatchTensors:
    """One micro-batch as the model takes it, plus what the loss needs at the global width."""

    tokens: torch.Tensor  # [mbs, S_mb] real tokens moved left, right-padded with 0
    lengths: list[int]  # real tokens per row (L + 1)
    targets: torch.Tensor  # [mbs, S] left-padded at the global width: position j's target is row[j + 1]
    loss_mask: torch.Tensor  # [mbs, S] float weights: 1.0 on real targets of real rows, 0 elsewhere
    row_index: list[int]  # index of each row in the call (>= rows: a pad row), -1 for a dummy row
    global_width: int
    # An RL loss's inputs at the global width, aligned with ``targets`` (zeros elsewhere): None for cross-entropy.
    sampling_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None


def _check_packable(shape: CallShape) -> None:
    if any(mb.packed and not mb.dummy for mb in shape.microbatches):
        raise UserError(
            "trainer.remove_microbatch_padding: true packs micro-batches as THD sequences, which megatron-core's local "
            "(non-TransformerEngine) attention cannot run on this backend; set it to false"
        )


def rank_groups(shape: CallShape, dp_rank: int, dp: int, budget: int) -> list[list[int]]:
    """Row indices (into the call's padded rows) of each non-dummy micro-batch of one DP rank, in order."""
    per_rank = -(-shape.padded_rows // dp)
    lo, hi = dp_rank * per_rank, min((dp_rank + 1) * per_rank, shape.padded_rows)
    tokens = list(shape.row_tokens[lo:hi])
    expected = [mb for mb in shape.microbatches_of_rank(dp_rank) if not mb.dummy]
    if budget > 0:
        groups = [g for g in balanced_pack(tokens, budget) if g]
    else:
        sizes = [len(mb.row_tokens) for mb in expected]
        groups, start = [], 0
        for size in sizes:
            groups.append(list(range(start, start + size)))
            start += size
    for group, mb in zip(groups, expected, strict=True):
        if tuple(tokens[i] for i in group) != mb.row_tokens:
            raise RuntimeError(f"micro-batch rows {group} do not match the shape's {mb.row_tokens}")
    return [[lo + i for i in group] for group in groups]


def build_microbatches(
    shape: CallShape,
    datum_lengths: list[int],
    seed: int,
    vocab_size: int,
    dp_rank: int,
    dp: int,
    tp: int,
    budget: int,
    loss_inputs: list[tuple[list[float], list[float]]] | None = None,
) -> list[MicroBatchTensors]:
    """This DP rank's micro-batches, in the shape's order (dummy micro-batches last, as the shape puts them).

    ``loss_inputs``: an RL loss's sampling log-probs and advantages per datum (one value per target), placed where
    the datum's targets are; a pad or dummy row gets zeros (SkyRL pads them so)."""
    _check_packable(shape)
    if len(datum_lengths) != shape.rows:
        raise ValueError(f"{len(datum_lengths)} datums for a call of {shape.rows} rows")
    width = shape.width
    sequences = [datum_tokens(seed, length, vocab_size) for length in datum_lengths]
    out: list[MicroBatchTensors] = []
    expected = [mb for mb in shape.microbatches_of_rank(dp_rank) if not mb.dummy]
    for group, mb in zip(rank_groups(shape, dp_rank, dp, budget), expected, strict=True):
        # one-token dummy rows (token 0, no loss) pad the micro-batch to its rank's row count (_pad_microbatch_to_size)
        group = group + [-1] * mb.dummy_rows
        rows = [sequences[i if i < shape.rows else 0] if i >= 0 else np.zeros(1, dtype=np.int64) for i in group]
        lengths = [len(r) for r in rows]
        mb_width = -(-max(lengths) // tp) * tp
        tokens = torch.zeros(len(rows), mb_width, dtype=torch.long)
        targets = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.float32)
        sampling = torch.zeros(len(rows), width, dtype=torch.float32) if loss_inputs is not None else None
        advantages = torch.zeros(len(rows), width, dtype=torch.float32) if loss_inputs is not None else None
        for r, (seq, index) in enumerate(zip(rows, group, strict=True)):
            n = len(seq)
            tokens[r, :n] = torch.from_numpy(seq)
            targets[r, width - n : width - 1] = torch.from_numpy(seq[1:])
            if 0 <= index < shape.rows:
                mask[r, width - n : width - 1] = 1.0
                if loss_inputs is not None and sampling is not None and advantages is not None:
                    logprobs, advantage = loss_inputs[index]
                    sampling[r, width - n : width - 1] = torch.tensor(logprobs, dtype=torch.float32)
                    advantages[r, width - n : width - 1] = torch.tensor(advantage, dtype=torch.float32)
        out.append(MicroBatchTensors(tokens, lengths, targets, mask, group, width, sampling, advantages))
    dummies = [mb for mb in shape.microbatches_of_rank(dp_rank) if mb.dummy]
    out.extend(_dummy(mb, tp) for mb in dummies)
    return out


def _dummy(mb: MicroBatch, tp: int) -> MicroBatchTensors:
    """A micro-batch of one-token rows that only equalises micro-batch counts across DP ranks (one row, or its rank's
    row count under ``_pad_microbatch_to_size``): computed, never in the loss."""
    width = max(tp, -(-mb.width // mb.rows // tp) * tp)
    rows = mb.rows
    return MicroBatchTensors(
        tokens=torch.zeros(rows, width, dtype=torch.long),
        lengths=[1] * rows,
        targets=torch.zeros(rows, width, dtype=torch.long),
        loss_mask=torch.zeros(rows, width, dtype=torch.float32),
        row_index=[-1] * rows,
        global_width=width,
    )


def shape_to_dict(shape: CallShape) -> dict[str, object]:
    """A CallShape as plain data for the parent -> worker message."""
    from dataclasses import asdict

    return asdict(shape)


def shape_from_dict(data: dict[str, object]) -> CallShape:
    """The inverse of ``shape_to_dict``."""
    fields = dict(data)
    mbs = tuple(
        MicroBatch(**{**mb, "row_tokens": tuple(mb["row_tokens"])})  # type: ignore[index]
        for mb in fields.pop("microbatches")  # type: ignore[union-attr]
    )
    fields["row_tokens"] = tuple(fields["row_tokens"])  # type: ignore[arg-type]
    fields["log"] = tuple(fields.get("log", ()))  # type: ignore[arg-type]
    return CallShape(microbatches=mbs, **fields)  # type: ignore[arg-type]

"""The walk's backward of the rows' re-expansion (``memory_ops._row_copies_backward``) against torch's autograd running
the real backend's code (``trainer._logprobs``: a zeroed ``[b, W, V]`` tensor, one ``copy_`` per row of its own tokens),
allocation by allocation under the live-tensor meter: the same sizes, allocated and freed in the same order, for rows
of different lengths (each row's gradient clone and zeroed destination are its own size; a row as long as the
micro-batch has no slice backward) and for bf16 logits re-expanded into fp32 (each row's cast back)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter
from skyrl_sim_plugins.sim.reference.memory_graph import nbytes
from skyrl_sim_plugins.sim.reference.memory_ops import _row_copies_backward

VOCAB = 40
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _autograd_events(lengths: list[int], seq: int, width: int, act: str) -> list[int]:
    """The signed bytes of every allocation and free of the backward (the arriving gradient's allocation dropped),
    keeping the sizes the walk can name (``sizes``)."""
    rows = len(lengths)
    logits = torch.randn(rows, seq, VOCAB, dtype=DTYPES[act], requires_grad=True)  # the transposed logits [b, s, V]
    weight = torch.randn(rows, width, VOCAB)  # a loss whose backward makes the [b, W, V] gradient autograd alone holds
    log: list[tuple[str, int, int]] = []
    with LiveTensorMeter([logits, weight], log):
        full = logits.new_zeros(rows, width, VOCAB, dtype=torch.float32)
        for r, n in enumerate(lengths):  # trainer._logprobs
            full[r, width - n :] = logits[r, :n].to(torch.float32)
        loss = (full * weight).sum()
        start = len(log)
        loss.backward()  # mul's backward makes the arriving gradient (the cross-entropy's, in the real backend)
        log = log[start:]
    element = DTYPES[act].itemsize
    sizes = {rows * width * VOCAB * 4, rows * seq * VOCAB * element, seq * VOCAB * element}
    sizes |= {n * VOCAB * b for n in lengths for b in (4, element)}
    events = [size for _, size, _ in log if abs(size) in sizes]
    assert events[0] == rows * width * VOCAB * 4  # the arriving gradient
    return events[1:]


def _walk_events(lengths: list[int], seq: int, width: int, act: str) -> list[int]:
    rows = len(lengths)
    full, logits_grad = (rows, width, VOCAB), (rows, seq, VOCAB)
    short = tuple(seq - n for n in lengths)
    d = SimpleNamespace(rows=rows, act=act, seq=seq, short_rows=short if any(short) else ())
    workspaces, order = _row_copies_backward(d, full, VOCAB, logits_grad, "fp32")  # type: ignore[arg-type]
    events = []
    for kind, i in order:
        if kind == "release":
            events.append(-nbytes(full, "fp32"))  # the arriving gradient
        elif kind == "grad":
            events.append(nbytes(logits_grad, act))  # the logits' gradient
        else:
            _, shape, dtype = workspaces[i]
            events.append((1 if kind == "alloc" else -1) * nbytes(shape, dtype))
    return events


@pytest.mark.parametrize(
    ("lengths", "seq", "width"),
    [
        ([11, 11, 11], 12, 11),  # every row one token short of the micro-batch (TP 2's padding)
        ([11, 3, 7, 11], 12, 11),  # rows of different lengths, the last a copy of the first (a pad row)
        ([12, 5, 9], 12, 12),  # the first row as long as the micro-batch: no slice backward
        ([5, 12], 12, 12),
        ([7], 8, 7),  # one row
    ],
)
@pytest.mark.parametrize("act", ["fp32", "bf16"])
def test_the_rows_backward_allocates_and_frees_what_autograd_does_in_its_order(
    lengths: list[int], seq: int, width: int, act: str
) -> None:
    assert _walk_events(lengths, seq, width, act) == _autograd_events(lengths, seq, width, act)


def test_which_row_is_processed_when_decides_the_peak() -> None:
    """The same rows in the other order peak differently. With a global width W well above the micro-batch's (a call
    of several micro-batches) the peak is a CopySlices moment (two [b, W, V] gradients): the row processed first (the
    micro-batch's last) meets no running sum, the one processed second meets the first one's select gradient
    [b, s, V] with its clone. Rows of 2 and 12 tokens (s = 12): in that order, the 2-token row's clone meets the sum;
    the other way round, the 12-token row's."""

    def peak(lengths: list[int], seq: int = 12, width: int = 40) -> int:
        rows = len(lengths)
        full, logits_grad = (rows, width, VOCAB), (rows, seq, VOCAB)
        d = SimpleNamespace(rows=rows, act="fp32", seq=seq, short_rows=tuple(seq - n for n in lengths))
        workspaces, order = _row_copies_backward(d, full, VOCAB, logits_grad, "fp32")  # type: ignore[arg-type]
        live = top = nbytes(full, "fp32")  # the arriving gradient
        for kind, i in order:
            if kind == "release":
                live -= nbytes(full, "fp32")
            elif kind == "grad":
                live += nbytes(logits_grad, "fp32")
            else:
                live += (1 if kind == "alloc" else -1) * nbytes(workspaces[i][1], workspaces[i][2])
            top = max(top, live)
        return top

    row = VOCAB * 4
    full = 2 * 40 * row
    total = 2 * 12 * row  # the running sum [2, 12, V]
    assert peak([2, 12]) == 2 * full + total + 2 * row
    assert peak([12, 2]) == 2 * full + total + 12 * row


def test_calls_whose_rows_differ_only_in_length_are_priced_by_their_rows_on_both_paths() -> None:
    """On the TP 2, 40,960-entry endpoint (the real backend's re-expansion): calls of the same rows and width whose
    rows differ in length are separate shapes (the memo, the segments and the fast path's effects key them by their
    rows), the fast path agrees with the step-by-step walk on each, and at a limit between them the 101-token row's
    clone is what the walk refuses ([101, V] fp32), as the real run does (validation/tiny-cpu-tp2-vocab40k)."""
    import dataclasses

    from skyrl_sim.engine.shapes import MEGATRON, shape_call
    from skyrl_sim.schema.architecture import PRESETS
    from skyrl_sim.schema.endpoint import Endpoint
    from skyrl_sim.schema.endpoint_files import load_endpoint
    from skyrl_sim_plugins.sim.bound.memory import AllocationWalk

    data, _ = load_endpoint("tiny-cpu-tp2-vocab40k", Path(__file__).parent.parent / "scenarios" / "x.yaml")
    ep = Endpoint.model_validate(data)
    model = dataclasses.replace(PRESETS["tiny-dense"], hidden_size=256, vocab_size=40960)  # the endpoint's model
    walk = AllocationWalk()
    tight = ep.model_copy(update={"memory_limit_gib": 0.98})
    for lengths in ([979, 260, 100], [979, 900, 500], [979, 979, 979]):
        shape = shape_call("forward_backward", lengths, ep, MEGATRON)
        fast, stepped = walk.evaluate(shape, ep, model), walk.walk(shape, ep, model)
        assert fast.oom is None
        assert (fast.peak_bytes, fast.breakdown) == (stepped.peak_bytes, stepped.breakdown)
        failed = walk.evaluate(shape_call("forward_backward", lengths, tight, MEGATRON), tight, model)
        assert failed.oom is not None
        tokens = lengths[2] + 1  # padded to four rows (a copy of the first, processed first); the third is second
        assert failed.oom.where["shape"] == [tokens, 20480]
        assert failed.oom.attempted_bytes == tokens * 20480 * 4

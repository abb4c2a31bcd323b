"""The walk's backward of the rows' re-expansion (``memory_ops._row_copies_backward``) against torch's autograd running
the real backend's code (``trainer._logprobs``: a zeroed ``[b, W, V]`` tensor, one ``copy_`` per row), allocation by
allocation under the live-tensor meter: the same tensors, allocated and freed in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from skyrl_sim_plugins.megatron_vllm.memory_meter import LiveTensorMeter
from skyrl_sim_plugins.sim.reference.memory_ops import _row_copies_backward

B_BYTES = 4  # fp32


def _autograd_events(rows: int, seq: int, width: int, vocab: int) -> list[tuple[int, tuple[int, ...]]]:
    """(sign, shape) of every allocation and free of the backward, shapes told apart by their sizes."""
    logits = torch.randn(rows, seq, vocab, requires_grad=True)  # the transposed logits [b, s, V]
    weight = torch.randn(rows, width, vocab)  # a loss whose backward makes the [b, W, V] gradient autograd alone holds
    log: list[tuple[str, int, int]] = []
    with LiveTensorMeter([logits, weight], log):
        full = logits.new_zeros(rows, width, vocab)
        for r in range(rows):  # every row `width` tokens, shorter than the micro-batch's `seq` (TP 2's padding)
            full[r, width - width :] = logits[r, :width].to(torch.float32)
        loss = (full * weight).sum()
        start = len(log)
        loss.backward()  # mul's backward makes the arriving gradient (the cross-entropy's, in the real backend)
        log = log[start : len(log)]  # the backward's events (later ones: `full` dying with this frame)
    shapes = {width * vocab: ("row",), seq * vocab: ("row",)}  # a row's [n, V] or [s, V] (rows > 1: no clash)
    shapes |= {rows * width * vocab: (rows, width, vocab), rows * seq * vocab: (rows, seq, vocab)}
    events = [(1 if size > 0 else -1, shapes[abs(size) // B_BYTES]) for _, size, _ in log if abs(size) // B_BYTES in shapes]
    assert events[0] == (1, (rows, width, vocab))  # the arriving gradient
    return events[1:]


def _walk_events(rows: int, seq: int, width: int, vocab: int) -> list[tuple[int, tuple[int, ...]]]:
    full, logits_grad = (rows, width, vocab), (rows, seq, vocab)
    workspaces, order = _row_copies_backward(SimpleNamespace(rows=rows, act="fp32"), full, (seq, vocab), logits_grad, "fp32")
    events = []
    for kind, i in order:
        if kind == "release":
            events.append((-1, full))  # the arriving gradient
        elif kind == "grad":
            events.append((1, logits_grad))  # the logits' gradient
        else:
            shape = workspaces[i][1]
            events.append((1 if kind == "alloc" else -1, ("row",) if len(shape) == 2 else shape))
    return events


@pytest.mark.parametrize("rows", [2, 3, 4])  # one row: its [s, V] and [1, s, V] are the same size
def test_the_rows_backward_allocates_and_frees_what_autograd_does_in_its_order(rows: int) -> None:
    seq, width, vocab = 12, 11, 40
    assert _walk_events(rows, seq, width, vocab) == _autograd_events(rows, seq, width, vocab)

"""The fused LM-head log-prob (``trainer.fused_lm_head_logprob: true``): target-token log-probs from the final hidden
states, one chunk of positions at a time, never the full ``[b, s, V/tp]`` logits.

What the seed's stack runs (SkyRL's fused LM-head path, read from its public code) and what this module does the same:

* The output layer's projection is skipped: GPTModel's ``output_layer`` hands the final-norm output through
  (``skip_output_projection``), and GPTModel's own ``transpose(0, 1).contiguous()`` turns it into ``[b, s, h]``.
  Without sequence parallelism the hidden states are replicated over TP; their gradient is summed over the TP ranks
  on the way back (``copy_to_tensor_model_parallel_region``), since each rank's gradient covers its vocabulary shard.
* ``fp32_output`` upcasts that whole tensor (Megatron-Bridge's Float16Module), and the rows are re-expanded to the
  call's global width with left padding (``recover_left_padding``: a zeroed ``[b, W, h]`` tensor, each row's real
  positions gathered by a boolean mask and written by a boolean mask), as SkyRL does.
* ``FusedLinearLogprob`` saves only the hidden states (and the frozen weight, and the target ids); per chunk of
  ``logprobs_chunk_size`` positions it projects the chunk (``[b, c, V/tp]`` in the weight's dtype), casts it to fp32
  and takes a vocab-parallel log-softmax (max and sum of exponentials all-reduced over TP), keeping the target's
  log-prob. Its backward allocates the hidden states' gradient and an fp32 weight gradient ``[V/tp, h]`` (as SkyRL's
  kernel does whether or not the weight trains), and per chunk recomputes the log-softmax, turns its exponential
  into ``(onehot - softmax) * grad`` in place, casts it to the weight's dtype and projects it onto both gradients.

One difference from SkyRL's loop, deliberate: each chunk's tensors are released at the end of its iteration. SkyRL's
loop keeps the previous chunk's logits (forward), softmax, cast gradient and flattened hidden states (backward)
referenced until their names are rebound, so its backward holds one more fp32 chunk, one more 16-bit chunk and a
``[b * c, h]`` copy during the next chunk's log-softmax (6.0 GiB more at the seed's 16 x 35,001 call per TP rank).
The simulator's walk (``memory_ops.fused_lm_head_workspaces``) models this module, which the CPU validation checks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: Any) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def vocab_parallel_log_softmax(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """Log-softmax over the whole vocabulary of fp32 logits that hold this rank's shard of it."""
    peak = logits.amax(dim=-1, keepdim=True)
    _all_reduce(peak, dist.ReduceOp.MAX, group)
    shifted = logits - peak
    total = shifted.exp().sum(dim=-1, keepdim=True)
    _all_reduce(total, dist.ReduceOp.SUM, group)
    return shifted - total.log()


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """One chunk's logits ``[b, c, V/tp]``: projected in the weight's dtype, then cast to fp32."""
    return torch.matmul(hidden[:, start:end].to(weight.dtype), weight.t()).to(torch.float32)


class FusedLinearLogprob(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[target]`` per position, chunked over the sequence, vocab-parallel over TP."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        chunk: int,
        group: Any,
    ) -> torch.Tensor:
        local = weight.shape[0]
        outside = (targets < vocab_start) | (targets >= vocab_start + local)  # another rank's shard holds the target
        local_targets = (targets - vocab_start).masked_fill(outside, 0)
        width = hidden.shape[1]
        pieces = []
        for start in range(0, width, chunk):
            end = min(width, start + chunk)
            logits = _chunk_logits(hidden, weight, start, end)
            picked = vocab_parallel_log_softmax(logits, group).gather(-1, local_targets[:, start:end, None]).squeeze(-1)
            pieces.append(picked.masked_fill_(outside[:, start:end], 0.0))
            del logits, picked
        logprobs = torch.cat(pieces, dim=1)
        _all_reduce(logprobs, dist.ReduceOp.SUM, group)  # each target's log-prob lives on one rank, zero elsewhere
        ctx.save_for_backward(hidden, weight, outside, local_targets)
        ctx.chunk, ctx.group = chunk, group
        return logprobs

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, outside, local_targets = ctx.saved_tensors
        chunk, group = ctx.chunk, ctx.group
        width = hidden.shape[1]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, width, chunk):
            end = min(width, start + chunk)
            logits = _chunk_logits(hidden, weight, start, end)
            softmax = vocab_parallel_log_softmax(logits, group).exp_()
            g = grad_out[:, start:end]
            grad_logits = softmax.neg_().mul_(g.unsqueeze(-1))  # -softmax * grad, in place
            inside = ~outside[:, start:end]
            rows_at, cols_at = inside.nonzero(as_tuple=True)
            grad_logits[rows_at, cols_at, local_targets[:, start:end][inside]] += g[inside]  # + onehot * grad
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[:, start:end] = torch.matmul(grad_logits, weight)
            flat_hidden = hidden[:, start:end].reshape(-1, hidden.shape[-1])  # a copy when rows > 1
            product = torch.matmul(grad_logits.reshape(-1, weight.shape[0]).t(), flat_hidden.to(weight.dtype))
            grad_weight.add_(product.to(torch.float32))  # [V/tp, h] in the weight's dtype, accumulated in fp32
            del logits, softmax, grad_logits, flat_hidden, product
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Target log-probs ``[b, W]`` fp32 from hidden states ``[b, W, h]`` and this rank's output weight shard."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    return FusedLinearLogprob.apply(hidden, weight, targets, start, min(chunk, hidden.shape[1]), group)


def recover_left_padding(hidden: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """Rows of ``[b, s, h]`` (real positions first) re-expanded into a zeroed ``[b, width, h]`` with left padding:
    each row's real positions gathered by a boolean mask and written by one, as SkyRL's ``recover_left_padding``."""
    rows, seq, _ = hidden.shape
    out = hidden.new_zeros(rows, width, hidden.shape[-1])
    positions, slots = torch.arange(seq, device=hidden.device), torch.arange(width, device=hidden.device)
    for r, n in enumerate(lengths):
        out[r, slots >= width - n] = hidden[r, positions < n]
    return out


def skip_output_projection(model: torch.nn.Module) -> torch.Tensor:
    """Make GPTModel's output layer hand the hidden states through (its projection happens chunk by chunk in
    ``FusedLinearLogprob``); returns the output weight shard the fused op projects with."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    layer = model.output_layer
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else layer.weight

    def hidden_through(hidden: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, None]:
        return copy_to_tensor_model_parallel_region(hidden), None

    layer.forward = hidden_through
    return weight

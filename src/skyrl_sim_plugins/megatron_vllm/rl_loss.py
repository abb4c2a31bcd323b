"""SkyRL's RL path for one micro-batch on the real backend: the policy loss and the entropy metric.

A forward_backward whose loss is not ``cross_entropy`` takes SkyRL's RL path (``megatron_model_wrapper.loss_func``):
the target log-probs as for cross-entropy, then

* the policy loss over them, the sampling log-probs and the advantages (``ppo_utils``), summed over the loss mask:
  ``importance_sampling``: ``-(exp(lp - lp_sampling) * A)``; ``ppo`` (SkyRL's ``regular``): ``-min(r A,
  clamp(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = exp(clamp(lp - lp_sampling, -20, 20))`` and Tinker's
  ``clip_low_threshold`` / ``clip_high_threshold`` read as ``1 - eps_low`` / ``1 + eps_high`` (defaults 0.2). The
  Tinker backend mirrors the sampling log-probs into the rollout log-probs, so the off-policy corrections are no-ops;
* the entropy of the policy over the action positions (every position with a target), always, without gradient,
  reported as a metric (``use_entropy_loss`` is off, SkyRL's default): from the re-expanded logits in chunks sized
  by ``skyrl_versions.entropy_chunk_tokens`` (one shifted copy a chunk: softmax and product are made in place), or
  with the fused head recomputed from the hidden states chunk by chunk (``_fused_vocab_parallel_entropy_from_hidden``:
  the fp32 logits, their exponentials, the softmax and the product with the logits).

Both reduce over the tensor-parallel group as SkyRL's vocab-parallel ops do. The memory walk models these tensors
(``sim.memory_logprob.entropy``, ``rl_loss``); ``tests/test_rl_loss.py`` checks the values and gradients against a
reference from the full logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from skyrl_sim.api import entropy_chunk_tokens

IMPLEMENTED = ("importance_sampling", "ppo")
"""The RL losses this backend runs (the simulator prices every loss the version has)."""
RATIO_CLIP = 20.0
"""``safe_exp_delta``'s clamp of the log-ratio before its exponential (PPO)."""
EPS_CLIP = 0.2
"""``AlgorithmConfig.eps_clip_low`` / ``eps_clip_high``: PPO's default clip range."""


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def policy_loss(
    loss_fn: str,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: dict[str, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss summed over ``mask`` and its per-token values (``[b, S]``, zero off the mask)."""
    if loss_fn == "importance_sampling":
        elementwise = -(torch.exp(logprobs - sampling_logprobs) * advantages)
    elif loss_fn == "ppo":
        low = 1.0 - config["clip_low_threshold"] if "clip_low_threshold" in config else EPS_CLIP
        high = config["clip_high_threshold"] - 1.0 if "clip_high_threshold" in config else EPS_CLIP
        ratio = torch.clamp(logprobs - sampling_logprobs, -RATIO_CLIP, RATIO_CLIP).exp()
        surrogate = ratio * advantages
        clipped = ratio.clamp(1 - low, 1 + high) * advantages
        elementwise = -torch.min(surrogate, clipped)
    else:
        raise ValueError(f"loss_fn {loss_fn}: the megatron backend implements {', '.join(IMPLEMENTED)}")
    masked = elementwise * mask
    return masked.sum(), masked


@torch.no_grad()
def _chunk_entropy(chunk: torch.Tensor, group: Any) -> torch.Tensor:
    """``_VocabParallelEntropy.forward`` of fp32 logits ``[b, c, V/tp]`` (this rank's vocabulary shard), with one
    shifted copy: ``max + log sum exp - sum softmax * logits`` per position."""
    peak = chunk.amax(dim=-1, keepdim=True)
    _all_reduce(peak, dist.ReduceOp.MAX, group)
    work = chunk - peak
    work.exp_()
    total = work.sum(dim=-1, keepdim=True)
    _all_reduce(total, dist.ReduceOp.SUM, group)
    work.div_(total).mul_(chunk)  # softmax, then its product with the logits, in place
    weighted = work.sum(dim=-1, keepdim=True)
    _all_reduce(weighted, dist.ReduceOp.SUM, group)
    return (peak + total.log() - weighted).squeeze(-1)


@torch.no_grad()
def vocab_parallel_entropy(
    logits: torch.Tensor, group: Any, rule: str, chunk_size: int | None, chunk_memory_mb: int
) -> torch.Tensor:
    """The entropy ``[b, A]`` over the action positions ``logits[:, :-1]`` (``[b, W, V/tp]`` re-expanded logits),
    in the chunks the version's rule takes."""
    rows, width, vocab = logits.shape
    actions = width - 1 if width > 1 else width
    chunk = int(entropy_chunk_tokens(rule, chunk_size, chunk_memory_mb, rows, actions, vocab, logits.element_size()))
    pieces = [_chunk_entropy(logits[:, start : min(start + chunk, actions)], group) for start in range(0, actions, chunk)]
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def fused_entropy(hidden: torch.Tensor, weight: torch.Tensor, group: Any, chunk_size: int) -> torch.Tensor:
    """``_fused_vocab_parallel_entropy_from_hidden`` over the action positions of the hidden states ``[b, W, h]``:
    each chunk of ``chunk_size`` positions projected by the output weight ``[V/tp, h]`` and cast to fp32."""
    rows, width, _ = hidden.shape
    actions = width - 1 if width > 1 else width
    out = torch.empty((rows, actions), dtype=torch.float32, device=hidden.device)
    step = chunk_size if chunk_size < actions else actions
    for start in range(0, actions, step):
        end = min(actions, start + step)
        logits = torch.matmul(hidden[:, start:end].to(weight.dtype), weight.t()).to(torch.float32)
        peak = logits.max(dim=-1, keepdim=True).values
        _all_reduce(peak, dist.ReduceOp.MAX, group)
        exp = (logits - peak).exp_()
        total = exp.sum(dim=-1, keepdim=True)
        _all_reduce(total, dist.ReduceOp.SUM, group)
        softmax = exp / total
        weighted = (softmax * logits).sum(dim=-1, keepdim=True)
        _all_reduce(weighted, dist.ReduceOp.SUM, group)
        out[:, start:end] = (peak + total.log() - weighted).squeeze(-1)
    return out


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SkyRL's ``masked_mean``: the mean over the mask (1 position at least)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)

"""The LM head's log-prob and entropy ops in the memory walk, as the endpoint's SkyRL revision runs them.

``memory_ops.head_graph`` builds the head up to the logits (or, with the fused head, the hidden states) ``x``
``[b, W, V/tp]`` (``[b, W, h]``) and hands them here. Which op graph follows is read from the version's rules
(``skyrl_versions.SkyrlRules``, carried by ``Dims``), never from the version's name:

* ``from_parallel_logits_to_logprobs`` (``model_utils.py``): a sequence no longer than ``logprobs_chunk_size`` takes
  the unchunked ``DistributedLogprob`` (``unchunked_logprob_when_short``): its forward makes the fp32 log-softmax and
  keeps the fp32 softmax for backward instead of the logits; its backward makes the gradient (``softmax.neg()``)
  beside it. A longer one takes ``ChunkedDistributedLogprob``, which keeps the logits; its backward builds the fp32
  logit gradient either as a list of chunk gradients and their concatenation (``list_concat``: two full-size fp32
  tensors at its end) or chunk by chunk in one preallocated buffer (``preallocated_buffer``, PR #1806: the buffer
  and three chunk-sized fp32 temporaries: the previous chunk's gradient, the shifted logits and their log-softmax,
  plus the chunk's fp32 cast when the logits are not fp32).
* The fused head (``fused_lm_head_logprob``): ``torch`` is ``FusedLinearChunkedDistributedLogprob``
  (``memory_ops.fused_lm_head_workspaces``); ``triton`` (SkyRL 0.4.0's ``fused_linear_logprob_triton.py``, verl's
  kernel) casts the hidden states to the weight's dtype and keeps that copy, three ``[tokens, V/tp / 1024]`` fp32
  split buffers while its forward runs, and in backward (``_Split_Dlogits_N``) a ``[tokens, 9504]`` logit-gradient
  tile, the hidden gradient in the weight's dtype, the weight gradient and a matmul temporary, then casts the hidden
  gradient back to the hidden states' dtype.
* The RL path (a loss other than ``cross_entropy``: ``megatron_model_wrapper.loss_func``) always computes the entropy
  metric over the action logits ``x[:, -A-1:-1]`` (``A`` = the call's longest response, the width less one) under
  ``no_grad``: ``vocab_parallel_entropy`` makes one shifted copy of the chunk it reads (``unchunked``: the whole
  action span; ``chunked_by_memory``: chunks sized by ``vocab_entropy_chunk_memory_mb``), and with the fused head
  ``_fused_vocab_parallel_entropy_from_hidden`` recomputes each ``logprobs_chunk_size`` chunk's logits (fp32 logits,
  exponentials, softmax and their product). The logits (or hidden states) stay referenced until the loss returns.

These builders run over a tile of widths too: ``width`` and the sizes of ``d`` may be ``Lanes``, and the lanes' rule
of ``memory_ops`` binds here (decide on a size only where every width agrees; never format one into a name).
"""

from __future__ import annotations

from typing import Any

from skyrl_sim.api import entropy_chunk_tokens
from skyrl_sim_plugins.sim.reference.memory_graph import Graph, Workspace

TRITON_VOCAB_SPLIT = 1024
"""``efficient_entropy_forward``'s vocabulary split: its per-token max, sum and entropy buffers have one column per
split."""
TRITON_DLOGITS_SPLIT = 9504
"""``efficient_entropy_backward``'s ``_Split_Dlogits_N`` tile width: the logit gradient is made this many vocabulary
columns at a time."""


def entropy_chunk(d: Any, actions: Any, vocab: int, element_bytes: int) -> Any:
    """Tokens per chunk of ``vocab_parallel_entropy`` over ``actions`` action positions of a micro-batch of these
    dims (``skyrl_versions.entropy_chunk_tokens``)."""
    return entropy_chunk_tokens(
        d.entropy, d.entropy_chunk_size, d.entropy_chunk_memory_mb, d.rows, actions, vocab, element_bytes
    )


def logprob(g: Graph, d: Any, x: str, width: Any, vocab: int, out_dtype: str, holds: tuple[str, ...]) -> str:
    """The log-probs ``[b, W]`` from the logits ``x`` (non-fused head); ``holds`` are kept until the op returns."""
    logits = (d.rows, width, vocab)
    cast: tuple[Workspace, ...] = (("fp32_cast", logits, "fp32"),) if out_dtype != "fp32" else ()
    if d.unchunked_short and width <= d.chunk:
        softmax = g.op(
            "distributed_logprob.softmax",
            logits,
            "fp32",
            (x,),
            temps=(*cast, ("log_softmax", logits, "fp32")),
            grad_passthrough=out_dtype == "fp32",
        )
        return g.op("distributed_logprob", (d.rows, width), "fp32", (softmax,), saves=(softmax,), holds=(x, *holds))
    chunk = min(d.chunk, width)
    chunk_fp32 = (d.rows, chunk, vocab)
    temps = tuple((f"chunk_fp32_{i}", chunk_fp32, "fp32") for i in range(3))
    if d.logprob_backward == "list_concat":
        extra: tuple[Workspace, ...] = (("chunk_grad_list", logits, "fp32"),)
        return g.op("chunked_logprob", (d.rows, width), "fp32", (x,), saves=(x,), temps=temps, backward_extra=extra)
    names = ("previous_chunk_grad", "chunk_shifted", "chunk_log_softmax")
    extra = tuple((name, chunk_fp32, "fp32") for name in names)
    if out_dtype != "fp32":
        extra += (("chunk_fp32_cast", chunk_fp32, "fp32"),)
    return g.op(
        "chunked_logprob",
        (d.rows, width),
        "fp32",
        (x,),
        saves=(x,),
        temps=temps,
        backward_extra=extra,
        grad_before_workspaces=True,
    )


def triton_fused_logprob(g: Graph, d: Any, x: str, width: Any, vocab: int, hidden_dtype: str) -> str:
    """``FusedLinearLogprobTriton`` over the hidden states ``x`` ``[b, W, h]`` (see the module docstring)."""
    tokens = d.rows * width
    flat = (tokens, d.hidden)
    splits = -(-vocab // TRITON_VOCAB_SPLIT)
    if hidden_dtype != d.act:
        source = g.op("fused_lm_head.hidden_cast", flat, d.act, (x,))
    else:
        source = g.view("fused_lm_head.hidden_2d", x, flat)
    temps = tuple((name, (tokens, splits), "fp32") for name in ("split_max", "split_accumulate", "split_entropy_b"))
    temps += (("entropy", (tokens,), "fp32"),)
    kept = g.op("fused_lm_head.row_stats", (3 * tokens,), "fp32", (source,), temps=temps, detached=True)
    tile = min(TRITON_DLOGITS_SPLIT, vocab)
    last = vocab - (splits_of(vocab) - 1) * TRITON_DLOGITS_SPLIT
    extra: tuple[Workspace, ...] = (
        ("dlogprobs", (tokens,), "fp32"),
        ("dentropy", (tokens,), "fp32"),
        ("grad_weight", (vocab, d.hidden), d.act),
        ("dlogits_tile", (tokens, tile), d.act),
        ("hidden_grad_product", flat, d.act),
    )
    if splits_of(vocab) > 1 and last != tile:
        extra += (("dlogits_last_tile", (tokens, last), d.act),)
    return g.op(
        "fused_lm_head_logprob",
        (d.rows, width),
        "fp32",
        (source, kept),
        saves=(source, kept),
        backward_extra=extra,
        holds=(x,),
        grad_before_workspaces=True,
    )


def splits_of(vocab: int) -> int:
    """The ``_Split_Dlogits_N`` tiles of a vocabulary shard."""
    return -(-vocab // TRITON_DLOGITS_SPLIT)


def entropy(g: Graph, d: Any, x: str, width: Any, vocab: int, x_dtype: str, fused: bool) -> str:
    """The RL path's entropy metric over the action span of ``x`` (no gradient; see the module docstring)."""
    actions = width - 1 if width > 1 else width
    if fused:
        chunk = min(d.chunk, actions)
        logits = (d.rows, chunk, vocab)
        temps: tuple[Workspace, ...] = ()
        if x_dtype != d.act:
            temps += (("chunk_hidden_cast", (d.rows, chunk, d.hidden), d.act),)
        temps += tuple((name, logits, "fp32") for name in ("chunk_logits", "chunk_exp", "chunk_softmax", "chunk_product"))
        return g.op("fused_entropy", (d.rows, actions), "fp32", (x,), temps=temps, detached=True)
    element = 4 if x_dtype == "fp32" else 2
    chunk = entropy_chunk(d, actions, vocab, element)
    temps = (("entropy_shifted", (d.rows, chunk, vocab), x_dtype),)
    return g.op("vocab_parallel_entropy", (d.rows, actions), "fp32", (x,), temps=temps, detached=True)


def rl_loss(g: Graph, d: Any, logprobs: str, width: Any, *held: str) -> str:
    """The policy loss over the action log-probs (per token; its inputs are ``[b, A]``), holding ``held`` (the logits
    the loss function was handed) until it returns: the last op of an RL head."""
    actions = width - 1 if width > 1 else width
    return g.op("policy_loss", (d.rows, actions), "fp32", (logprobs,), holds=held)

"""The device memory vLLM takes for prompt log-probs (a ``sample`` with ``prompt_logprobs``: the SDK's
``compute_logprobs``), beside what it profiled.

``gpu_model_runner._get_prompt_logprobs_dict`` handles one request at a time: for the prompt positions of the current
prefill step (at most ``max_num_batched_tokens``, SkyRL's default 8,192) it computes the logits over the whole
vocabulary (``compute_logits``, in the model's dtype, gathered over TP), casts them to fp32 and takes their
log-softmax (``Sampler.compute_logprobs``), then gathers the target's log-prob and rank. vLLM's start-up profile
runs the sampler on the last token of each sequence only, so this memory comes on top of the KV-cache budget: a long
prompt can run vLLM out of memory where its generation would not. The sample call's record carries the figure
(``extra["prompt_logprobs_bytes"]``); the inference model decides whether it fits.
"""

from __future__ import annotations

from collections.abc import Iterable

from skyrl_sim.api import DTYPE_BYTES, Endpoint, ModelArch, Request

MAX_NUM_BATCHED_TOKENS = 8192
"""SkyRL's ``InferenceEngineConfig.max_num_batched_tokens`` default: the prompt positions of one prefill step."""


def prompt_logprobs_bytes(
    requests: Iterable[Request], endpoint: Endpoint, model: ModelArch, step_tokens: int = MAX_NUM_BATCHED_TOKENS
) -> int:
    """The largest transient of one request's prompt log-probs: its logits ``[n, V]`` in the model's dtype, their
    fp32 cast and their log-softmax, for the ``n`` scored positions of one prefill step (0 without prompt
    log-probs)."""
    per_position = model.vocab_size * (DTYPE_BYTES[endpoint.trainer.params_dtype] + 4 + 4)
    scored = [min(r.prompt_tokens - 1, step_tokens) for r in requests if r.prompt_logprobs]
    return max(scored, default=0) * per_position

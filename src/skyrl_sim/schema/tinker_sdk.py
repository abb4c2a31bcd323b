"""What the Tinker SDK sends for one call of its training and sampling clients (``sdk: tinker-0.25``).

A scenario entry is one SDK call; the SDK turns it into API requests, read from the ``tinker==0.25.0`` package
(``lib/public_interfaces/training_client.py``, ``sampling_client.py``, ``types/client_config_response.py``):

* ``forward_backward`` / ``forward`` of many datums: ``_chunked_requests_generator`` cuts the datums, in order, into
  chunks of at most ``fwdbwd_max_chunk_len`` (1,024) datums and ``fwdbwd_max_chunk_bytes_count`` (5,000,000)
  estimated bytes (a datum that alone passes the byte limit is a chunk of its own). A datum's estimate is its
  serialised size: 4 bytes per model-input token (int32) plus each ``loss_fn_inputs`` tensor's bytes (``target_tokens``
  int64; ``weights``, ``logprobs``, ``advantages`` float32). With ``parallel_fwdbwd_chunks`` (the default) every
  chunk is submitted at once, the first chunk last, and the call's future combines them all.
* ``forward_backward_custom``: a ``forward`` of the datums (cross-entropy with zero weights), awaited; the custom
  loss runs on the client; then a ``forward_backward`` with the loss's gradients as weights. Both are chunked.
* ``compute_logprobs`` (sampling client): a ``sample`` of one sequence of one token with ``prompt_logprobs``.

``ResolvedVariant.client_requests`` applies this to a client whose ``sdk`` is ``tinker-0.25``; a client without it
sends each entry as one API request (the raw API, as the seed's scenarios do).
"""

from __future__ import annotations

from collections.abc import Sequence

from skyrl_sim.schema.requests import PASSES, RequestSpec

TINKER_LORA_RANK = 32
"""``ServiceClient.create_lora_training_client``'s default rank: what a Tinker client asks for unless it says."""
FWDBWD_MAX_CHUNK_LEN = 1024
"""``ClientConfigResponse.fwdbwd_max_chunk_len``: datums per forward/backward chunk request."""
FWDBWD_MAX_CHUNK_BYTES = 5_000_000
"""``ClientConfigResponse.fwdbwd_max_chunk_bytes_count``: estimated payload bytes per chunk request."""
PROTO_BYTES_PER_TOKEN = 4
"""``_PROTO_BYTES_PER_TOKEN``: a model-input token as serialised (int32)."""
LOSS_INPUT_BYTES = {"target_tokens": 8, "weights": 4, "logprobs": 4, "advantages": 4}
"""Bytes per target of each ``loss_fn_inputs`` tensor (``Datum._KEY_TO_TYPE``: int64, float32)."""
SDK_CALLS = ("forward_backward_custom", "compute_logprobs")
"""Scenario request types that are SDK calls, with no API request of their own."""


def loss_inputs_of(loss_fn: str) -> tuple[str, ...]:
    """The ``loss_fn_inputs`` a datum of this loss carries: the targets and weights (cross-entropy), or the targets,
    the sampling log-probs and the advantages (an RL loss)."""
    return ("target_tokens", "weights") if loss_fn == "cross_entropy" else ("target_tokens", "logprobs", "advantages")


def datum_bytes(length: int, loss_fn: str) -> int:
    """``_estimate_datum_bytes_count_proto`` of a datum of ``length`` input tokens (as many targets)."""
    return length * (PROTO_BYTES_PER_TOKEN + sum(LOSS_INPUT_BYTES[name] for name in loss_inputs_of(loss_fn)))


def chunk_datums(datums: Sequence[int], loss_fn: str) -> list[tuple[int, ...]]:
    """``_chunked_requests_generator``: the datums in order, a new chunk when the next would pass the byte limit (and
    the chunk is not empty) or the chunk holds ``FWDBWD_MAX_CHUNK_LEN`` datums."""
    chunks: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for length in datums:
        estimate = datum_bytes(length, loss_fn)
        if (current and size + estimate > FWDBWD_MAX_CHUNK_BYTES) or len(current) == FWDBWD_MAX_CHUNK_LEN:
            chunks.append(tuple(current))
            current, size = [], 0
        current.append(length)
        size += estimate
    if current:
        chunks.append(tuple(current))
    return chunks


def submission_order(chunks: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """``parallel_fwdbwd_chunks``: every chunk but the first goes out, then the first (it arrives last)."""
    return chunks[1:] + chunks[:1] if len(chunks) > 1 else chunks


def sdk_requests(spec: RequestSpec, datums: tuple[int, ...]) -> list[tuple[int, RequestSpec, tuple[int, ...]]]:
    """The API requests the Tinker SDK sends for one call (``tinker_sdk``), each with its phase in the call: a pass
    in its chunks (first chunk last); ``forward_backward_custom`` a chunked forward, then (phase 1, once the forward's
    results are in) a chunked forward_backward; ``compute_logprobs`` a one-token sample with prompt log-probs."""
    if spec.type in PASSES:
        return [(0, spec, chunk) for chunk in submission_order(chunk_datums(datums, spec.loss_fn))]
    if spec.type == "forward_backward_custom":
        chunks = submission_order(chunk_datums(datums, "cross_entropy"))
        forward = spec.model_copy(update={"type": "forward"})
        backward = spec.model_copy(update={"type": "forward_backward"})
        return [(0, forward, chunk) for chunk in chunks] + [(1, backward, chunk) for chunk in chunks]
    if spec.type == "compute_logprobs":
        sample = spec.model_copy(update={"type": "sample", "max_tokens": 1, "num_samples": 1, "prompt_logprobs": True})
        return [(0, sample, ())]
    return [(0, spec, datums)]

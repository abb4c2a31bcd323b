"""The price of one vLLM engine step, the reference: its forward over the scheduled tokens, by the roofline of the
hardware profile, op by op.

vLLM runs one forward per step over every token the scheduler gave it: prefill chunks (compute-bound: the linears
over many tokens, the causal attention over their pairs) and decode tokens (one per running sequence: bound by
streaming the weights once and reading each sequence's KV cache), then the logits of the sequences that sample a
token. The ops are the one layer description the memory walk and the training time model read
(``layer_ops.decoder_layer``), on the engine's own setup (its tensor parallel size, no sequence parallel, vLLM's
fused attention, LoRA adapters when ``inference.enable_lora``) and priced as every op is priced
(``time_model.Roofline``: ``max(flops / achieved FLOP/s, bytes / achieved bandwidth)`` plus a launch overhead),
with the tensor-parallel all-reduces of each block as ring collectives and a fixed cost per step
(``overheads.vllm_step_s``: the scheduler, input preparation, sampling and detokenisation on the host).

Calibration: a step's duration is the sum of its features (``FEATURES``) times the profile's ``time_coefficients``
``vllm.<feature>`` (1 when absent), which ``skyrl-sim calibrate`` fits from measured samples.

This module is the meaning (``StepReference.features``: a step's ops listed at its variables and priced one by one).
Every op's FLOPs and bytes are affine in the step's variables, so the engine a run uses prices steps from a program
compiled once per endpoint (``fast.vllm_step_program.StepProgram``), held to this one by
``tests/test_vllm_model.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from skyrl_sim.api import MODEL_DTYPE_BYTES, Endpoint, ModelArch, fp8_checkpoint, load_profile
from skyrl_sim_plugins.sim.description.layer_ops import Collective, Op, Setup, Work, decoder_layer, lm_head
from skyrl_sim_plugins.sim.reference.time_model import FEATURES, Roofline, layer_signature

VARIABLES = ("tokens", "prefill_tokens", "prefill_pairs", "decode_seqs", "decode_context", "logit_rows")
"""A step's variables: tokens the linears compute (prefill chunks plus one per decoding sequence), the prefill
chunks' tokens and (query, key) pairs (the causal attention over each chunk and what precedes it), the decoding
sequences and the KV tokens their attention reads, and the rows whose logits are computed (sequences that sample)."""


COEFFICIENT_PREFIX = "vllm."


UNIT_INDEX = {"matmul": 0, "attention": 1, "memory": 2}


def vllm_setup(endpoint: Endpoint, model: ModelArch | None = None) -> Setup:
    """The layer setup of one vLLM engine: its TP size, no sequence parallel, fused attention, the model dtype, LoRA
    adapters only when vLLM serves them, and an FP8 checkpoint's one-byte weights (``schema/quantization.py``; every
    base linear streamed at one byte, a DeltaNet's small in_proj_ba too; the FP8 GEMMs' FLOPs at the dtype's peak, an
    upper bound on their time)."""
    inference = endpoint.inference
    base = Setup.of(endpoint, lora=inference.enable_lora)
    fp8 = model is not None and fp8_checkpoint(endpoint, model) is not None
    return replace(
        base,
        tp=inference.tensor_parallel_size,
        sequence_parallel=False,
        unfused_attention=False,
        dtype=MODEL_DTYPE_BYTES[inference.model_dtype],
        weight_dtype=FP8_WEIGHT_BYTES if fp8 else 0,
    )


FP8_WEIGHT_BYTES = 1
"""float8_e4m3fn (``Fp8LinearMethod.create_weights``)."""


Listing = tuple[list[tuple[Op, float]], list[tuple[Collective, float]]]


def step_listing(model: ModelArch, setup: Setup) -> Callable[..., Listing]:
    """The ops and collectives of one step at given variables (each with how many times it runs): the linears and
    elementwise ops over all tokens, the attention cores of the prefill chunks and of the decoding sequences, and
    the logits of the sampling rows."""
    groups: dict[tuple[str, bool], tuple[int, int]] = {}
    for index in range(model.num_layers):
        signature = layer_signature(model, index)
        first, count = groups.get(signature, (index, 0))
        groups[signature] = (first, count + 1)
    layers = [(decoder_layer(model, first), count) for first, count in groups.values()]
    head = lm_head(model)

    def listing(tokens: float, prefill: float, pairs: float, seqs: float, context: float, rows: float) -> Listing:
        ops: list[tuple[Op, float]] = []
        collectives: list[tuple[Collective, float]] = []
        for layer, count in layers:
            dense = layer.forward(Work(tokens, 0.0), setup)
            ops += [(op, float(count)) for op in dense.ops if op.role != "core"]
            collectives += [(c, float(count)) for c in dense.collectives]
            chunks = layer.forward(Work(prefill, pairs), setup)
            ops += [(op, float(count)) for op in chunks.ops if op.role == "core"]
            per_seq = context / seqs if seqs else 0.0  # a step with no decoding sequence reads no KV context
            decode = layer.forward(Work(seqs, 0.0, decode=True, sequences=seqs, context=per_seq), setup)  # type: ignore[arg-type]
            ops += [(op, float(count)) for op in decode.ops if op.role == "core"]
        ops.append((head.last_token_logits(rows, setup), 1.0))
        return ops, collectives

    return listing


def step_weights(endpoint: Endpoint) -> np.ndarray:
    """The calibrated factor of each feature for vLLM steps (``time_coefficients['vllm.<feature>']``, 1 if absent)."""
    coefficients = load_profile(endpoint.hardware.profile).time_coefficients
    return np.array([coefficients.get(COEFFICIENT_PREFIX + name, 1.0) for name in FEATURES])


class StepReference:
    """One engine step priced op by op (the meaning of ``fast.vllm_step_program.StepPrices``): the step's ops and
    collectives listed at its variables (``step_listing``), each op by the roofline of its unit on one engine's share
    of the device, each all-reduce as a ring over the engine's TP group, plus every op's launch and the step's fixed
    cost."""

    def __init__(self, endpoint: Endpoint, model: ModelArch) -> None:
        inference = endpoint.inference
        self.profile = load_profile(endpoint.hardware.profile)
        self.tp = inference.tensor_parallel_size
        self.roofline = Roofline(self.profile, inference.num_engines * self.tp, self.tp)
        self.listing = step_listing(model, vllm_setup(endpoint, model))

    def features(self, tokens: float, prefill: float, pairs: float, seqs: float, context: float, rows: float) -> np.ndarray:
        """The step's seconds per feature (``FEATURES``) at its variables (``VARIABLES``)."""
        ops, collectives = self.listing(tokens, prefill, pairs, seqs, context, rows)
        out = np.zeros(len(FEATURES))
        for op, count in ops:
            out[UNIT_INDEX[op.unit]] += count * self.roofline.seconds(op.unit, op.flops, op.bytes)
        for collective, count in collectives:
            out[FEATURES.index("comm_s")] += count * self.roofline.ring(collective.kind, collective.bytes, self.tp)
        launches = self.roofline.op_s * sum(count for _, count in ops)
        out[FEATURES.index("fixed_s")] = launches + self.profile.overheads.vllm_step_s
        return out

    def seconds(self, weights: np.ndarray, *variables: float) -> float:
        """The step's seconds: its features times the calibrated factor of each (``step_weights``)."""
        return float(self.features(*variables) @ weights)

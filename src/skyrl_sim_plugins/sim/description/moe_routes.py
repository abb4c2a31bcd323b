"""MoE bytes of a call: routed-expert replay (R3) indices, router and expert activations, and the R3 payloads.

Three questions an operator of a MoE endpoint asks, answered per call from its ``CallShape``:

* **Trainer memory of the replay indices.** Per micro-batch the trainer holds the experts vLLM routed each token to,
  ``[token slots, layers, topk]``, plus a one-byte padding mask per slot. ``compact`` (SkyRL PR #1909) keeps the
  smallest dtype that holds ``num_experts - 1`` and only the MoE layers of the pipeline stage's own layers;
  ``int32-all-layers`` (the old cost, kept as a switch) expands every MoE layer to int32 on every stage; ``off`` holds
  none. Slots are the micro-batch's token positions (``MicroBatch.slots``: packed THD total, or rows x width in BSHD).
* **Activations of one MoE layer** (``moe_layer_dims``, ``moe_layer_terms``): megatron-core 0.16.1's MoE layer with
  the all-gather dispatcher, tensor by tensor: the fp32 router logits, top-k values and ids, the softmax over the
  top k, the ``[tokens, experts]`` routing probabilities and map, the permutation indices and the permuted tokens and
  probabilities, each expert's FFN tensors (the probabilities scale the activation, before fc2), the unpermuted
  output, and the shared expert. Per rank: the TP x EP group's shards are gathered (expert tensor parallel = TP) and a
  rank's ``E / ep`` experts receive their share of the gathered pairs, so EP divides the expert weights, not these
  activations. The share is the endpoint's routing spread (``trainer.moe_routing``, ``routing_split``): even, or
  skewed so that the busiest rank (the one that runs out of memory first, which the walk prices) holds more of the
  pairs and its busiest expert more of those.
* **Payloads.** Per sample, the routed-expert bytes on the wire (compact dtype, base64, orjson framing) against the
  naive JSON list encoding; per training call, the bytes the trainer's host receives for the call's own rows (pad
  rows are copies made on the trainer, never shipped).

Assumptions, stated once here: a sequence's routes cover every token of its row (prompt + response: the row's
``L + 1`` tokens for a training datum, ``prompt_tokens + max_tokens`` for a sample); the router runs in fp32
(Megatron's ``moe_router_dtype`` as SkyRL's recipes set it); pipeline stages own consecutive, evenly split layers
(the first stages take one more when the split is uneven). The allocation walk holds ``replay_mb_tensors`` for each
micro-batch's lifetime (``reference/segments.py``: ``replay_segments``) and sizes every MoE layer tensor from
``moe_layer_terms``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from skyrl_sim.api import DTYPE_BYTES, CallShape, Endpoint, ModelArch, MoeDims, Request, pipeline_stages, r3_codec
from skyrl_sim_plugins.sim.description.layer_ops import sequence_parallel

SKEW_SCALE = 1000  # a routing skew's factors are applied in thousandths (integer arithmetic, exact per lane)
ROUTER_BYTES = 4  # fp32 router logits and probabilities
INDEX_BYTES = 8  # torch.topk's int64 expert ids
MASK_BYTES = 1  # one bool per token slot


def _moe(model: ModelArch) -> MoeDims:
    if model.moe is None:
        raise ValueError(f"model '{model.name}' has no MoE layers")
    return model.moe


def moe_layer_count(model: ModelArch) -> int:
    """MoE layers of the whole model: the ``layers`` dimension vLLM returns."""
    return sum(1 for i in range(model.num_layers) if model.is_moe_layer(i))


def stage_moe_layers(model: ModelArch, pp: int) -> int:
    """MoE layers of the pipeline stage that owns the most of them (the one whose replay tensor is largest)."""
    return max(sum(1 for i in stage if model.is_moe_layer(i)) for stage in pipeline_stages(model.num_layers, pp))


def replay_layers(model: ModelArch, pp: int, layers: range | None = None) -> int:
    """MoE layers whose compact ids a stage receives: those of ``layers`` (one pipeline stage's slice), else of the
    stage that owns the most (``stage_moe_layers``)."""
    if layers is None:
        return stage_moe_layers(model, pp)
    return sum(1 for i in layers if model.is_moe_layer(i))


def compact_dtype(model: ModelArch) -> str:
    """The canonical R3 dtype for this model's expert ids."""
    return r3_codec.smallest_dtype(_moe(model).num_experts - 1)


def replay_mb_bytes(
    slots: int, endpoint: Endpoint, model: ModelArch, layers: range | None = None
) -> dict[str, int]:
    """One micro-batch's held replay ids and padding mask: ``compact`` (SkyRL PR #1909 and #1911: the ids arrive
    compact and are sliced to the stage's own MoE layers, of ``layers`` or else of the stage with most MoE layers,
    before their one int32 conversion), ``int32_all_layers`` (the old path: every MoE layer in int32 on every stage),
    the declared layout's, and the padding mask (one bool per slot)."""
    moe = _moe(model)
    stage_moe = replay_layers(model, endpoint.parallelism.pp, layers)
    compact = r3_codec.int32_all_layers_bytes(slots, stage_moe, moe.top_k)
    expanded = r3_codec.int32_all_layers_bytes(slots, moe_layer_count(model), moe.top_k)
    layout = endpoint.trainer.routed_expert_replay
    declared = {"compact": compact, "int32-all-layers": expanded, "off": 0}[layout]
    return {
        "compact": compact,
        "int32_all_layers": expanded,
        "declared": declared,
        "padding_mask": 0 if layout == "off" else slots * MASK_BYTES,
    }


Lifetime = Literal["transient", "microbatch", "schedule"]


@dataclass(frozen=True)
class ReplayTensor:
    """One device tensor of a micro-batch's replay and how long it lives: ``transient`` ones die as the next tensor is
    made from them, ``microbatch`` ones when the micro-batch's backward ends, ``schedule`` ones when the call ends."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    lifetime: Lifetime

    @property
    def held(self) -> bool:
        return self.lifetime != "transient"


def ids_lifetime(endpoint: Endpoint) -> Lifetime:
    """How long a micro-batch's int32 replay ids live: megatron's ``RouterReplay`` keeps each micro-batch's ids in a
    backward FIFO that only a recompute of the router inside the backward pops (full recompute), so without it they
    stay until the schedule ends and SkyRL clears the replay state."""
    return "microbatch" if endpoint.trainer.recompute.granularity == "full" else "schedule"


def replay_mb_tensors(
    slots: int, endpoint: Endpoint, model: ModelArch, layers: range | None = None
) -> list[ReplayTensor]:
    """The replay tensors one micro-batch creates on the trainer, in allocation order (``megatron_vllm.route_replay``
    makes them so): the routes as they arrive (compact dtype, every MoE layer; sized as the micro-batch's slots, an
    upper bound of its captured tokens), sliced to the kept layers (the stage's own with ``compact``, every MoE layer
    with ``int32-all-layers``), placed in the micro-batch's ``[rows, width]`` layout with padding routes, reordered
    layer-first and sequence-major, converted to int32 once (held: ``ids_lifetime``), and the padding mask (held
    until the micro-batch's backward ends). ``off`` creates nothing."""
    layout = endpoint.trainer.routed_expert_replay
    if layout == "off":
        return []
    moe = _moe(model)
    dtype, k, everything = compact_dtype(model), moe.top_k, moe_layer_count(model)
    kept = replay_layers(model, endpoint.parallelism.pp, layers) if layout == "compact" else everything

    def made(name: str, shape: tuple[int, ...], dtype_name: str, lifetime: Lifetime) -> ReplayTensor:
        return ReplayTensor(name, shape, dtype_name, math.prod(shape) * DTYPE_BYTES[dtype_name], lifetime)

    return [
        made("r3.arrived", (slots, everything, k), dtype, "transient"),
        made("r3.stage_slice", (slots, kept, k), dtype, "transient"),
        made("r3.aligned", (slots, kept, k), dtype, "transient"),
        made("r3.layer_major", (kept, slots, k), dtype, "transient"),
        made("r3.replay_ids", (kept, slots, k), "int32", ids_lifetime(endpoint)),
        made("r3.padding_mask", (slots,), "bool", "microbatch"),
    ]


@dataclass(frozen=True)
class MoeLayerDims:
    """The sizes one MoE layer's tensors take on one rank for a micro-batch (``moe_layer_dims``): megatron-core's
    MoE layer with the all-gather token dispatcher, as the graph (``memory_ops.moe_mlp_block``) and the byte terms
    (``moe_layer_terms``) read them.

    ``tokens``: the router's tokens (the sequence-parallel shard); ``gathered``: the tokens after the dispatcher's
    all-gather over the TP x EP group (``tokens`` without either); ``expert_tokens``: the token-expert pairs of each
    local expert under balanced routing (the pairs split as evenly as integers allow, the first experts taking one
    more), one group of all of them for a grouped GEMM (``grouped``); ``replay``: the router gathers replayed ids
    instead of running top-k."""

    tokens: int
    gathered: int
    experts: int
    local_experts: int
    top_k: int
    hidden: int
    expert_ffn: int
    shared_ffn: int
    expert_tokens: tuple[int, ...]
    grouped: bool
    replay: bool

    @property
    def pairs(self) -> int:
        """Token-expert pairs this rank's experts run (the permuted tokens)."""
        return sum(self.expert_tokens)


def expert_token_split(pairs: int, experts: int) -> tuple[int, ...]:
    """``pairs`` split over ``experts`` as evenly as integers allow (balanced routing), the first ones one more."""
    base, extra = divmod(pairs, experts)
    # arithmetic, not a branch: ``pairs`` may be one value per lane of a block of widths (``memory_lanes.Lanes``)
    return tuple(base + (extra > e) for e in range(experts))


def routing_split(pairs: int, experts: int, local: int, top_k: int, endpoint: Endpoint) -> tuple[int, ...]:
    """The token-expert pairs each of the busiest rank's ``local`` experts runs, of ``pairs`` over ``experts`` in the
    EP group, under the endpoint's spread (``Trainer.routing_spread``).

    Even (and ``recorded``: the scenario's recorded routes are uniform draws): the rank's ``local / experts`` of the
    pairs, split as evenly as integers allow. Skew: the busiest rank holds ``busiest_rank_share`` times its even
    share (at most every pair, ``local / experts`` of them times ``experts / local``), its busiest expert
    ``busiest_expert_load`` times an expert's even share (at most one per gathered token, ``pairs / top_k``, and at
    most the rank's pairs), the others the rest evenly. With EP 1 the rank holds every pair whatever the spread; only
    the experts' split changes."""
    even = pairs * local // experts
    if endpoint.trainer.routing_spread != "skew":
        return expert_token_split(even, local)
    routing = endpoint.trainer.moe_routing
    # integer arithmetic in thousandths: ``pairs`` may be one value per lane of a tile of widths (memory_lanes.Lanes)
    share, load = round(routing.busiest_rank_share * SKEW_SCALE), round(routing.busiest_expert_load * SKEW_SCALE)
    rank_pairs = min(pairs, -(-even * share // SKEW_SCALE)) if local < experts else pairs
    busiest = min(-(-pairs * load // (experts * SKEW_SCALE)), pairs // top_k, rank_pairs)
    if local == 1:
        return (rank_pairs,)
    return (busiest, *expert_token_split(rank_pairs - busiest, local - 1))


def moe_layer_dims(tokens: int, endpoint: Endpoint, model: ModelArch) -> MoeLayerDims:
    """``MoeLayerDims`` of one MoE layer for a micro-batch of ``tokens`` slots (``rows x width``), on the busiest
    rank.

    The all-gathered ``tokens x TP x EP / TP`` tokens send ``top_k`` copies each, and the rank's ``E / ep`` experts
    receive their share of them (``routing_split``). Expert tensor parallelism is TP (megatron's default): each
    expert's FFN width is split over TP."""
    moe = _moe(model)
    p = endpoint.parallelism
    local = -(-tokens // p.tp) if sequence_parallel(endpoint) else tokens
    gathered = local * p.tp * p.ep  # the dispatcher all-gathers over TP x EP whenever either is above 1
    local_experts = -(-moe.num_experts // p.ep)
    split = routing_split(gathered * moe.top_k, moe.num_experts, local_experts, moe.top_k, endpoint)
    pairs = sum(split)
    grouped = endpoint.trainer.layer_spec != "local"  # TransformerEngine's grouped GEMM runs every local expert at once
    return MoeLayerDims(
        tokens=local,
        gathered=gathered,
        experts=moe.num_experts,
        local_experts=local_experts,
        top_k=moe.top_k,
        hidden=model.hidden_size,
        expert_ffn=-(-moe.expert_ffn_hidden_size // p.tp),
        shared_ffn=-(-moe.shared_expert_ffn_hidden_size // p.tp),
        expert_tokens=(pairs,) if grouped else split,
        grouped=grouped,
        replay=endpoint.trainer.routed_expert_replay != "off",
    )


def moe_layer_terms(tokens: int, endpoint: Endpoint, model: ModelArch) -> dict[str, int]:
    """Activation bytes of one MoE layer for a micro-batch of ``tokens`` slots, on one rank, as named terms (the
    sizes of ``moe_layer_dims``; ``memory_ops.moe_mlp_block`` makes each as a tensor)."""
    m = moe_layer_dims(tokens, endpoint, model)
    act = DTYPE_BYTES[endpoint.trainer.params_dtype]
    pairs, hidden, ffn = m.pairs, m.hidden, m.expert_ffn
    terms = {
        "router_logits": m.tokens * m.experts * ROUTER_BYTES,
        "topk_values": m.tokens * m.top_k * ROUTER_BYTES,
        "topk_indices": 0 if m.replay else m.tokens * m.top_k * INDEX_BYTES,
        "router_probs": m.tokens * m.top_k * ROUTER_BYTES,
        "routing_probs": m.tokens * m.experts * ROUTER_BYTES,
        "routing_map": m.tokens * m.experts * MASK_BYTES,
        "sorted_indices": pairs * INDEX_BYTES,
        "dispatched_tokens": pairs * hidden * act,
        "permuted_probs": pairs * ROUTER_BYTES,
        "expert_fc1_out": pairs * 2 * ffn * act,
        "expert_act_out": pairs * ffn * act,
        "expert_scaled_out": pairs * ffn * act,
        "expert_fc2_out": pairs * hidden * act,
        "unpermuted": m.gathered * hidden * act,
    }
    if m.shared_ffn:
        terms["shared_fc1_out"] = tokens * 2 * m.shared_ffn * act  # over the (gathered) full sequence
        terms["shared_act_out"] = tokens * m.shared_ffn * act
    if m.shared_ffn and _moe(model).shared_expert_gate:  # kept by the gate's product, on the router's shard
        terms["shared_gate_score"] = m.tokens * act
        terms["shared_ungated_out"] = m.tokens * hidden * act
    return terms


def sequence_wire_bytes(tokens: int, model: ModelArch) -> dict[str, int]:
    """One sequence's routed experts on the wire: compact (dtype + base64 + framing) and as JSON lists."""
    moe = _moe(model)
    layers = moe_layer_count(model)
    return {
        "compact": r3_codec.compact_wire_bytes(tokens, layers, moe.top_k, moe.num_experts),
        "json_lists": r3_codec.json_list_bytes(tokens, layers, moe.top_k, moe.num_experts),
        "raw": r3_codec.raw_bytes(tokens, layers, moe.top_k, compact_dtype(model)),
    }


def route_replay_bytes(shape: CallShape, endpoint: Endpoint, model: ModelArch) -> dict[str, int]:
    """A training call's R3 bytes: the largest micro-batch's replay tensors and what the host receives.

    ``replay_mb_*`` are the call's largest micro-batch on any DP rank (pad rows are copies of row 0 and cost the same);
    ``replay_mb_peak_bytes`` is what the declared layout adds to that micro-batch's peak (indices + mask);
    ``replay_call_bytes`` the busiest DP rank's micro-batches together.
    ``host_*`` count the call's own rows across every DP rank; with ``off`` nothing is shipped.
    """
    per_rank: dict[int, list[dict[str, int]]] = {}
    for mb in shape.microbatches:
        per_rank.setdefault(mb.dp_rank, []).append(replay_mb_bytes(mb.slots, endpoint, model))
    largest = max((b for batches in per_rank.values() for b in batches), key=lambda b: b["declared"] + b["padding_mask"])
    off = endpoint.trainer.routed_expert_replay == "off"
    rows = [sequence_wire_bytes(tokens, model) for tokens in shape.row_tokens[: shape.rows]]
    return {
        "replay_mb_peak_bytes": largest["declared"] + largest["padding_mask"],
        "replay_mb_bytes": largest["declared"],
        "replay_mb_compact_bytes": largest["compact"],
        "replay_mb_int32_all_layers_bytes": largest["int32_all_layers"],
        "padding_mask_mb_bytes": largest["padding_mask"],
        "replay_call_bytes": max(sum(b["declared"] + b["padding_mask"] for b in batches) for batches in per_rank.values()),
        "host_wire_bytes": 0 if off else sum(r["compact"] for r in rows),
        "host_json_list_bytes": 0 if off else sum(r["json_lists"] for r in rows),
        "host_raw_bytes": 0 if off else sum(r["raw"] for r in rows),
    }


def moe_call_extra(shape: CallShape, endpoint: Endpoint, model: ModelArch) -> dict[str, Any] | None:
    """``CallRecord.extra["moe"]`` of a forward_backward / forward call; None for a dense model."""
    if model.moe is None:
        return None
    largest = max(mb.slots for mb in shape.microbatches)
    terms = moe_layer_terms(largest, endpoint, model)
    routing = endpoint.trainer.moe_routing
    spread = endpoint.trainer.routing_spread
    return {
        "layout": endpoint.trainer.routed_expert_replay,
        "routing": {
            "spread": spread,
            "busiest_rank_share": routing.busiest_rank_share if spread == "skew" else 1.0,
            "busiest_expert_load": routing.busiest_expert_load if spread == "skew" else 1.0,
        },
        "dtype": compact_dtype(model),
        "moe_layers": moe_layer_count(model),
        "stage_moe_layers": stage_moe_layers(model, endpoint.parallelism.pp),
        "top_k": model.moe.top_k,
        "routes": route_replay_bytes(shape, endpoint, model),
        "layer_terms": terms,
        "layer_terms_bytes": sum(terms.values()),
        "mb_slots": largest,
    }


def moe_sample_extra(requests: Sequence[Request], endpoint: Endpoint, model: ModelArch) -> dict[str, Any] | None:
    """``CallRecord.extra["moe"]`` of a sample call: per request and in total, the routed-expert wire bytes.

    None for a dense model or when the endpoint does not replay routes (vLLM is then not asked for them).
    """
    if model.moe is None or endpoint.trainer.routed_expert_replay == "off":
        return None
    per_request: dict[str, dict[str, int]] = {}
    for request in requests:
        tokens = request.prompt_tokens + request.max_tokens
        one = sequence_wire_bytes(tokens, model)
        per_request[str(request.id)] = {
            "samples": request.num_samples,
            "tokens_per_sample": tokens,
            "wire_bytes": one["compact"] * request.num_samples,
            "json_list_bytes": one["json_lists"] * request.num_samples,
        }
    return {
        "dtype": compact_dtype(model),
        "moe_layers": moe_layer_count(model),
        "top_k": _moe(model).top_k,
        "samples": sum(r["samples"] for r in per_request.values()),
        "wire_bytes": sum(r["wire_bytes"] for r in per_request.values()),
        "json_list_bytes": sum(r["json_list_bytes"] for r in per_request.values()),
        "per_request": per_request,
    }

"""Recorded routes for routed-expert replay (R3): the experts a sampler routed each token of a datum to.

A scenario's ``forward_backward`` / ``forward`` request may carry ``routed_experts`` (``schema.requests.RecordedRoutes``):
a seed and how many tokens at the end of each row have no route. The routes are synthetic and deterministic, made here
from (seed, datum length) as the datum's tokens are made from (seed, length): ``[captured, layers, top_k]`` expert ids,
``top_k`` distinct experts per token and layer (a router never picks one expert twice), in the canonical compact dtype
(``r3_codec.smallest_dtype``). ``layers`` is every MoE layer of the model, what vLLM returns.

The captured prefix follows SkyRL's rule (``make_router_padding_mask``): vLLM records a route only for the tokens it
evaluated, so a row of ``L + 1`` tokens (input plus the last target) carries routes for its first
``L + 1 - uncaptured`` tokens; the trainer replays dummy routes on the rest and masks them out of router accounting.
"""

from __future__ import annotations

import numpy as np

from skyrl_sim.engine import r3_codec
from skyrl_sim.schema.architecture import ModelArch
from skyrl_sim.schema.requests import RecordedRoutes

STREAM = 0x52_33  # keeps the routes' random stream apart from the token ids' (seed, length) stream


def moe_layers(model: ModelArch) -> int:
    """The MoE layers of ``model``: the ``layers`` dimension of its routes."""
    return sum(1 for i in range(model.num_layers) if model.is_moe_layer(i))


def captured_tokens(datum_length: int, uncaptured: int) -> int:
    """Tokens of a datum's row (its ``L`` inputs and the last target) that carry a recorded route."""
    return max(0, datum_length + 1 - uncaptured)


def synthetic_routes(routes: RecordedRoutes, datum_length: int, model: ModelArch) -> np.ndarray:
    """The recorded routes of a datum of input length ``datum_length`` (see the module docstring)."""
    if model.moe is None:
        raise ValueError(f"model '{model.name}' has no mixture-of-experts layers")
    captured = captured_tokens(datum_length, routes.uncaptured)
    layers, experts, top_k = moe_layers(model), model.moe.num_experts, model.moe.top_k
    rng = np.random.default_rng([routes.seed, datum_length, STREAM])
    scores = rng.random((captured, layers, experts))
    if routes.expert_weights is None:
        ids = np.argsort(scores, axis=-1, kind="stable")[..., :top_k]  # top_k distinct experts per token and layer
    else:
        # weighted draws without replacement (Efraimidis-Spirakis): the k largest of u ** (1 / w)
        keys = scores ** (1.0 / np.asarray(routes.expert_weights, dtype=np.float64))
        ids = np.argsort(-keys, axis=-1, kind="stable")[..., :top_k]
    return ids.astype(r3_codec.smallest_dtype(experts - 1))


def expert_pairs(rows: list[tuple[RecordedRoutes, int]], width: int, pad_rows: int, model: ModelArch) -> np.ndarray:
    """The token-expert pairs each expert receives in each MoE layer, ``[layers, experts]``, when a micro-batch of
    ``rows`` (each datum's recorded routes and input length) of ``width`` positions is replayed as the real backend
    lays it out (``megatron_vllm.route_replay``): each row's captured routes, the padding route (experts ``0 ..
    top_k - 1``) on every other position of its row, and ``pad_rows`` copies of the first row."""
    if model.moe is None:
        raise ValueError(f"model '{model.name}' has no mixture-of-experts layers")
    layers, experts, top_k = moe_layers(model), model.moe.num_experts, model.moe.top_k
    counts = np.zeros((layers, experts), dtype=np.int64)
    first = None
    for index, (routes, length) in enumerate(rows):
        ids = synthetic_routes(routes, length, model)
        row = np.zeros((layers, experts), dtype=np.int64)
        for layer in range(layers):
            row[layer] = np.bincount(ids[:, layer, :].ravel(), minlength=experts)
        row[:, :top_k] += max(0, width - ids.shape[0])  # the padding route on the rest of the row
        counts += row
        if index == 0:
            first = row
    if first is not None:
        counts += pad_rows * first
    return counts


def busiest_shares(counts: np.ndarray, ep: int) -> tuple[float, float]:
    """From ``expert_pairs``: the busiest expert-parallel rank's pairs over its even share and the busiest expert's
    over an expert's, the largest over the layers (the rank holds ``experts / ep`` consecutive experts)."""
    rank_share, expert_load = 1.0, 1.0
    experts = counts.shape[1]
    for layer in counts:
        total = int(layer.sum())
        if not total:
            continue
        per_rank = layer.reshape(ep, experts // ep).sum(axis=1)
        rank_share = max(rank_share, float(per_rank.max()) * ep / total)
        expert_load = max(expert_load, float(layer.max()) * experts / total)
    return rank_share, expert_load

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
    ids = np.argsort(scores, axis=-1, kind="stable")[..., :top_k]  # top_k distinct experts per token and layer
    return ids.astype(r3_codec.smallest_dtype(experts - 1))

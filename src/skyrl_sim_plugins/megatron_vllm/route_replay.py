"""Routed-expert replay (R3) on the real backend: SkyRL 0.4.0's rules around megatron-core's ``RouterReplay``.

The trainer receives each datum's recorded routes compact (``r3_codec``: ``[captured, MoE layers, top_k]`` in the
smallest dtype; the worker decodes them strictly) and, per micro-batch, before its forward:

1. gathers the micro-batch's rows' routes as they arrive (compact dtype, every MoE layer): a call's pad rows copy row
   0's, a dummy row carries one padding route (SkyRL's batch padding);
2. slices them to the MoE layers of this pipeline stage's own routers (``index_select`` on the layer dimension);
3. places them in the micro-batch's layout ``[rows, width]``: the captured prefix of each row at its real tokens, a
   padding route on every other position (``arange(top_k)``: distinct experts, so the dropless dispatcher's
   ``tokens x top_k`` invariant holds);
4. converts them to int32 once, laid out as megatron's routers read their tokens: ``[layers, width x rows, top_k]``
   flattened sequence-major (hidden states are ``[s, b, h]``; the router's ``view(-1, experts)`` puts token ``(s, b)``
   at ``s * rows + b``), one view per router, handed to ``RouterReplay.set_replay_data``;
5. builds the ``router_padding_mask`` ``[rows, width]`` (True = no captured route: right padding, the uncaptured
   suffix, and every pad and dummy row), passed to the model as ``padding_mask`` so the routers leave those tokens
   out of their accounting (expert bias, aux losses).

After the forward the routers switch to ``REPLAY_BACKWARD``: a recompute inside the backward pops the ids in FIFO
order. The replay state is scoped to one schedule (``schedule``): cleared before it and in ``finally``, so a
forward-only pass (whose ids nobody pops) or a failed call cannot leave ids for the next training step.

The int32 ids stay referenced by ``RouterReplay``'s backward FIFO until the schedule ends (a recompute pops and
releases each micro-batch's; without recompute they accumulate over the call's micro-batches): what the simulator's
walk holds (``sim.moe_routes.replay_mb_tensors``).

SkyRL's own ``_split_replay_indices`` flattens the aligned ids batch-major (``b * width + s``). With one row per
micro-batch (THD packing, SkyRL's default) both orders agree; with several BSHD rows per micro-batch the routers would
read another token's route, so this backend flattens in the routers' order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from skyrl_sim.api import ModelArch


class RouteReplay:
    """The routers of one model and their replay state (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, arch: ModelArch, all_layers: bool = False) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        assert arch.moe is not None
        routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]
        if [r.router_replay for r in routers] != RouterReplay.global_router_replay_instances:
            raise RuntimeError("the model's routers are not megatron's registered RouterReplay instances")
        moe_index = {g: i for i, g in enumerate(i for i in range(arch.num_layers) if arch.is_moe_layer(i))}
        # each router's MoE layer among the routes' layers (every MoE layer of the model), in instance order
        self.layers = [moe_index[r.layer_number - 1] for r in routers]
        self.top_k = arch.moe.top_k
        self.moe_layers = len(moe_index)
        # int32-all-layers (the old path) converts every layer's ids; compact only this stage's routers' layers
        self.kept = list(range(self.moe_layers)) if all_layers else self.layers

    @staticmethod
    def clear() -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()

    @contextlib.contextmanager
    def schedule(self, active: bool) -> Iterator[None]:
        """One schedule's replay scope: the state cleared before it and after it, whatever happens."""
        if not active:
            yield
            return
        self.clear()
        try:
            yield
        finally:
            self.clear()

    def install(self, mb: Any, routes: Sequence[np.ndarray | None], rows: int) -> torch.Tensor:
        """Hand one micro-batch's replay ids to the routers (``REPLAY_FORWARD``); returns its router padding mask."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        ids, mask = microbatch_replay(mb.row_index, mb.lengths, mb.tokens.shape[1], routes, rows, self)
        if len(self.kept) != len(self.layers):  # the old path held every layer: the routers read their own
            ids = ids[self.layers]
        RouterReplay.set_replay_data(list(ids.unbind(0)))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return mask

    @staticmethod
    def after_forward() -> None:
        """A recompute inside the backward pops the ids the forward used (SkyRL's
        ``setup_per_microbatch_replay_backward``)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    @staticmethod
    def record() -> None:
        """Let the routers route and record their top-k ids (what a sampler's capture gives)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)

    def used(self, row_index: Sequence[int], lengths: Sequence[int], width: int) -> dict[int, np.ndarray]:
        """The ids each router used for the micro-batch just run (recorded or replayed), per real row of the call:
        ``[row tokens, MoE layers, top_k]`` (this stage's routers' layers), keyed by the row's index in the call."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        per_layer = []
        for instance in RouterReplay.global_router_replay_instances:
            ids = instance.recorded_topk_idx if instance.recorded_topk_idx is not None else instance.target_topk_idx
            per_layer.append(ids.detach().to("cpu", torch.int64).view(width, len(row_index), self.top_k))
        stacked = torch.stack(per_layer, dim=2)  # [width, rows, layers, top_k]
        return {
            index: stacked[:n, r].numpy().copy()
            for r, (index, n) in enumerate(zip(row_index, lengths, strict=True))
            if index >= 0
        }


def microbatch_replay(
    row_index: Sequence[int],
    lengths: Sequence[int],
    width: int,
    routes: Sequence[np.ndarray | None],
    rows: int,
    replay: RouteReplay,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's int32 replay ids ``[kept layers, width x rows, top_k]`` and its router padding mask
    ``[rows, width]`` (steps 1-5 of the module docstring). ``row_index``: each row's index in the call (``>= rows``: a
    pad row, a copy of row 0; -1: a dummy row); ``lengths``: its tokens, moved left; ``routes``: each datum's recorded
    routes (None: the datum has none)."""
    k, everything = replay.top_k, replay.moe_layers
    dtype = next((torch.from_numpy(np.asarray(r)).dtype for r in routes if r is not None), torch.uint8)
    padding_route = torch.arange(k, dtype=dtype).expand(1, everything, k)
    parts: list[torch.Tensor] = []
    captured: list[int] = []
    for index, n in zip(row_index, lengths, strict=True):
        source = routes[index if index < rows else 0] if index >= 0 else None
        if index < 0:
            part = padding_route  # a dummy row's one token
        elif source is None:
            part = padding_route[:0]
        else:
            part = torch.from_numpy(np.ascontiguousarray(source))
            if part.shape[0] > n or part.shape[1:] != (everything, k):
                raise ValueError(f"routes {tuple(part.shape)} do not fit a row of {n} tokens, {everything} x {k} ids")
        parts.append(part)
        captured.append(part.shape[0] if 0 <= index < rows else 0)
    arrived = torch.cat(parts)  # the micro-batch's routes as the trainer receives them: compact, every MoE layer
    local = arrived.index_select(1, torch.tensor(replay.kept))  # this stage's own layers
    del arrived
    aligned = padding_route[:, : len(replay.kept)].expand(len(lengths), width, len(replay.kept), k).clone()
    offset = 0
    for r, part in enumerate(parts):
        aligned[r, : part.shape[0]] = local[offset : offset + part.shape[0]]
        offset += part.shape[0]
    del local
    # [rows, width, layers, k] -> [layers, width, rows, k]: sequence-major, as the routers flatten [s, b]
    ordered = aligned.permute(2, 1, 0, 3).contiguous()
    del aligned
    ids = ordered.to(torch.int32).view(len(replay.kept), width * len(lengths), k)  # the single int32 conversion
    del ordered
    mask = torch.ones(len(lengths), width, dtype=torch.bool)
    for r, c in enumerate(captured):
        mask[r, :c] = False
    return ids, mask

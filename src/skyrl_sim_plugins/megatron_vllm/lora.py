"""TP-aware LoRA adapters around megatron-core's ColumnParallelLinear / RowParallelLinear (megatron-core has no LoRA).

Laid out as Megatron-Bridge's ``ParallelLinearAdapter`` (what SkyRL trains with, and what the simulator's walk
sizes): both factors are sharded over TP, nothing is replicated, and B is always column-parallel:

- column-parallel base (``linear_qkv``, ``linear_fc1``): A ``[r/tp, in]``, its output all-gathered to ``[s, b, r]``,
  B ``[out/tp, r]``: ``delta = copy_to(gather(x @ A.T)) @ B.T``, sharded like the base output;
- row-parallel base (``linear_proj``, ``linear_fc2``): A ``[r, in/tp]``, its output all-reduced to ``[s, b, r]``,
  B ``[out/tp, r]``, its output all-gathered to the full width: ``delta = gather(copy_to(reduce(x @ A.T)) @ B.T)``.

``copy_to`` (identity forward, all-reduce backward) on B's input makes every rank's rank-r gradient the full sum, so
the A shards' gradients are exact. A is drawn from one generator seeded per module as the full matrix and sliced, so
every TP size holds the same adapter; B starts at zero, so a fresh adapter leaves the base model unchanged.
Output = base + (alpha / rank) * delta. The factors are held in ``lora.dtype`` (the trainer's ``params_dtype`` when
unset) and cast to the activations' dtype where they differ; the gradients and Adam state that go with a 16-bit
adapter are the trainer's (``trainer.AdapterOptimizer``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from skyrl_sim.api import Lora

ROW_TARGETS = frozenset({"linear_proj", "linear_fc2", "out_proj"})  # out_proj: a gated DeltaNet's


class LoraLinear(nn.Module):
    """A frozen megatron parallel linear plus a trainable rank-r update, TP-aware."""

    def __init__(
        self, base: nn.Module, target: str, lora: Lora, tp: int, tp_rank: int, seed: int, name: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.row_parallel = target in ROW_TARGETS
        self.scale = lora.scale
        self.tp = tp
        weight = base.weight
        out_local, in_local = weight.shape
        full_in = in_local * tp if self.row_parallel else in_local
        full_out = out_local if self.row_parallel else out_local * tp
        if lora.rank % tp or full_out % tp:
            raise ValueError(f"{name}: LoRA rank {lora.rank} and width {full_out} must divide by TP {tp}")
        generator = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
        a_full = torch.empty(lora.rank, full_in)
        # kaiming-uniform(a=sqrt(5)) bound, as PEFT initialises A
        bound = 1.0 / math.sqrt(full_in)
        a_full.uniform_(-bound, bound, generator=generator)
        a = a_full.chunk(tp, dim=1 if self.row_parallel else 0)[tp_rank]
        self.lora_a = nn.Parameter(a.contiguous().to(weight.device, dtype))
        self.lora_b = nn.Parameter(torch.zeros(full_out // tp, lora.rank, device=weight.device, dtype=dtype))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        out, bias = self.base(x, *args, **kwargs)
        low = x @ self.lora_a.to(x.dtype).t()
        if self.row_parallel:
            low = reduce_from_tensor_model_parallel_region(low)
        else:
            low = gather_from_tensor_model_parallel_region(low)
        low = copy_to_tensor_model_parallel_region(low)
        # scaled in the same expression, as Megatron-Bridge's adapter rebinds its output: B's unscaled output dies
        # before the sum is made (a named ``delta`` would keep a third output-sized tensor alive through the add)
        if self.row_parallel:
            scaled = gather_from_tensor_model_parallel_region(low @ self.lora_b.to(x.dtype).t()) * self.scale
        else:
            scaled = (low @ self.lora_b.to(x.dtype).t()) * self.scale
        return out + scaled, bias

    def merged_weight(self) -> torch.Tensor:
        """This rank's base weight shard with the update merged in (what the HF checkpoint holds). A collective under
        TP: the factor the shard needs whole (A for a column-parallel base, B for a row-parallel one) is gathered."""
        w = self.base.weight
        a, b = self.lora_a.detach().float(), self.lora_b.detach().float()
        if self.row_parallel:
            b = _gather_rows(b, self.tp)
        else:
            a = _gather_rows(a, self.tp)
        return (w.float() + self.scale * (b @ a)).to(w.dtype)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)


def _gather_rows(shard: torch.Tensor, tp: int) -> torch.Tensor:
    """The TP ranks' shards of a matrix split on its first dimension, concatenated in rank order."""
    if tp == 1:
        return shard
    import torch.distributed as dist
    from megatron.core import parallel_state

    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=0)


def attach_lora(
    model: nn.Module,
    lora: Lora,
    targets: frozenset[str],
    tp: int,
    tp_rank: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    name_of: Callable[[str], str] = str,
    expert_offset: int = 0,
) -> list[nn.Parameter]:
    """Wrap every linear of the decoder named in ``targets`` (``Endpoint.adapted_targets``) with adapters held in
    ``dtype``; returns the adapter parameters (the only trainable ones). ``name_of`` gives a module's name in the
    whole model, which seeds its A (a pipeline stage names its layers from 0); ``expert_offset``: the global index of
    this expert-parallel rank's first expert, so an expert's adapter starts the same whichever rank holds it."""
    found: list[tuple[nn.Module, str, str]] = []
    for name, module in model.named_modules():
        for child_name, _child in module.named_children():
            if child_name in targets:
                found.append((module, child_name, f"{name}.{child_name}"))
    params: list[nn.Parameter] = []
    for parent, child_name, full in found:
        seeded = global_name(name_of(full), expert_offset)
        wrapped = LoraLinear(getattr(parent, child_name), child_name, lora, tp, tp_rank, seed, seeded, dtype)
        setattr(parent, child_name, wrapped)
        params += [wrapped.lora_a, wrapped.lora_b]
    if not params:
        raise RuntimeError(f"no LoRA targets {sorted(targets)} found in the model")
    return params


def global_name(name: str, expert_offset: int) -> str:
    """A module's name with its local expert index made global (``local_experts.j`` -> ``j + expert_offset``)."""
    if not expert_offset or ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.", 1)
    index, _, tail = rest.partition(".")
    return f"{head}.local_experts.{int(index) + expert_offset}" + (f".{tail}" if tail else "")


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's megatron parameters under their base names, LoRA merged into each adapted weight."""
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith(("lora_a", "lora_b")):
            continue
        state[name.replace(".base.", ".")] = param.detach()
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            state[f"{name}.weight"] = module.merged_weight().detach()
    return state

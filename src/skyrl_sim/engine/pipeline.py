"""Pipeline-parallel stages: which decoder layers each stage holds, defined once for the memory walk and MoE replay.

Stages take consecutive layers; an uneven split gives the first stages one more layer, as vLLM's ``get_pp_indices``
does (megatron-core refuses an uneven split unless its first/last stage sizes are given), so the last stage, which
also runs the LM head and the log-prob, is never the larger one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skyrl_sim.schema.architecture import ModelArch
    from skyrl_sim.schema.endpoint import Endpoint


def pipeline_stages(num_layers: int, pp: int) -> list[range]:
    """Consecutive layers of each of ``pp`` stages; an uneven split gives the first stages one more."""
    if pp > num_layers:
        raise ValueError(f"pipeline parallel size {pp} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    stages: list[range] = []
    start = 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def stage_layers(model: ModelArch, endpoint: Endpoint) -> list[int]:
    """Layer indices on the rank the memory walk follows: the last pipeline stage (it also runs the LM head)."""
    return list(pipeline_stages(model.num_layers, endpoint.parallelism.pp)[-1])

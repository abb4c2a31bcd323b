"""What ``advise`` searches: the settings an operator can change on a deployment, as axes of values.

- engine: the request-count cap (``CAP``, searched by bisection, not as an axis), cap-aware padding, the sampling mode
  and ``sample_max_num_sequences`` (the last two only when the workload samples). The cap and cap-aware padding are
  PR #1874's, in no SkyRL release: on an endpoint whose ``skyrl_version`` lacks them they are searched as a what-if
  and labelled (``settings_labels``), and ``released_sets`` holds them off for ``--released-only``;
- trainer: the micro batch size, ``max_tokens_per_microbatch``, ``remove_microbatch_padding``, recompute granularity
  and the number of recomputed layers;
- parallelism: every TP x DP split of the endpoint's devices that the model's heads allow;
- vLLM (a workload that samples on a SkyRL-Train endpoint): memory utilization, CUDA graphs and the placement.

A configuration is a set of dotted overrides; its *structure* is every setting but the cap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skyrl_sim.engine.rules import SKYRL_TRAIN_STRATEGIES
from skyrl_sim.errors import UserError
from skyrl_sim.schema.skyrl_versions import PR_SETTING_LABEL, PR_SETTINGS, has_setting, setting_label
from skyrl_sim.schema.variant import ResolvedVariant

CAP = "engine.forward_backward_max_request_count"
CAP_AWARE = "engine.cap_aware_padding"


@dataclass(frozen=True)
class AxisChoice:
    """One searched setting: its name and its values, each a set of dotted overrides; ordered by memory when
    ``monotone`` (a value that fails makes every later one fail)."""

    name: str
    values: tuple[dict[str, Any], ...]
    monotone: bool = False


def settings_key(settings: dict[str, Any]) -> str:
    """One configuration's identity: its overrides in key order."""
    return repr(sorted(settings.items(), key=lambda kv: kv[0]))


def dotted_get(data: dict[str, Any], dotted: str) -> Any:
    """A dotted key's value in a nested mapping (None when a part is missing)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def pass_requests(variant: ResolvedVariant) -> int:
    """forward_backward/forward requests in the workload: a cap at or above it never cuts a set."""
    count = 0
    for index in range(len(variant.workload.clients)):
        count += sum(1 for p in variant.client_requests(index) if p.spec.type in ("forward_backward", "forward"))
    return max(1, count)


def samples(variant: ResolvedVariant) -> bool:
    """Whether the workload has sample requests (then the sampling and vLLM axes are searched)."""
    return any(r.type == "sample" for c in variant.workload.clients for r in c.requests)


def longest_row(variant: ResolvedVariant) -> int:
    return max(
        [
            p_len + 1
            for index in range(len(variant.workload.clients))
            for p in variant.client_requests(index)
            for p_len in p.datums
        ]
        or [1]
    )


def cap_ladder(n: int) -> list[int | None]:
    """Caps to bisect over: 1, 2, 3, 4, 6, 8, 12, ... below ``n``, then unlimited (None, the same as ``n``)."""
    ladder: list[int] = []
    value = 1
    while value < n:
        ladder.append(value)
        value = value + 1 if value < 4 else (value * 3 // 2 if value & (value - 1) == 0 else value * 4 // 3)
    return [*ladder, None]


def search_axes(variant: ResolvedVariant, fixed: Sequence[str]) -> list[AxisChoice]:
    """The structural axes (everything but the cap) for this endpoint and workload; ``fixed`` keys stay as they are."""
    ep = variant.endpoint
    model = variant.model
    t = ep.trainer
    axes: list[AxisChoice] = []

    micro_now = t.micro_train_batch_size_per_gpu
    micros = sorted({m for m in (1, 2, 4, 8, 16, 32) if m <= max(micro_now, 16)} | {micro_now})
    axes.append(AxisChoice("micro batch", tuple({"trainer.micro_train_batch_size_per_gpu": m} for m in micros), True))

    longest = longest_row(variant)
    budget = int(math.ceil(longest / 1024) * 1024)
    budgets = [-1] if t.max_tokens_per_microbatch == -1 else [t.max_tokens_per_microbatch]
    budgets += [b for b in (budget, 2 * budget) if b not in budgets]
    axes.append(AxisChoice("token budget", tuple({"trainer.max_tokens_per_microbatch": b} for b in budgets)))

    # megatron-core's local attention cannot run packed (THD) micro-batches: only the TransformerEngine spec may pack
    packs = [False, True] if t.layer_spec == "transformer_engine" else [t.remove_microbatch_padding]
    axes.append(AxisChoice("microbatch padding", tuple({"trainer.remove_microbatch_padding": v} for v in packs)))

    layers = model.num_layers
    recompute: list[dict[str, Any]] = [
        {"trainer.recompute.granularity": "full", "trainer.recompute.method": "uniform", "trainer.recompute.num_layers": 1}
    ]
    for n in sorted({layers * 3 // 4, layers // 2}, reverse=True):
        if 0 < n < layers:
            recompute.append(
                {
                    "trainer.recompute.granularity": "full",
                    "trainer.recompute.method": "block",
                    "trainer.recompute.num_layers": n,
                }
            )
    for granularity in ("selective", "none"):
        recompute.append(
            {
                "trainer.recompute.granularity": granularity,
                "trainer.recompute.method": "uniform",
                "trainer.recompute.num_layers": 1,
            }
        )
    axes.append(AxisChoice("recompute", tuple(recompute), True))

    p = ep.parallelism
    width = p.tp * p.dp
    splits = []
    for tp in range(1, width + 1):
        if width % tp or model.num_attention_heads % tp or model.num_kv_heads % tp:
            continue
        splits.append(
            {
                "parallelism.tp": tp,
                "parallelism.dp": width // tp,
                "parallelism.sequence_parallel": tp > 1 and p.sequence_parallel,
            }
        )
    if len(splits) > 1:
        axes.append(AxisChoice("parallelism", tuple(splits)))

    if samples(variant):
        axes.append(AxisChoice("sampling", ({"engine.sampling": "continuous"}, {"engine.sampling": "serial"})))
        sizes = [ep.engine.sample_max_num_sequences] + [n for n in (8, 32) if n != ep.engine.sample_max_num_sequences]
        axes.append(AxisChoice("sample batch", tuple({"engine.sample_max_num_sequences": n} for n in sizes)))

    if samples(variant) and ep.trainer.strategy in SKYRL_TRAIN_STRATEGIES:
        axes.extend(inference_axes(variant))

    kept = []
    for axis in axes:
        if any(k in fixed for value in axis.values for k in value):
            continue
        kept.append(axis)
    return kept


def inference_axes(variant: ResolvedVariant) -> list[AxisChoice]:
    """vLLM's settings for a workload that samples on a SkyRL-Train endpoint (``sim.colocation``): its memory
    utilization (on shared devices: what its start, wakes and the trainer's backloads must fit beside), CUDA graphs
    (``enforce_eager`` gives their memory back), ``max_num_seqs`` (the sampler warm-up's rows, the V2 sampler's state
    and the largest captured graph shrink with it; it also caps a step's batch), the placement (``colocate_all:
    false`` gives vLLM devices of its own, ``num_engines x tensor_parallel_size`` more of them, and forwards samples
    around the engine) and, on engines that already have devices of their own and a full-weight trainer,
    ``offload_kv_for_weight_sync`` (the KV cache is not on the device while the sync's buffers are; SkyRL refuses it
    colocated, with LoRA, and before PR #1934)."""
    endpoint = variant.endpoint
    inference = endpoint.inference
    utilizations = [inference.gpu_memory_utilization]
    utilizations += [u for u in (0.9, 0.8, 0.7, 0.6, 0.5) if u != inference.gpu_memory_utilization]
    eager = inference.enforce_eager
    shared = endpoint.placement.colocate_all
    seqs = [inference.max_num_seqs] + [n for n in (512, 256, 128) if n < inference.max_num_seqs]
    axes = [
        AxisChoice("vLLM memory", tuple({"inference.gpu_memory_utilization": u} for u in utilizations)),
        AxisChoice("CUDA graphs", tuple({"inference.enforce_eager": v} for v in (eager, not eager))),
        AxisChoice("vLLM batch", tuple({"inference.max_num_seqs": n} for n in seqs)),
        AxisChoice("placement", tuple({"placement.colocate_all": v} for v in (shared, not shared))),
    ]
    if not shared and endpoint.trainer.train_base_weights and endpoint.rules.offload_kv_for_weight_sync:
        offload = inference.offload_kv_for_weight_sync
        values = tuple({"inference.offload_kv_for_weight_sync": v} for v in (offload, not offload))
        axes.append(AxisChoice("KV cache in a sync", values))
    return axes


def current_choice(axis: AxisChoice, endpoint: dict[str, Any]) -> int:
    """The index of the endpoint's own value on an axis (0 when none matches)."""
    for i, value in enumerate(axis.values):
        if all(dotted_get(endpoint, k) == v for k, v in value.items()):
            return i
    return 0


SEPARATE_DEVICES_LABEL = "vLLM on devices of its own: num_engines x tensor_parallel_size more devices"
"""What ``placement.colocate_all: false`` costs that the objective does not show: the search keeps the trainer's
devices, and separate engines need their own."""


def settings_labels(settings: dict[str, Any], version: str) -> dict[str, str]:
    """The settings that ``version`` lacks, turned on (a cap set, cap-aware padding true), with their label; and
    vLLM moved to devices of its own, which needs more hardware."""
    on = {k: v for k, v in settings.items() if v is not None and v is not False}
    labels = {k: setting_label(version, k) for k in on if setting_label(version, k)}
    if settings.get("placement.colocate_all") is False:
        labels["placement.colocate_all"] = SEPARATE_DEVICES_LABEL
    return labels


def changes(settings: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The overrides whose value differs from the base endpoint's."""
    return {k: v for k, v in sorted(settings.items()) if dotted_get(base, k) != v}


def released_sets(sets: dict[str, Any], version: str) -> dict[str, Any]:
    """``sets`` with every PR #1874 setting ``version`` lacks held off (no cap, no cap-aware padding), so the search
    keeps them as given; a ``--set`` that turns one on contradicts ``--released-only``."""
    out = dict(sets)
    for key in PR_SETTINGS:
        if has_setting(version, key):
            continue
        off = None if key == CAP else False
        for given in (key, f"endpoint.{key}"):
            if given in out and out[given] != off:
                raise UserError(f"--released-only: --set {given}={out[given]} is {PR_SETTING_LABEL} (SkyRL {version})")
            out.pop(given, None)
        out[key] = off
    return out


def without_cap(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of a configuration's structure: all but the cap."""
    return {k: v for k, v in settings.items() if k != CAP}

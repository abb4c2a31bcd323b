"""The knobs: what a SkyRL operator can vary, with which SkyRL key, on which SkyRL version, at what device cost, and
which values ``advise`` tries. One table (``KNOBS``); ``advise`` searches it, and ``advise``, ``sweep`` and ``check``
label keys from it.

A knob is one setting of a deployment, which may span several endpoint keys (recompute: granularity, method, layers;
parallelism: TP, with DP and sequence parallel following from it). For each endpoint key it names the SkyRL key an
operator writes (``skyrl_keys``; ``DERIVED`` where SkyRL derives it from the others and there is nothing to write) and
``where`` it is written: SkyRL's ``--backend-config`` (SkyRL-Train's or the JAX backend's config), the API server's
engine config, or PR #1874's code. ``versions`` says which SkyRL revisions have it (``skyrl_versions.VERSIONS``: read
from the version table, never from a version's name).

The simulator also has keys that are no SkyRL setting at all: its modelling modes, and constants of SkyRL's code it
lets a scenario change (``MODELLING``). SkyRL decides these itself (the sampling mode follows ``trainer.strategy`` and
``placement.colocate_all``); ``advise`` never searches them, and ``sweep`` and ``check`` say so where they appear.

What a configuration costs in devices is ``devices_needed`` (the one rule): the trainer's ``hardware.devices``, plus
``inference.num_engines x inference.tensor_parallel_size`` when vLLM runs on devices of its own
(``placement.colocate_all: false``; colocated, the engines share the trainer's devices).

**Adding a knob** (the trainer strategy, an allocator flag, ...): append a ``Knob`` to ``KNOBS`` with

- ``skyrl_keys``: each endpoint key it sets and its SkyRL key, read from SkyRL's code (cite the file in a comment);
- ``where`` and ``versions`` (default: every modelled version has it);
- ``values(variant)``: the overrides to try, the endpoint's own value first; ``monotone=True`` when they are ordered by
  memory (a value that runs out of memory makes every later one fail: the search stops there);
- ``applies(variant)``: when it is searched at all (a vLLM setting only when the workload samples);
- ``device_cost``: in words, when a value needs more devices, and make ``devices_needed`` count them;
- ``unpriced_cost``: in words, a cost of a value that the simulator's time model does not price (``unpriced`` says
  which values): ``advise`` then ranks a configuration that changes to it after every safe one that does not;
- ``to_skyrl`` when a value is written differently in SkyRL (recompute ``none`` is ``gradient_checkpointing: false``);
- ``without`` when a version may lack it: the values that mean "not used" (what ``advise`` holds it at there).

``tests/test_knobs.py`` then checks that every key it sets is an endpoint key, that it is never a modelling key, and
that its SkyRL key agrees with ``endpoints from-skyrl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skyrl_sim.engine.rules import SKYRL_TRAIN_STRATEGIES
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.skyrl_versions import PR_SETTING_LABEL, VERSIONS, SkyrlRules, dotted_endpoint_key, rules
from skyrl_sim.schema.variant import ResolvedVariant
from skyrl_sim.schema.vllm_versions import PIN_LABEL, pin_note

Values = list[dict[str, Any]]
DERIVED = ""
"""The SkyRL key of an endpoint key that SkyRL derives from the knob's other keys: nothing to write."""

BACKEND_CONFIG = "SkyRL-Train's --backend-config"
JAX_BACKEND_CONFIG = "the JAX backend's --backend-config"
ENGINE_CONFIG = "the API server's engine config (PR #1874)"
PR_CODE = "PR #1874's code (always on there; no key)"

MEGATRON = "trainer.policy.megatron_config."
TRANSFORMER = MEGATRON + "transformer_config_kwargs."
INFERENCE_ENGINE = "generator.inference_engine."

EAGER_COST = (
    "vLLM without CUDA graphs launches every kernel of every decode step one by one: a slower generation the "
    "simulator does not price (its step time is the same with graphs; SkyRL 0.4.0 warns of 2-3x slower generation "
    "with LoRA adapters), so advise recommends it only when no configuration with graphs passes"
)
"""What ``enforce_eager: true`` costs that the time model leaves out."""

CAP = "engine.forward_backward_max_request_count"
CAP_AWARE = "engine.cap_aware_padding"


def every_version(version: SkyrlRules) -> bool:
    return True


def always(variant: ResolvedVariant) -> bool:
    return True


def never(key: str, value: Any) -> bool:
    return False


@dataclass(frozen=True)
class Knob:
    """One setting an operator can vary (see the module docstring for each field and how to add one)."""

    name: str
    skyrl_keys: dict[str, str]
    """Endpoint key -> SkyRL key (``DERIVED``: SkyRL derives it from the knob's other keys)."""
    where: str = BACKEND_CONFIG
    versions: Callable[[SkyrlRules], bool] = every_version
    version_label: str = ""
    """What an output says of the knob on a version that lacks it."""
    device_cost: str = ""
    """In words: when a value needs more devices (``devices_needed`` counts them)."""
    adds_devices: Callable[[str, Any], bool] = never
    """Whether ``key = value`` needs more devices than the trainer's (the footnote ``device_cost`` then applies)."""
    unpriced_cost: str = ""
    """In words: what a value costs that the time model does not price (``unpriced`` says which values)."""
    unpriced: Callable[[str, Any], bool] = never
    """Whether changing to ``key = value`` has the cost ``unpriced_cost`` describes."""
    values: Callable[[ResolvedVariant], Values] | None = None
    """The overrides ``advise`` tries (None: searched otherwise, or not at all)."""
    monotone: bool = False
    applies: Callable[[ResolvedVariant], bool] = always
    to_skyrl: Callable[[str, Any], dict[str, Any]] | None = None
    """(endpoint key, value) -> {SkyRL key: value}, when a value is not written as itself under its key."""
    without: dict[str, Any] = field(default_factory=dict)
    """The values that mean the knob is not used: what ``advise`` holds it at on a version that lacks it."""

    def available(self, version: str) -> bool:
        """Whether SkyRL ``version`` has this knob."""
        return self.versions(rules(version))

    @property
    def released(self) -> bool:
        """Whether some SkyRL release has this knob."""
        return any(r.released and self.versions(r) for r in VERSIONS.values())

    def skyrl_settings(self, key: str, value: Any) -> dict[str, Any]:
        """What an operator writes in SkyRL for ``key = value`` (empty for a derived key)."""
        if self.to_skyrl is not None:
            return self.to_skyrl(key, value)
        skyrl_key = self.skyrl_keys[key]
        return {skyrl_key: value} if skyrl_key != DERIVED else {}


def samples(variant: ResolvedVariant) -> bool:
    """Whether the workload has sample requests (then the sampling and vLLM knobs apply)."""
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


def on_skyrl_train(variant: ResolvedVariant) -> bool:
    return variant.endpoint.trainer.strategy in SKYRL_TRAIN_STRATEGIES


def micro_sizes(variant: ResolvedVariant) -> Values:
    now = variant.endpoint.trainer.micro_train_batch_size_per_gpu
    micros = sorted({m for m in (1, 2, 4, 8, 16, 32) if m <= max(now, 16)} | {now})
    return [{"trainer.micro_train_batch_size_per_gpu": m} for m in micros]


def token_budgets(variant: ResolvedVariant) -> Values:
    now = variant.endpoint.trainer.max_tokens_per_microbatch
    budget = int(math.ceil(longest_row(variant) / 1024) * 1024)
    budgets = [-1] if now == -1 else [now]
    budgets += [b for b in (budget, 2 * budget) if b not in budgets]
    return [{"trainer.max_tokens_per_microbatch": b} for b in budgets]


def packing(variant: ResolvedVariant) -> Values:
    # megatron-core's local attention cannot run packed (THD) micro-batches: only the TransformerEngine spec may pack
    t = variant.endpoint.trainer
    packs = [False, True] if t.layer_spec == "transformer_engine" else [t.remove_microbatch_padding]
    return [{"trainer.remove_microbatch_padding": v} for v in packs]


def recompute_choices(variant: ResolvedVariant) -> Values:
    """Full uniform recompute, full block recompute of 3/4 and 1/2 of the layers, selective, none: in order of memory."""
    layers = variant.model.num_layers

    def choice(granularity: str, method: str, num_layers: int) -> dict[str, Any]:
        return {
            "trainer.recompute.granularity": granularity,
            "trainer.recompute.method": method,
            "trainer.recompute.num_layers": num_layers,
        }

    out = [choice("full", "uniform", 1)]
    out += [choice("full", "block", n) for n in sorted({layers * 3 // 4, layers // 2}, reverse=True) if 0 < n < layers]
    out += [choice(granularity, "uniform", 1) for granularity in ("selective", "none")]
    return out


RECOMPUTE_KEYS = {
    "trainer.recompute.granularity": TRANSFORMER + "recompute_granularity",
    "trainer.recompute.method": TRANSFORMER + "recompute_method",
    "trainer.recompute.num_layers": TRANSFORMER + "recompute_num_layers",
}
"""The endpoint's recompute keys and megatron-core's ``TransformerConfig`` arguments SkyRL passes them as."""


def recompute_in_skyrl(key: str, value: Any) -> dict[str, Any]:
    """SkyRL's Megatron worker passes ``transformer_config_kwargs.recompute_*`` to megatron-core and sets them to None
    when ``trainer.gradient_checkpointing`` is false (``workers/megatron/megatron_worker.py``); so granularity
    ``none`` is ``gradient_checkpointing: false``, any other granularity needs it true (SkyRL's default)."""
    if key == "trainer.recompute.granularity":
        if value == "none":
            return {"trainer.gradient_checkpointing": False}
        return {"trainer.gradient_checkpointing": True, RECOMPUTE_KEYS[key]: value}
    return {RECOMPUTE_KEYS[key]: value}


def tp_splits(variant: ResolvedVariant) -> Values:
    """Every TP x DP split of the trainer's devices that the model's heads allow (none when there is only one)."""
    model, p = variant.model, variant.endpoint.parallelism
    width = p.tp * p.dp
    splits = [
        {
            "parallelism.tp": tp,
            "parallelism.dp": width // tp,
            "parallelism.sequence_parallel": tp > 1 and p.sequence_parallel,
        }
        for tp in range(1, width + 1)
        if not (width % tp or model.num_attention_heads % tp or model.num_kv_heads % tp)
    ]
    return splits if len(splits) > 1 else []


def sample_batches(variant: ResolvedVariant) -> Values:
    now = variant.endpoint.engine.sample_max_num_sequences
    return [{"engine.sample_max_num_sequences": n} for n in [now] + [n for n in (8, 32) if n != now]]


def utilizations(variant: ResolvedVariant) -> Values:
    now = variant.endpoint.inference.gpu_memory_utilization
    return [{"inference.gpu_memory_utilization": u} for u in [now] + [u for u in (0.9, 0.8, 0.7, 0.6, 0.5) if u != now]]


def cuda_graphs(variant: ResolvedVariant) -> Values:
    eager = variant.endpoint.inference.enforce_eager
    return [{"inference.enforce_eager": v} for v in (eager, not eager)]


def batch_sizes(variant: ResolvedVariant) -> Values:
    """``max_num_seqs``: the endpoint's own, then SkyRL's default 1024 (``InferenceEngineConfig.max_num_seqs``), 512,
    256, 128 below it (the sampler warm-up's rows, the V2 sampler's
    state and the largest captured graph shrink with it; it also caps a step's batch)."""
    now = variant.endpoint.inference.max_num_seqs
    return [{"inference.max_num_seqs": n} for n in [now] + [n for n in (1024, 512, 256, 128) if n < now]]


def kv_offloads(variant: ResolvedVariant) -> Values:
    offload = variant.endpoint.inference.offload_kv_for_weight_sync
    return [{"inference.offload_kv_for_weight_sync": v} for v in (offload, not offload)]


def separate_full_weight_sync(variant: ResolvedVariant) -> bool:
    """Where SkyRL takes ``offload_kv_for_weight_sync`` (``train/utils/utils.py: validate_cfg``): engines on devices
    of their own and a full-weight trainer (lora rank 0), on a workload that samples on SkyRL-Train."""
    endpoint = variant.endpoint
    return vllm_on_skyrl_train(variant) and not endpoint.placement.colocate_all and endpoint.trainer.train_base_weights


def placements(variant: ResolvedVariant) -> Values:
    shared = variant.endpoint.placement.colocate_all
    return [{"placement.colocate_all": v} for v in (shared, not shared)]


def vllm_on_skyrl_train(variant: ResolvedVariant) -> bool:
    """vLLM's settings: a workload that samples on a SkyRL-Train endpoint (``sim.colocation``)."""
    return samples(variant) and on_skyrl_train(variant)


def graphs_settable(variant: ResolvedVariant) -> bool:
    """vLLM's settings apply, and ``enforce_eager`` is one SkyRL keeps: it turns it back off when the trainer syncs
    LoRA adapters (``Endpoint.adapter_weight_sync``; ``train/config/config.py``)."""
    return vllm_on_skyrl_train(variant) and not variant.endpoint.adapter_weight_sync


def both_ways(key: str) -> Callable[[ResolvedVariant], Values]:
    """A boolean endpoint key's two values, the endpoint's own first."""

    def values(variant: ResolvedVariant) -> Values:
        now: Any = variant.endpoint
        for name in key.split("."):
            now = getattr(now, name)
        return [{key: now}, {key: not now}]

    return values


def on_fsdp(variant: ResolvedVariant) -> bool:
    return variant.endpoint.trainer.strategy == "fsdp"


def megatron_full_fine_tune(variant: ResolvedVariant) -> bool:
    """A Megatron full fine-tune: its optimizer state is worth moving to the host (LoRA's is small)."""
    return variant.endpoint.trainer.strategy == "megatron" and variant.endpoint.full_fine_tune


def colocated_sampling(variant: ResolvedVariant) -> bool:
    """A workload that samples with vLLM on the trainer's devices: the optimizer may stay there between steps."""
    return vllm_on_skyrl_train(variant) and variant.endpoint.placement.colocate_all


def has_pr_setting(key: str) -> Callable[[SkyrlRules], bool]:
    return lambda version: key in version.engine_settings


KNOBS: tuple[Knob, ...] = (
    Knob(
        "request-count cap",
        # PR #1874's EngineConfig field: the forward_backward set is cut into calls of at most N requests
        {CAP: "forward_backward_max_request_count"},
        where=ENGINE_CONFIG,
        versions=has_pr_setting(CAP),
        version_label=PR_SETTING_LABEL,
        without={CAP: None},
    ),
    Knob(
        "cap-aware padding",
        # PR #1874 pads a call's rows to min(rows, micro) instead of micro, always (its description: no setting)
        {CAP_AWARE: DERIVED},
        where=PR_CODE,
        versions=has_pr_setting(CAP_AWARE),
        version_label=PR_SETTING_LABEL,
        without={CAP_AWARE: False},
    ),
    # train/config/config.py: TrainerConfig
    Knob(
        "micro batch",
        {"trainer.micro_train_batch_size_per_gpu": "trainer.micro_train_batch_size_per_gpu"},
        values=micro_sizes,
        monotone=True,
    ),
    Knob(
        "token budget",
        {"trainer.max_tokens_per_microbatch": "trainer.max_tokens_per_microbatch"},
        values=token_budgets,
    ),
    Knob(
        "microbatch padding",
        {"trainer.remove_microbatch_padding": "trainer.remove_microbatch_padding"},
        values=packing,
    ),
    # train/config/config.py: MegatronConfig.transformer_config_kwargs (DEFAULT_TRANSFORMER_CONFIG_KWARGS)
    Knob(
        "recompute",
        RECOMPUTE_KEYS,
        values=recompute_choices,
        monotone=True,
        to_skyrl=recompute_in_skyrl,
    ),
    # MegatronConfig.tensor_model_parallel_size; DP is the policy's GPUs / (TP x PP x CP), and the Megatron worker
    # turns sequence parallel on whenever TP > 1 (workers/megatron/megatron_worker.py: provider.sequence_parallel)
    Knob(
        "parallelism",
        {
            "parallelism.tp": MEGATRON + "tensor_model_parallel_size",
            "parallelism.dp": DERIVED,
            "parallelism.sequence_parallel": DERIVED,
        },
        values=tp_splits,
        applies=lambda variant: variant.endpoint.trainer.strategy == "megatron",
    ),
    # The trainer's own memory levers (docs/fsdp.md, docs/full-fine-tuning.md). train/config/config.py: FSDPConfig
    # (cpu_offload, reshard_after_forward), DEFAULT_OPTIMIZER_CONFIG_KWARGS (optimizer_cpu_offload, megatron-core's
    # OptimizerConfig), OptimizerConfig.offload_after_step (the colocated optimizer between steps)
    Knob(
        "FSDP CPU offload",
        {"trainer.fsdp.cpu_offload": "trainer.policy.fsdp_config.cpu_offload"},
        values=both_ways("trainer.fsdp.cpu_offload"),
        applies=on_fsdp,
    ),
    Knob(
        "FSDP reshard after forward",
        {"trainer.fsdp.reshard_after_forward": "trainer.policy.fsdp_config.reshard_after_forward"},
        values=both_ways("trainer.fsdp.reshard_after_forward"),
        applies=on_fsdp,
    ),
    Knob(
        "optimizer on the host",
        {"trainer.optimizer_offload": MEGATRON + "optimizer_config_kwargs.optimizer_cpu_offload"},
        values=both_ways("trainer.optimizer_offload"),
        applies=megatron_full_fine_tune,
    ),
    Knob(
        "optimizer offload after step",
        {"trainer.offload_after_step": "trainer.policy.optimizer_config.offload_after_step"},
        values=both_ways("trainer.offload_after_step"),
        applies=colocated_sampling,
    ),
    # backends/jax.py: JaxBackendConfig.sample_max_num_sequences; tinker/engine.py: find_batchable_sample applies it
    # only when the backend is jax (SkyRL-Train's samples are not capped by it)
    Knob(
        "sample batch",
        {"engine.sample_max_num_sequences": "sample_max_num_sequences"},
        where=JAX_BACKEND_CONFIG,
        values=sample_batches,
        applies=lambda variant: samples(variant) and not on_skyrl_train(variant),
    ),
    # train/config/config.py: InferenceEngineConfig
    Knob(
        "vLLM memory",
        {"inference.gpu_memory_utilization": INFERENCE_ENGINE + "gpu_memory_utilization"},
        values=utilizations,
        applies=vllm_on_skyrl_train,
    ),
    # The time model prices every vLLM step's kernel launches one by one (``vllm_step_cost.StepReference``), graphs or
    # not, while it does price what graphs cost (their capture at the start, their pools on every sleep and wake): so
    # eager mode only ever looks faster there. It is recommended only when no configuration with graphs passes.
    Knob(
        "CUDA graphs",
        {"inference.enforce_eager": INFERENCE_ENGINE + "enforce_eager"},
        values=cuda_graphs,
        applies=graphs_settable,
        unpriced_cost=EAGER_COST,
        unpriced=lambda key, value: value is True,
    ),
    Knob(
        "vLLM batch",
        {"inference.max_num_seqs": INFERENCE_ENGINE + "max_num_seqs"},
        values=batch_sizes,
        applies=vllm_on_skyrl_train,
    ),
    # InferenceEngineConfig.offload_kv_for_weight_sync (PR #1934: in 0.4.0, not at the seed's revision)
    Knob(
        "KV cache in a sync",
        {"inference.offload_kv_for_weight_sync": INFERENCE_ENGINE + "offload_kv_for_weight_sync"},
        versions=lambda version: version.offload_kv_for_weight_sync,
        without={"inference.offload_kv_for_weight_sync": False},
        values=kv_offloads,
        applies=separate_full_weight_sync,
    ),
    # train/config/config.py: PlacementConfig.colocate_all (default true, 0.4.0 and the PR's base alike)
    Knob(
        "placement",
        {"placement.colocate_all": "trainer.placement.colocate_all"},
        device_cost="vLLM on devices of its own: num_engines x tensor_parallel_size more devices beside the trainer's",
        adds_devices=lambda key, value: value is False,
        values=placements,
        applies=vllm_on_skyrl_train,
    ),
)
"""Every knob, in the order ``advise`` searches them."""

MODELLING: dict[str, str] = {
    "engine.sampling": "the simulator's sampling mode, not a SkyRL setting: SkyRL decides it from trainer.strategy and "
    "placement.colocate_all (continuous on SkyRL-Train, forwarded around the engine when colocate_all is false, "
    "serial on JAX; serial on SkyRL-Train only with the environment variable SKYRL_TINKER_CONTINUOUS_SAMPLING=0)",
    "engine.iteration_sleep_s": "not a SkyRL setting: SkyRL's engine sleeps a fixed 0.1 s between iterations "
    "(tinker/engine.py)",
    "engine.poll_interval_s": "not a SkyRL setting: SkyRL's result poller checks every 50 ms (tinker/api.py)",
    "inference.sleep_level": "not a SkyRL setting: SkyRL chooses each sleep's level from LoRA and the weight-sync mode",
}
"""Endpoint keys that are the simulator's modelling choices, not settings an operator has on SkyRL: never searched,
and labelled wherever they are swept or set."""

BY_KEY: dict[str, Knob] = {key: knob for knob in KNOBS for key in knob.skyrl_keys}


def knob_of(key: str) -> Knob | None:
    """The knob an endpoint key (``engine.x`` or ``endpoint.engine.x``) belongs to, or None."""
    return BY_KEY.get(dotted_endpoint_key(key))


def label(key: str, version: str) -> str:
    """What an output must say beside ``key`` on SkyRL ``version``: that the version lacks it, that it is no SkyRL
    setting at all (``MODELLING``), or that SkyRL pins the vLLM (``inference.vllm_version``); empty otherwise."""
    key = dotted_endpoint_key(key)
    if key in MODELLING:
        return MODELLING[key]
    if key == "inference.vllm_version":
        return PIN_LABEL
    knob = BY_KEY.get(key)
    if knob is not None and not knob.available(version):
        return f"{knob.version_label}; SkyRL {version} has no such setting"
    return ""


def modelling_notes(endpoint: Endpoint) -> list[str]:
    """One line per ``MODELLING`` key an endpoint sets to other than its default (``engine.sampling: serial``): the
    run models something that is no SkyRL setting (``check`` and ``run`` print it under the variant); and one when
    its ``inference.vllm_version`` is not the vLLM its SkyRL revision pins (``vllm_versions.pin_note``)."""
    pinned = pin_note(endpoint.skyrl_version, endpoint.inference.vllm_version)
    notes = [pinned] if pinned else []
    for key, text in MODELLING.items():
        section, name = key.split(".")
        part = getattr(endpoint, section)
        value = getattr(part, name)
        if value != type(part).model_fields[name].default:
            notes.append(f"{key}={value}: {text}")
    return notes


VLLM_STARTERS = frozenset({"sample", "save_weights_for_sampler"})
"""The requests that start vLLM on SkyRL-Train (a weight sync starts it lazily; a sample needs it)."""


def idle_vllm_notes(variant: ResolvedVariant) -> list[str]:
    """One line per ``inference.*`` key the variant or ``--set`` gives when no vLLM runs in the run: the endpoint's
    trainer has none (JAX), or the workload never starts it (no sample, no weight sync). The setting then changes
    nothing, which ``run`` and ``check`` say rather than pass it in silence."""
    given = {**variant.scenario.variants[variant.variant_name].set, **variant.overrides}
    keys = sorted(k for k in map(dotted_endpoint_key, given) if k.startswith("inference."))
    if not keys:
        return []
    endpoint = variant.endpoint
    if not endpoint.runs_vllm:
        why = f"trainer.strategy {endpoint.trainer.strategy} samples without vLLM"
    elif not variant.request_types() & VLLM_STARTERS:
        why = "the workload has no sample or save_weights_for_sampler request, so vLLM never starts"
    else:
        return []
    return [f"{key}: changes nothing in this run: {why}" for key in keys]


def skyrl_key_text(key: str) -> str:
    """``key``'s SkyRL key for a line of text: the key, ``derived by SkyRL`` or ``no SkyRL key``."""
    knob = knob_of(key)
    if knob is None:
        return "no SkyRL key"
    skyrl = knob.skyrl_keys[dotted_endpoint_key(key)]
    return skyrl if skyrl != DERIVED else ("no key: " + knob.where if knob.where == PR_CODE else "derived by SkyRL")


def unpriced_changes(changed: dict[str, Any]) -> dict[str, str]:
    """Each changed setting (endpoint key -> its new value) whose new value has a cost the time model does not price,
    with that cost in words (the knob's ``unpriced_cost``)."""
    out = {}
    for key, value in changed.items():
        knob = knob_of(key)
        if knob is not None and knob.unpriced(dotted_endpoint_key(key), value):
            out[key] = knob.unpriced_cost
    return out


def devices_needed(endpoint: Endpoint) -> int:
    """The devices a deployment of ``endpoint`` needs: the trainer's, plus vLLM's own when it does not share them
    (SkyRL's placement group: ``num_engines x tensor_parallel_size`` GPU bundles for the engines when
    ``colocate_all`` is false; colocated, the engines run on the trainer's devices)."""
    inference = endpoint.inference
    extra = 0 if endpoint.placement.colocate_all else inference.num_engines * inference.tensor_parallel_size
    return endpoint.hardware.devices + extra


def skyrl_settings(changes: dict[str, Any], version: str) -> list[dict[str, Any]]:
    """The SkyRL settings that make ``changes`` (endpoint key -> value): one row per endpoint key, with its SkyRL
    key(s) and value(s), where it is written, and its label on ``version``."""
    rows = []
    for key, value in changes.items():
        knob = knob_of(key)
        rows.append(
            {
                "key": key,
                "value": value,
                "skyrl": knob.skyrl_settings(dotted_endpoint_key(key), value) if knob is not None else {},
                "where": knob.where if knob is not None else "",
                "label": label(key, version) if knob is not None else "not a knob: no SkyRL key is known for it",
            }
        )
    return rows


def searchable(knob: Knob, version: str, mode: str) -> bool:
    """Whether ``advise`` may change ``knob`` on ``version``: ``version`` (the default) only what the version has;
    ``released`` only what some SkyRL release has (and the version too); ``what-if`` anything, labelled."""
    if mode == "what-if":
        return True
    if mode == "released":
        return knob.released and knob.available(version)
    return knob.available(version)


def held_off(knobs: Sequence[Knob], version: str, mode: str) -> list[Knob]:
    """The knobs ``advise`` must hold at their ``without`` values on ``version`` in ``mode``."""
    return [k for k in knobs if k.without and not searchable(k, version, mode)]

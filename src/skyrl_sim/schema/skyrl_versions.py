"""SkyRL versions as data: the one table of which rule each modelled SkyRL revision uses.

An endpoint names its SkyRL (``skyrl_version``); the memory walk, the time model, the shapes, the LoRA target list
and the schema's checks read the version's ``SkyrlRules`` from ``VERSIONS`` and never test the version's name. Each
row below was read from SkyRL's code at that revision (``docs/skyrl-versions.md`` cites the files):

* ``pr1874``: the base of SkyRL PR #1874 (NovaSky-AI/SkyRL ``e17527a1``), plus the PR's two engine settings (the
  request-count cap and cap-aware padding). The PR was closed unmerged: that revision with those settings was never
  released. The seed's endpoints model it.
* ``0.4.0``: the ``skyrl==0.4.0`` wheel, the newest release. The PR's settings are not in it; they stay available on
  it as a what-if, and every output that shows, recommends or sweeps them says so (``PR_SETTING_LABEL``).

Some rules are equal in both revisions (the unchunked log-prob for a sequence no longer than the chunk, the dummy
rows under token batching, ``empty_cuda_cache``); they are rows of the table all the same, so the documentation shows
them and a later version can change them here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

SkyrlVersion = Literal["0.4.0", "pr1874"]
DEFAULT_VERSION: SkyrlVersion = "0.4.0"
"""What an endpoint that names no version models: the newest release."""

PR_SETTINGS: tuple[str, ...] = ("engine.forward_backward_max_request_count", "engine.cap_aware_padding")
"""The endpoint keys PR #1874 adds: in no SkyRL release."""
PR_SETTING_LABEL = "not in any SkyRL release (PR #1874)"
"""How every output marks a PR setting shown, recommended or swept on a version that lacks it."""
ASSUMED = "assumed:"
"""How a run's note starts when it names something the endpoint left out (``Endpoint.assumptions``)."""
ALLOCATOR_NOTE = "allocator:"
"""How a run's note starts when it says what the training workers' caching allocator did to reserved memory."""

LORA_TARGETS_MEGATRON_4 = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_TARGETS_WITH_GDN = (*LORA_TARGETS_MEGATRON_4, "in_proj", "out_proj")

LOSS_FNS_PR1874 = ("cross_entropy", "importance_sampling", "ppo", "cispo")
LOSS_FNS_0_4_0 = ("cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "dppo")


@dataclass(frozen=True)
class SkyrlRules:
    """Which rule one SkyRL revision uses, rule by rule (the fields are the table's rows)."""

    version: str
    source: str
    released: bool
    engine_settings: tuple[str, ...]
    """Endpoint keys of the engine this revision has beyond those every version has (PR #1874's)."""
    logprob_backward: Literal["list_concat", "preallocated_buffer"]
    """``ChunkedDistributedLogprob.backward``: each chunk's fp32 gradient kept in a list and concatenated (two full
    ``[B, S, V/TP]`` fp32 tensors at its end), or streamed into one preallocated buffer (PR #1806)."""
    unchunked_logprob_when_short: bool
    """``from_parallel_logits_to_logprobs`` takes the unchunked ``DistributedLogprob`` when the sequence is no longer
    than ``logprobs_chunk_size`` (it saves the fp32 softmax instead of the logits)."""
    entropy: Literal["unchunked", "chunked_by_memory"]
    """The RL path's entropy metric over the action logits: ``vocab_parallel_entropy`` over all of them at once, or in
    sequence chunks sized by ``vocab_entropy_chunk_memory_mb``."""
    lora_all_linear: tuple[str, ...]
    """What ``target_modules: all-linear`` becomes on Megatron."""
    gdn_in_proj_safety_check: bool
    """``gdn_in_proj_lora_is_safe`` drops ``in_proj`` from all-linear where the HF checkpoint fuses it."""
    token_batching_pads_rows: bool
    """``_pad_microbatch_to_size``: under token batching every micro-batch is padded with one-token dummy rows to
    the largest micro-batch's row count."""
    empty_cuda_cache: bool
    """``MegatronConfig.empty_cuda_cache`` (default true): ``torch.cuda.empty_cache()`` after every forward and
    forward_backward, so the caching allocator's reserve falls back to what stays allocated."""
    loss_fns: tuple[str, ...]
    """The Tinker API's ``loss_fn`` values for a policy model (``ppo_critic`` is for critic models only)."""
    fused_lm_head_backends: tuple[str, ...]
    """``trainer.fused_lm_head_logprob_backend`` values (empty: no such setting)."""
    trainer_expandable_segments: bool
    """``TrainerConfig.use_expandable_segments``'s default: the training workers switch PyTorch's expandable segments
    on after the model is loaded (``Worker._set_expandable_segments``, SkyRL PR #1768), so the caching allocator's
    segments grow in pages; false: the classic allocator, fixed segments that fragment."""
    inference_expandable_segments: bool
    """``InferenceEngineConfig.use_expandable_segments``'s default: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
    on vLLM's engine actors (``build_engine_runtime_env``)."""
    offload_kv_for_weight_sync: bool = False
    """``generator.inference_engine.offload_kv_for_weight_sync`` exists (PR #1934): engines on their own GPUs sleep
    for a full-weight sync, so the KV cache is not on the device while the broadcast's buffers are."""
    checkpoint_sleeps_engines: bool = False
    """``save_checkpoint`` and ``load_checkpoint`` (the Tinker API's ``save_weights`` and ``load_weights``) sleep
    colocated engines before the dispatch backloads the trainer (PR #2065); before, the backload ran beside awake
    engines."""
    fp8_weight_sync: bool = False
    """``InferenceEngineConfig.fp8_weight_sync_mode`` is modelled for this revision (``train/config/config.py``,
    ``weight_sync/fp8/``): the only way a full-weight sync reaches an FP8 vLLM; false: that revision's FP8 weight sync
    was not read, so such a sync is refused rather than guessed."""


VERSIONS: dict[str, SkyrlRules] = {
    "pr1874": SkyrlRules(
        version="pr1874",
        source="NovaSky-AI/SkyRL e17527a1 (the base of PR #1874) with the PR's two engine settings",
        released=False,
        engine_settings=PR_SETTINGS,
        logprob_backward="list_concat",
        unchunked_logprob_when_short=True,
        entropy="unchunked",
        lora_all_linear=LORA_TARGETS_MEGATRON_4,
        gdn_in_proj_safety_check=False,
        token_batching_pads_rows=True,
        empty_cuda_cache=True,
        loss_fns=LOSS_FNS_PR1874,
        fused_lm_head_backends=(),
        trainer_expandable_segments=True,
        inference_expandable_segments=False,
        offload_kv_for_weight_sync=False,
        checkpoint_sleeps_engines=False,
        fp8_weight_sync=False,
    ),
    "0.4.0": SkyrlRules(
        version="0.4.0",
        source="skyrl==0.4.0 (PyPI wheel)",
        released=True,
        engine_settings=(),
        logprob_backward="preallocated_buffer",
        unchunked_logprob_when_short=True,
        entropy="chunked_by_memory",
        lora_all_linear=LORA_TARGETS_WITH_GDN,
        gdn_in_proj_safety_check=True,
        token_batching_pads_rows=True,
        empty_cuda_cache=True,
        loss_fns=LOSS_FNS_0_4_0,
        fused_lm_head_backends=("torch", "triton"),
        trainer_expandable_segments=True,
        inference_expandable_segments=False,
        offload_kv_for_weight_sync=True,
        checkpoint_sleeps_engines=True,
        fp8_weight_sync=True,
    ),
}


def rules(version: str) -> SkyrlRules:
    """The rules of ``version`` (a ``SkyrlVersion``; the schema has already refused any other name)."""
    return VERSIONS[version]


def has_setting(version: str, key: str) -> bool:
    """Whether ``key`` (a dotted endpoint key) is a setting of ``version``: every key is, except a PR #1874 setting
    on a version that lacks it."""
    return key not in PR_SETTINGS or key in rules(version).engine_settings


def setting_label(version: str, key: str) -> str:
    """The label an output puts beside ``key`` on ``version``: ``PR_SETTING_LABEL`` for a PR #1874 setting the
    version lacks, else empty."""
    return "" if has_setting(version, key) else PR_SETTING_LABEL


def labelled(version: str, key: str) -> str:
    """``key`` with its label in parentheses when it has one (for a line of text)."""
    label = setting_label(version, key)
    return f"{key} ({label})" if label else key


def pr_settings_in_use(version: str, engine: object) -> list[str]:
    """The PR #1874 settings an endpoint's ``engine`` section turns on although ``version`` lacks them (a cap set,
    cap-aware padding true): what ``check`` and the JSON label."""
    used = []
    if getattr(engine, "forward_backward_max_request_count", None) is not None:
        used.append(PR_SETTINGS[0])
    if getattr(engine, "cap_aware_padding", False):
        used.append(PR_SETTINGS[1])
    return [key for key in used if not has_setting(version, key)]


def table_rows() -> list[tuple[str, dict[str, str]]]:
    """The table as text, rule by rule: (rule, {version: value}) in field order (``skyrl-sim versions``, the docs)."""
    out = []
    for f in fields(SkyrlRules):
        if f.name in ("version", "source"):
            continue
        values = {}
        for name, version in VERSIONS.items():
            value = getattr(version, f.name)
            values[name] = ", ".join(value) if isinstance(value, tuple) else str(value).lower()
            if isinstance(value, tuple) and not value:
                values[name] = "none"
        out.append((f.name, values))
    return out


def lora_target_modules(targets: list[str] | str, version: SkyrlRules, fused_gdn_in_proj: bool) -> frozenset[str]:
    """The module names LoRA wraps on Megatron. ``all-linear`` is the version's list (``lora_all_linear``), without
    ``in_proj`` where the version runs ``gdn_in_proj_lora_is_safe`` and the model's HF checkpoint fuses the
    gated-DeltaNet input projection (``in_proj_qkvz`` / ``in_proj_ba``, Qwen3-Next); a list is taken as written (SkyRL
    passes it to Megatron-Bridge unchanged)."""
    if isinstance(targets, str):
        names = set(version.lora_all_linear)
        if version.gdn_in_proj_safety_check and fused_gdn_in_proj:
            names.discard("in_proj")
        return frozenset(names)
    return frozenset(targets)


def pr_setting_notes(version: str, engine: object) -> list[str]:
    """One line per PR #1874 setting an endpoint turns on although its SkyRL ``version`` lacks it: the note a
    RunResult carries and ``check`` prints."""
    return [
        f"{key}: {PR_SETTING_LABEL}; SkyRL {version} has no such setting, so this run is a what-if"
        for key in pr_settings_in_use(version, engine)
    ]


def dotted_endpoint_key(key: str) -> str:
    """An override's endpoint key without its optional ``endpoint.`` prefix (``--set endpoint.engine.x``)."""
    return key[len("endpoint.") :] if key.startswith("endpoint.") else key


def version_notes(notes: list[str]) -> list[str]:
    """The notes of a RunResult that ``run`` and ``check`` print: those that label a PR #1874 setting
    (``pr_setting_notes``), name what the endpoint left out (``Endpoint.assumptions``) or say what the allocator did
    (``ALLOCATOR_NOTE``)."""
    return [note for note in notes if PR_SETTING_LABEL in note or note.startswith((ASSUMED, ALLOCATOR_NOTE))]


ENTROPY_PEAK_FACTOR = 4
"""``_resolve_vocab_entropy_chunk_size``'s ``peak_factor``: the chunk budget is divided by four chunk copies."""


def entropy_chunk_tokens(
    rule: str, chunk_size: int | None, chunk_memory_mb: int, rows: int, actions: Any, vocab: int, element_bytes: int
) -> Any:
    """Tokens per chunk of ``vocab_parallel_entropy`` over ``actions`` action positions of ``rows`` rows (all of them
    when it takes them at once), for a version's ``entropy`` rule: ``unchunked``, or ``chunked_by_memory`` as
    ``_resolve_vocab_entropy_chunk_size`` sizes it (``vocab_entropy_chunk_size``: None one chunk, > 0 that many
    tokens, 0 from ``vocab_entropy_chunk_memory_mb``: the largest power of two whose four copies fit the budget).
    Plain comparisons only, so the memory walk's lanes (an array of widths) can decide it lane by lane."""
    if rule == "unchunked" or chunk_size is None:
        return actions
    if chunk_size > 0:
        return chunk_size if chunk_size < actions else actions
    per_token = rows * vocab * element_bytes * ENTROPY_PEAK_FACTOR
    fits = max(1, min(actions, chunk_memory_mb * (1 << 20) // per_token))
    auto = 1 << (int(fits).bit_length() - 1)
    return auto if auto < actions else actions

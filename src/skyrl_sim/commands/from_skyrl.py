"""``skyrl-sim endpoints from-skyrl``: an endpoint file from what an operator passes to SkyRL's Tinker API server.

SkyRL's server takes ``--base-model``, ``--backend`` (``fsdp`` or ``megatron`` for SkyRL-Train) and ``--backend-config``,
a JSON object of dotted overrides of SkyRL-Train's config (``trainer.micro_train_batch_size_per_gpu``,
``trainer.placement.colocate_all``, ...) plus the backend's own fields (``strategy``, ``runtime_role``, ...). This
command reads the same three (the base model as a local Hugging Face ``config.json``) and the GPUs, and writes the
endpoint that SkyRL would run:

* every key of ``--backend-config`` is either **mapped** (``MAPPED``: its endpoint key and value are named in the
  report) or **not mapped** (``UNMAPPED`` gives the reason for keys SkyRL has but the endpoint does not model yet;
  any other key is reported as unknown). No key is dropped silently;
* what the config leaves out is SkyRL's default, not skyrl-sim's: ``SKYRL_DEFAULTS`` (SkyRL-Train's
  ``TrainerConfig`` and what the Tinker backend forces: LoRA alpha 32 from the API, sequence parallel when TP > 1,
  full uniform recompute with gradient checkpointing, Megatron-Bridge's fp32 output);
* full fine-tuning is SkyRL's ``trainer.policy.model.lora.rank: 0`` (or ``--lora-rank 0``: a client that creates its
  model without LoRA): the endpoint's ``trainer.train_base_weights``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from skyrl_sim.engine.pipeline import VIRTUAL_STAGES_KEY
from skyrl_sim.errors import ScenarioError, UserError
from skyrl_sim.schema.architecture import resolve_model
from skyrl_sim.schema.documents import load_json_file, parse_json, validation_error
from skyrl_sim.schema.endpoint import Endpoint
from skyrl_sim.schema.limits import MAX_TOKENS
from skyrl_sim.schema.model_fit import check_fit
from skyrl_sim.schema.overrides import apply_override
from skyrl_sim.schema.skyrl_versions import DEFAULT_VERSION
from skyrl_sim.schema.tinker_sdk import TINKER_LORA_RANK

DEFAULT_GPU = "h200"
"""The card when ``--gpu`` is not given (the report says so: it is skyrl-sim's choice, not the launch's)."""

MEGATRON = "trainer.policy.megatron_config."
LORA = "trainer.policy.model.lora."


def _same(value: Any) -> Any:
    return value


def _chunk(value: Any) -> Any:
    """``logprobs_chunk_size: null`` is SkyRL's "never chunk": one chunk as long as any sequence."""
    return MAX_TOKENS if value is None else value


def _recompute(value: Any) -> Any:
    """``gradient_checkpointing``: SkyRL's default transformer config recomputes every layer in full, or nothing."""
    return {"granularity": "full", "method": "uniform", "num_layers": 1} if value else {"granularity": "none"}


def _dtype(value: Any) -> Any:
    """``fsdp_config.mixed_precision``'s dtype names (``fsdp_utils.py``: ``PrecisionType``) as the endpoint's."""
    names = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "16": "fp16", 16: "fp16"}
    names |= {"fp32": "fp32", "float32": "fp32", "32": "fp32", 32: "fp32"}
    return names.get(value, value)


def _flash(value: Any) -> Any:
    """``trainer.flash_attn``: flash-attention 2, or SDPA (its flash or memory-efficient kernel): neither keeps
    anything quadratic in the sequence, so both are the endpoint's ``flash`` kernel (a padding mask is the walk's)."""
    return "flash"


ENGINE = "generator.inference_engine."
INIT_KWARGS = "engine_init_kwargs"
"""SkyRL's pass-through of vLLM engine arguments (a mapping); each argument is mapped or reported on its own."""
FSDP = "trainer.policy.fsdp_config."
INFERENCE_KEYS = (
    "num_engines",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "enforce_eager",
    "model_dtype",
    "offload_kv_for_weight_sync",
    "weight_transfer_threshold_cuda_ipc_GB",
    "use_expandable_segments",
    "fully_sharded_loras",
    "language_model_only",
)
"""SkyRL's ``InferenceEngineConfig`` fields that the endpoint's ``inference`` section has under the same name."""

STRATEGIES = ("fsdp", "megatron")
"""What SkyRL-Train's backend asserts ``strategy`` is (``skyrl_train_backend._build_skyrl_train_config``)."""

MAPPED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "strategy": ("trainer.strategy", _same),
    "trainer.micro_train_batch_size_per_gpu": ("trainer.micro_train_batch_size_per_gpu", _same),
    "trainer.micro_forward_batch_size_per_gpu": ("trainer.micro_forward_batch_size_per_gpu", _same),
    "trainer.max_tokens_per_microbatch": ("trainer.max_tokens_per_microbatch", _same),
    "trainer.remove_microbatch_padding": ("trainer.remove_microbatch_padding", _same),
    "trainer.logprobs_chunk_size": ("trainer.logprobs_chunk_size", _chunk),
    "trainer.vocab_entropy_chunk_size": ("trainer.vocab_entropy_chunk_size", _same),
    "trainer.vocab_entropy_chunk_memory_mb": ("trainer.vocab_entropy_chunk_memory_mb", _same),
    "trainer.fused_lm_head_logprob": ("trainer.fused_lm_head_logprob", _same),
    "trainer.fused_lm_head_logprob_backend": ("trainer.fused_lm_head_logprob_backend", _same),
    "trainer.gradient_checkpointing": ("trainer.recompute", _recompute),
    "trainer.use_expandable_segments": ("trainer.use_expandable_segments", _same),
    "trainer.policy.language_model_only": ("trainer.language_model_only", _same),
    MEGATRON + "tensor_model_parallel_size": ("parallelism.tp", _same),
    MEGATRON + "pipeline_model_parallel_size": ("parallelism.pp", _same),
    MEGATRON + "context_parallel_size": ("parallelism.cp", _same),
    MEGATRON + "expert_model_parallel_size": ("parallelism.ep", _same),
    MEGATRON + "empty_cuda_cache": ("trainer.empty_cuda_cache", _same),
    LORA + "rank": ("lora.rank", _same),
    LORA + "alpha": ("lora.alpha", _same),
    LORA + "target_modules": ("lora.targets", _same),
    MEGATRON + "lora_config.merge_lora": ("lora.merge_lora", _same),
    LORA + "max_loras": ("inference.max_loras", _same),
    LORA + "max_cpu_loras": ("inference.max_cpu_loras", _same),
    "trainer.placement.colocate_all": ("placement.colocate_all", _same),
    "trainer.flash_attn": ("trainer.attention", _flash),
    "trainer.policy.optimizer_config.offload_after_step": ("trainer.offload_after_step", _same),
    MEGATRON + "ddp_config.grad_reduce_in_fp32": ("trainer.grad_reduce_in_fp32", _same),
    MEGATRON + "optimizer_config_kwargs.optimizer_cpu_offload": ("trainer.optimizer_offload", _same),
    FSDP + "cpu_offload": ("trainer.fsdp.cpu_offload", _same),
    FSDP + "reshard_after_forward": ("trainer.fsdp.reshard_after_forward", _same),
    FSDP + "mixed_precision.param_dtype": ("trainer.params_dtype", _dtype),
    FSDP + "mixed_precision.reduce_dtype": ("trainer.fsdp.reduce_dtype", _dtype),
    **{ENGINE + key: ("inference." + key, _same) for key in INFERENCE_KEYS},
    # vLLM's --quantization, which SkyRL passes through to the engine (InferenceEngineConfig.engine_init_kwargs)
    ENGINE + INIT_KWARGS + ".quantization": ("inference.quantization", _same),
}
"""SkyRL key -> (endpoint key, how its value is read)."""

PLACEMENT = ("trainer.placement.policy_num_nodes", "trainer.placement.policy_num_gpus_per_node")
"""The policy's devices: nodes x GPUs per node (``hardware.devices``; ``--gpus`` when not given)."""

UNMAPPED: dict[str, str] = {
    ENGINE + INIT_KWARGS + ".": "a vLLM engine argument passed through engine_init_kwargs that the endpoint's inference "
    "section does not model (only quantization is mapped from there)",
    FSDP + "fsdp_size": "hybrid sharding (a group smaller than the data-parallel ranks) is not modelled: FSDP shards "
    "over every rank",
    FSDP + "wrap_policy": "the units modelled are SkyRL's default ones (each decoder layer, the input embedding, the "
    "root)",
    FSDP + "mixed_precision.buffer_dtype": "buffers are not counted apart from the parameters",
    "trainer.strategy": (
        "SkyRL overwrites it with the backend's strategy (--backend, or the config's `strategy` key): "
        "_build_skyrl_train_config sets trainer.strategy = overrides.strategy"
    ),
    "trainer.placement.colocate_policy_ref": "no reference model is modelled",
    "trainer.placement.critic_num_nodes": "no critic model is modelled",
    "trainer.placement.critic_num_gpus_per_node": "no critic model is modelled",
    "trainer.critic.model.path": "no critic model is modelled",
    "generator.": "not modelled by the endpoint's inference section (its vLLM settings are mapped one by one)",
    "keep_runtime_warm_on_last_unload": "the runtime's lifetime across unloads is not modelled",
    "runtime_role": "the service's process roles are not modelled",
    "trainer.algorithm.": "a request's loss (loss_fn, loss_fn_config) is the workload's, not the endpoint's",
}
"""Keys (or prefixes ending in ``.``) of SkyRL's config that the endpoint does not model, with why."""

SKYRL_DEFAULTS: dict[str, Any] = {
    "trainer.micro_train_batch_size_per_gpu": 1,
    "trainer.micro_forward_batch_size_per_gpu": 1,
    "trainer.max_tokens_per_microbatch": -1,
    "trainer.remove_microbatch_padding": True,
    "trainer.logprobs_chunk_size": 1024,
    "trainer.recompute": {"granularity": "full", "method": "uniform", "num_layers": 1},
    "trainer.language_model_only": False,
    "trainer.fused_lm_head_logprob": False,
    "trainer.fp32_output": True,
    "trainer.params_dtype": "bf16",
    "trainer.layer_spec": "transformer_engine",
    "lora.alpha": 32,
    "lora.targets": "all-linear",
}
"""SkyRL-Train's defaults as the Tinker backend applies them, for the keys the config leaves out."""


@dataclass
class Conversion:
    """An endpoint made from a SkyRL launch, with the report of every key: mapped or not, and why."""

    endpoint: dict[str, Any]
    mapped: list[tuple[str, Any, str, Any]] = field(default_factory=list)  # (SkyRL key, value, endpoint key, value)
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)  # (SkyRL key, value, reason)
    defaults: list[str] = field(default_factory=list)  # endpoint keys set from SkyRL's defaults
    assumed: list[str] = field(default_factory=list)  # what neither the launch nor the flags say: skyrl-sim's choice

    notes: list[str] = field(default_factory=list)  # what the launch does that the flags alone do not say
    base_dir: Path = field(default_factory=lambda: Path("."))  # what a relative model.config is relative to

    def report(self) -> list[str]:
        lines = [
            f"mapped  {shown(key)} = {shown(repr(value))} -> {target} = {shown(repr(converted))}"
            for key, value, target, converted in self.mapped
        ]
        lines += [f"default {target} (SkyRL's, the config does not set it)" for target in self.defaults]
        lines += [f"ASSUMED {what}" for what in self.assumed]
        lines += [f"NOT MAPPED {shown(key)} = {shown(repr(value))}: {reason}" for key, value, reason in self.unmapped]
        lines += [f"note    {note}" for note in self.notes]
        return lines


SHOWN_CHARS = 120
"""How much of a key or value the report echoes: a config is the user's, and a 3 MiB value is no report line."""


def shown(text: str) -> str:
    """``text`` cut to ``SHOWN_CHARS`` characters, saying how long it was."""
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


def unmapped_reason(key: str) -> str:
    """Why a SkyRL key is not mapped (an unknown key: say so, so a typo is seen)."""
    for known, reason in UNMAPPED.items():
        if key == known or (known.endswith(".") and key.startswith(known)):
            return reason
    return "not a key skyrl-sim knows (a SkyRL-Train setting the endpoint does not model, or a typo)"


def _expand_init_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``generator.inference_engine.engine_init_kwargs`` (a mapping of vLLM engine arguments) as one dotted key per
    argument, so each is mapped (``quantization``) or reported with its reason like any other key."""
    key = ENGINE + INIT_KWARGS
    kwargs = config.get(key)
    if not isinstance(kwargs, dict):
        return config
    expanded = {k: v for k, v in config.items() if k != key}
    expanded.update({f"{key}.{name}": value for name, value in kwargs.items()})
    return expanded


def parse_backend_config(text: str) -> dict[str, Any]:
    """``--backend-config``: a JSON object as SkyRL's server reads it, or the path of a JSON file holding one. Both go
    through the documents loader, with a scenario file's limits and messages (size, UTF-8, nesting, NaN)."""
    try:
        if text.lstrip(" \t\r\n").startswith("{"):
            config = parse_json(text, "--backend-config", refuse_duplicates=True)
        else:
            config = load_json_file(Path(text), role="the --backend-config file", refuse_duplicates=True)
    except ScenarioError as exc:
        where = "--backend-config" if exc.path == "--backend-config" else f"--backend-config {shown(exc.path)}"
        raise UserError(f"{where}: {exc.reason}") from None
    if not isinstance(config, dict):
        raise UserError("--backend-config: must be a JSON object of dotted keys")
    return config


def convert(
    base_model: str,
    backend: str,
    config: dict[str, Any],
    gpus: int | None,
    gpu: str | None = None,
    device_memory_gib: float | None = None,
    lora_rank: int = TINKER_LORA_RANK,
    name: str | None = None,
    skyrl_version: str = DEFAULT_VERSION,
    relative_to: Path | None = None,
) -> Conversion:
    """The endpoint of a SkyRL launch (see the module docstring); raises ``UserError`` naming the flag or key.
    ``relative_to``: the folder the endpoint file is written in; ``model.config`` is written relative to it, so the
    file (and the config beside it) can be committed and used on another machine (default: an absolute path)."""
    if backend not in STRATEGIES:
        raise UserError(f"--backend {backend}: from-skyrl reads the SkyRL-Train backends (fsdp, megatron)")
    strategy = config.get("strategy", backend)
    if strategy not in STRATEGIES:  # SkyRL asserts it before it builds anything
        raise UserError(
            f"--backend-config: strategy = {shown(repr(strategy))}: SkyRL-Train runs only fsdp or megatron "
            "(_build_skyrl_train_config asserts it)"
        )
    model_path = Path(base_model)
    if model_path.is_dir():
        model_path = model_path / "config.json"
    if not model_path.is_file():
        raise UserError(f"--base-model {base_model}: give a local Hugging Face config.json (or its folder)")
    hardware: dict[str, Any] = {"profile": gpu or DEFAULT_GPU}
    if device_memory_gib is not None:  # else the profile's: what PyTorch reports on that card
        hardware["device_memory_gib"] = device_memory_gib
    base_dir = relative_to.resolve() if relative_to is not None else Path(".").resolve()
    config_path = model_path.resolve()
    written = os.path.relpath(config_path, base_dir) if relative_to is not None else str(config_path)
    endpoint: dict[str, Any] = {
        "name": name or f"{model_path.parent.name or 'model'}-{strategy}",
        "description": f"from SkyRL's launch: --base-model {shown(base_model)} --backend {backend} --backend-config "
        "(mapped)",
        "skyrl_version": skyrl_version,
        "model": {"config": written},
        "hardware": hardware,
        "parallelism": {},
        "lora": {"rank": lora_rank or TINKER_LORA_RANK},
        "trainer": {"strategy": strategy, **({"train_base_weights": True} if lora_rank == 0 else {})},
    }
    out = Conversion(endpoint, base_dir=base_dir)
    if gpu is None:
        out.assumed.append(f"hardware.profile = {DEFAULT_GPU} (skyrl-sim's: --gpu not given)")
    if strategy != backend:
        out.notes.append(
            f"the config's strategy = {strategy!r} replaces --backend {backend}'s: SkyRL runs {strategy} "
            f"({'Megatron' if backend == 'megatron' else 'FSDP'}BackendOverrides.strategy is only the default)"
        )
    placement = {key: config[key] for key in PLACEMENT if key in config}
    config = _expand_init_kwargs(config)
    for key, value in config.items():
        if key == MEGATRON + VIRTUAL_STAGES_KEY and value not in (None, 1):
            raise UserError(
                f"--backend-config: {key} = {value!r}: the interleaved pipeline schedule (virtual stages) is not "
                "modelled; the memory walk models megatron-core's 1F1B schedule without virtual stages (leave it unset "
                "or 1)"
            )
        if key in PLACEMENT:
            out.mapped.append((key, value, "hardware.devices", None))
            continue
        if key == LORA + "rank" and value == 0:  # SkyRL's LoRA off: every weight trains
            out.endpoint = apply_override(out.endpoint, "trainer.train_base_weights", True, "--backend-config")
            out.mapped.append((key, value, "trainer.train_base_weights", True))
            continue
        if key in MAPPED:
            target, read = MAPPED[key]
            converted = read(value)
            out.endpoint = apply_override(out.endpoint, target, converted, "--backend-config")
            out.mapped.append((key, value, target, converted))
        else:
            out.unmapped.append((key, value, unmapped_reason(key)))
    devices = gpus
    if placement:
        nodes = placement.get(PLACEMENT[0], 1)
        per_node = placement.get(PLACEMENT[1], 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (nodes, per_node)):
            raise UserError("--backend-config: trainer.placement.policy_num_nodes and _gpus_per_node must be positive")
        devices = nodes * per_node
        out.mapped = [(k, v, t, devices if t == "hardware.devices" else c) for k, v, t, c in out.mapped]
    if devices is None:
        raise UserError("--gpus N: how many GPUs the trainer uses (or trainer.placement.policy_num_gpus_per_node)")
    out.endpoint["hardware"]["devices"] = devices
    _fill_defaults(out)
    _split(out, devices)
    return out


def _fill_defaults(out: Conversion) -> None:
    """SkyRL's defaults for the keys neither the config nor the flags set."""
    for target, value in SKYRL_DEFAULTS.items():
        section, key = target.split(".", 1)
        if key not in out.endpoint.setdefault(section, {}):
            out.endpoint = apply_override(out.endpoint, target, value, "SkyRL's default")
            out.defaults.append(target)


PARALLEL_KEYS = {
    "tp": MEGATRON + "tensor_model_parallel_size",
    "pp": MEGATRON + "pipeline_model_parallel_size",
    "cp": MEGATRON + "context_parallel_size",
}
"""The SkyRL keys of the model-parallel sizes the devices are divided by."""


def _split(out: Conversion, devices: int) -> None:
    """Data parallelism is what the model-parallel sizes leave of the devices; sequence parallel follows TP (SkyRL
    sets it when TP > 1); FSDP shards over every device (TP 1)."""
    p = out.endpoint["parallelism"]
    for short, key in PARALLEL_KEYS.items():  # checked before the arithmetic below; the schema checks the rest
        size = p.get(short, 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UserError(f"--backend-config: {key} must be a positive integer, not {shown(repr(size))}")
    model_parallel = p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1)
    if devices % model_parallel:
        raise UserError(
            f"--backend-config: tensor x pipeline x context parallel = {model_parallel} does not divide the {devices} GPUs"
        )
    p["dp"] = devices // model_parallel
    p["sequence_parallel"] = p.get("tp", 1) > 1


FLAG_OF_KEY = {
    "hardware.devices": "--gpus (or the config's trainer.placement.policy_num_nodes x _gpus_per_node)",
    "hardware.device_memory_gib": "--device-memory-gib",
    "hardware.profile": "--gpu",
    "lora.rank": "--lora-rank",
    "name": "--name",
    "skyrl_version": "--skyrl-version",
}
"""The endpoint keys a flag of from-skyrl sets, so an error names the flag the user gave."""


def _named(error: ScenarioError) -> UserError:
    """An error of the written endpoint, against the flag that set its key when one did."""
    flag = FLAG_OF_KEY.get(error.key)
    if flag is None and error.key in ("", "hardware"):  # an error of the whole section names its key in its reason
        flag = next((f for key, f in FLAG_OF_KEY.items() if key in error.reason), None)
    if flag is None:
        return ScenarioError("from-skyrl", error.key, error.reason)
    return UserError(f"{flag}: {error.reason} (the endpoint's {error.key})")


def validated(out: Conversion) -> Endpoint:
    """The endpoint, checked as any endpoint file is (and against its model); an error names the flag or the
    --backend-config key that set the value when it can."""
    try:
        endpoint = Endpoint.model_validate(out.endpoint)
    except ValidationError as exc:
        raise _named(validation_error("from-skyrl", "", exc)) from None
    try:
        model = resolve_model(endpoint.model, out.base_dir)
        check_fit(endpoint, model)
    except ValueError as exc:
        raise UserError(f"--base-model: {exc}") from None
    except ScenarioError as exc:
        raise _named(exc) from None
    return endpoint

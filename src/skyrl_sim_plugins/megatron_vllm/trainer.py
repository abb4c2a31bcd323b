"""One LoRA model on one rank: its forward_backward / forward over a call's micro-batches, Adam, and weight export.

``forward_backward`` runs megatron-core's ``get_forward_backward_func`` over the micro-batches ``batch.py`` built
from the call's shape. Per micro-batch: the model runs over ``[mbs, S_mb]`` with an explicit causal mask (none for
the flash attention, which masks causally itself), the logits ``[mbs, S_mb, V/tp]`` are re-expanded to the global
width S (fp32 when ``trainer.fp32_output``), log-probs come from megatron's vocab-parallel cross-entropy in chunks of
``logprobs_chunk_size`` positions, and the loss is ``cross_entropy`` with weights and sum reduction
(``calculate_per_token_loss`` keeps the schedule from averaging), or an RL loss on SkyRL's RL path (``rl_loss``:
``importance_sampling`` or ``ppo`` over each datum's sampling log-probs and advantages, summed the same way, and the
entropy metric over the action positions). With ``trainer.fused_lm_head_logprob`` the output
layer hands the hidden states through instead, upcast (``fp32_output``) and re-expanded as SkyRL does, and the
log-probs come from ``fused_lm_head.FusedLinearLogprob`` (never the full logits).
Gradients accumulate in the adapters across calls until ``optim_step`` (Adam on the adapters only, lr per step;
``adapter_optimizer`` holds the gradient buffers, master weights and moments a 16-bit or fp32 adapter needs). They
are allocated when the model is built and zeroed, never freed, afterwards (as Megatron's DDP keeps one persistent
gradient buffer): every call holds them, the first included, which is what the simulator's memory walk counts.
Under pipeline parallelism the rank holds one stage (``pipeline_stage``): the schedule is megatron-core's 1F1B, the
loss and log-probs run on the last stage only, and a stage that fails finishes its schedule with stand-ins
(``pipeline_stage.StageContainment``) so no stage waits on it.
An MoE model's passes may replay recorded routes (``route_replay``: each micro-batch's ids and router padding mask
installed before its forward, the replay state scoped to the call's schedule).
A call that fails (an OOM) restores the gradients it had when it started (``snapshot_grads``, taken by the worker
outside the memory meter: bookkeeping of this backend, not of the modelled trainer), so a failed request leaves no
trace.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from skyrl_sim.api import CallShape, Endpoint, ModelArch
from skyrl_sim_plugins.megatron_vllm.adapter_optimizer import AdapterOptimizer
from skyrl_sim_plugins.megatron_vllm.batch import MicroBatchTensors, build_microbatches
from skyrl_sim_plugins.megatron_vllm.cpu_shims import device_scope
from skyrl_sim_plugins.megatron_vllm.full_optimizer import FullOptimizer
from skyrl_sim_plugins.megatron_vllm.fused_lm_head import fused_logprobs, recover_left_padding, skip_output_projection
from skyrl_sim_plugins.megatron_vllm.lora import attach_lora, merged_state_dict
from skyrl_sim_plugins.megatron_vllm.model_builder import build_gpt_model, params_dtype
from skyrl_sim_plugins.megatron_vllm.pipeline_stage import StageContainment, StageFailureHooks, stage_of, to_global
from skyrl_sim_plugins.megatron_vllm.rl_loss import fused_entropy, masked_mean, policy_loss, vocab_parallel_entropy
from skyrl_sim_plugins.megatron_vllm.route_replay import RouteReplay


def causal_mask(width: int, device: torch.device) -> torch.Tensor:
    """Megatron's boolean attention mask, True = masked (shim 3: the default one is built on cuda)."""
    return torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1).view(1, 1, width, width)


@dataclass(frozen=True)
class RouteSetup:
    """One call's routed-expert replay: each datum's recorded routes (None: record instead), the call's real rows
    (later rows are pad rows), and whether to report the ids the routers used."""

    routes: list[Any] | None
    rows: int
    watch: bool


@dataclass
class CallResult:
    """What one pass gives on this rank: per-row outputs of its real rows and the call's loss sums."""

    rows: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    total_loss: float = 0.0
    num_tokens: float = 0.0
    entropy: list[float] = field(default_factory=list)  # the RL path: each real micro-batch's entropy metric
    routes: dict[int, Any] = field(default_factory=dict)  # with ``watch_routes``: the ids each real row's routers used


class LoraModel:
    """The frozen base GPTModel shard with the live adapter and its Adam state (every model id of the worker runs
    on it; the adapter store swaps the live adapter between them)."""

    def __init__(self, arch: ModelArch, endpoint: Endpoint, seed: int, max_sequence_length: int) -> None:
        from megatron.core import parallel_state

        self.arch = arch
        self.endpoint = endpoint
        self.seed = seed
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        # this rank's pipeline stage (None without one): its layers, the embedding on the first, the head on the last
        self.stage = stage_of(arch.num_layers, pp, parallel_state.get_pipeline_model_parallel_rank()) if pp > 1 else None
        self.last_stage = self.stage is None or self.stage.last
        self.dtype = params_dtype(endpoint.trainer.params_dtype)
        self.model = build_gpt_model(
            arch,
            seed,
            self.dtype,
            max_sequence_length,
            endpoint.trainer.recompute,
            endpoint.trainer.attention_kernel,
            self.stage,
            route_replay=arch.moe is not None and endpoint.trainer.routed_expert_replay != "off",
        )
        adapter_dtype = params_dtype(endpoint.lora.dtype or endpoint.trainer.params_dtype)
        targets = endpoint.adapted_targets(arch)
        whole_model_name = partial(to_global, stage=self.stage)  # a stage's layers seeded as the model's
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        local_experts = arch.moe.num_experts // endpoint.parallelism.ep if arch.moe is not None else 0
        self.full = endpoint.full_fine_tune  # every weight trains: megatron-core's DDP and distributed optimizer
        self.adapters: list[torch.nn.Parameter] = []
        if not self.full:
            self.adapters = attach_lora(
                self.model,
                endpoint.lora,
                targets,
                self.tp,
                self.tp_rank,
                seed,
                adapter_dtype,
                whole_model_name,
                ep_rank * local_experts,
            )
        # expert adapters: under expert parallelism each data-parallel rank holds other experts' (``optim_step``)
        expert_params = {id(p) for n, p in self.model.named_parameters() if ".local_experts." in n}
        self.expert_adapter = [id(p) in expert_params for p in self.adapters]
        self.fused_head = endpoint.trainer.fused_lm_head_logprob
        self.output_weight = skip_output_projection(self.model) if self.fused_head and self.last_stage else None
        if endpoint.trainer.recompute.granularity != "none" and (self.stage is None or self.stage.first):
            # megatron's reentrant recompute only back-propagates when its input requires grad; with frozen
            # embeddings it would not, and the adapters would get no gradient (PEFT's enable_input_require_grads)
            self.model.embedding.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
        layout = endpoint.trainer.routed_expert_replay
        # an MoE model whose routers replay recorded routes (``route_replay``); None: dense, or replay off
        self.route_replay = (
            RouteReplay(self.model, arch, all_layers=layout == "int32-all-layers")
            if arch.moe is not None and layout != "off"
            else None
        )
        self.optimizer: AdapterOptimizer | FullOptimizer
        self.schedule_model: torch.nn.Module = self.model  # what megatron's schedule runs (DDP-wrapped when full)
        if self.full:
            self.optimizer = FullOptimizer(self.model, endpoint.trainer.grad_reduce_in_fp32)
            self.schedule_model = self.optimizer.ddp
        else:
            self.optimizer = AdapterOptimizer(self.adapters)
        self.device = next(self.model.parameters()).device
        self._grad_backup = [torch.empty_like(g) for g in self.optimizer.grads]
        self._has_snapshot = False

    def snapshot_grads(self) -> None:
        """Copy the gradients into the snapshot buffers; a failing ``run_pass`` restores them from there."""
        with torch.no_grad():
            for backup, grad in zip(self._grad_backup, self.optimizer.grads, strict=True):
                backup.copy_(grad)
        self._has_snapshot = True

    def _restore_grads(self) -> None:
        if not self._has_snapshot:
            return
        with torch.no_grad():
            for backup, grad in zip(self._grad_backup, self.optimizer.grads, strict=True):
                grad.copy_(backup)
            if self.optimizer.mixed or self.full:
                for p in self.adapters or list(self.model.parameters()):  # a gradient the failure left before its hook
                    p.grad = None

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this model keeps on the device between calls: parameters (the base and the live adapter),
        gradients, master weights, Adam state. The adapter store's host slots are not among them."""
        return [p for p in self.model.parameters()] + self.optimizer.held_tensors()  # DDP's buffer once when full

    def adapter_state(self) -> list[torch.Tensor]:
        """The live adapter's state, each storage once: the LoRA parameters, then their gradient buffers, master
        copies and Adam fields (what an adapter swap copies in and out, ``adapter_store.AdapterStore``)."""
        state: list[torch.Tensor] = []
        seen: set[int] = set()
        if self.full:  # one model, no adapters to swap (SkyRL's full fine-tuning is single-tenant)
            return state
        for tensor in [*self.adapters, *self.optimizer.held_tensors()]:
            if tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                state.append(tensor)
        return state

    # ------------------------------------------------------------------ passes

    def _forward_step(
        self,
        result: CallResult,
        loss: dict[str, Any] | None,
        replay: RouteSetup | None,
        data_iterator: Any,
        model: torch.nn.Module,
    ) -> Any:
        mb: MicroBatchTensors = next(data_iterator)
        tokens = mb.tokens.to(self.device)
        mbs, width = tokens.shape
        router: dict[str, Any] = {}
        if replay is not None and replay.routes is not None:  # R3: this micro-batch's ids to the routers
            assert self.route_replay is not None
            router["padding_mask"] = self.route_replay.install(mb, replay.routes, replay.rows)
        positions = torch.arange(width, device=self.device).unsqueeze(0).expand(mbs, width)
        # the flash module masks causally itself (is_causal): no [S_mb, S_mb] mask tensor
        mask = causal_mask(width, self.device) if self.endpoint.trainer.attention_kernel == "unfused" else None
        logits = model(tokens, positions, mask, **router)  # [mbs, S_mb, V/tp]; the fused head: [mbs, S_mb, h]
        # (a pipeline stage before the last: its output [S_mb, mbs, h], sent on; megatron calls no loss there)
        if replay is not None:
            assert self.route_replay is not None
            if replay.watch:
                result.routes.update(self.route_replay.used(mb.row_index, mb.lengths, width))
            if replay.routes is not None:
                self.route_replay.after_forward()
        if self.fused_head and self.last_stage:
            if self.endpoint.trainer.fp32_output:
                logits = logits.float()  # Megatron-Bridge's Float16Module upcast of the model's output
            logits = recover_left_padding(logits, mb.lengths, mb.global_width)  # [mbs, S, h]
        return logits, partial(self._loss, result, mb, loss)

    def _logprobs(
        self, mb: MicroBatchTensors, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target log-probs ``[mbs, S]``: megatron's vocab-parallel cross-entropy over the re-expanded logits (also
        returned: an RL loss takes its entropy over them)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        trainer = self.endpoint.trainer
        mbs, _, vocab_local = logits.shape
        width = mb.global_width
        out_dtype = torch.float32 if trainer.fp32_output else logits.dtype
        full = logits.new_zeros(mbs, width, vocab_local, dtype=out_dtype)  # re-expanded to the global width S
        for r, n in enumerate(mb.lengths):
            full[r, width - n :] = logits[r, :n].to(out_dtype)
        chunk = trainer.logprobs_chunk_size
        # megatron's vocab-parallel cross-entropy works in place on its input: each chunk gets its own copy
        pieces = [
            -vocab_parallel_cross_entropy(full[:, s : s + chunk].clone(), targets[:, s : s + chunk])
            for s in range(0, width, chunk)
        ]
        return torch.cat(pieces, dim=1), full

    def _loss(
        self, result: CallResult, mb: MicroBatchTensors, rl: dict[str, Any] | None, logits: torch.Tensor
    ) -> tuple[Any, ...]:
        width = mb.global_width
        targets = mb.targets.to(self.device)
        full = None
        if self.fused_head:
            assert self.output_weight is not None
            logprobs = fused_logprobs(logits, self.output_weight, targets, self.endpoint.trainer.logprobs_chunk_size)
        else:
            logprobs, full = self._logprobs(mb, logits, targets)  # [mbs, S], the re-expanded logits
            if rl is None:
                full = None  # cross-entropy reads them no more: freed here, as the walk frees them
        weights = mb.loss_mask.to(self.device)
        if rl is None:
            elementwise = -logprobs * weights
            loss = elementwise.sum()
        else:
            loss, elementwise = self._rl_loss(result, mb, rl, logits, full, logprobs, weights)
        num_tokens = weights.sum()
        lp, el = logprobs.detach().float().cpu(), elementwise.detach().float().cpu()
        for r, (index, n) in enumerate(zip(mb.row_index, mb.lengths, strict=True)):
            if index >= 0 and weights[r].any():
                span = slice(width - n, width - 1)
                result.rows[index] = {"logprobs": lp[r, span].tolist(), "elementwise_loss": el[r, span].tolist()}
        result.total_loss += float(loss.detach())
        result.num_tokens += float(num_tokens.detach())
        return loss, num_tokens.to(torch.int), {"loss": loss.detach().clone()}

    def _rl_loss(
        self,
        result: CallResult,
        mb: MicroBatchTensors,
        rl: dict[str, Any],
        logits: torch.Tensor,
        full: torch.Tensor | None,
        logprobs: torch.Tensor,
        weights: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SkyRL's RL path (``rl_loss``): the entropy metric over the action positions (while the logits are still
        referenced), then the policy loss over the micro-batch's sampling log-probs and advantages."""
        from megatron.core import parallel_state

        trainer = self.endpoint.trainer
        group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        if self.fused_head:
            assert self.output_weight is not None
            entropy = fused_entropy(logits, self.output_weight, group, trainer.logprobs_chunk_size)
        else:
            assert full is not None
            rule = self.endpoint.rules.entropy
            chunk_mb = trainer.vocab_entropy_chunk_memory_mb
            entropy = vocab_parallel_entropy(full, group, rule, trainer.vocab_entropy_chunk_size, chunk_mb)
        actions = entropy.shape[1]
        if mb.row_index and max(mb.row_index) >= 0:  # a dummy micro-batch's metric is left out, as SkyRL does
            result.entropy.append(float(masked_mean(entropy, weights[:, :actions])))
        zeros = torch.zeros_like(weights)
        sampling = mb.sampling_logprobs.to(self.device) if mb.sampling_logprobs is not None else zeros
        advantages = mb.advantages.to(self.device) if mb.advantages is not None else zeros
        return policy_loss(rl["loss_fn"], logprobs, sampling, advantages, weights, dict(rl.get("config") or {}))

    def _containment(self, batches: list[MicroBatchTensors], hooks: StageFailureHooks | None) -> StageContainment:
        """A failure on this pipeline stage, kept from blocking the others (``pipeline_stage.StageContainment``):
        stand-ins of each micro-batch's real shape, the worker's hooks for the site and the lifted limit."""
        hooks = hooks or StageFailureHooks()
        return StageContainment(
            lambda i: tuple(batches[i].tokens.shape),  # type: ignore[arg-type,return-value]
            self.arch.hidden_size,
            self.dtype,
            hooks.on_fail,
            hooks.lift_limit,
        )

    def run_pass(
        self,
        shape: CallShape,
        datum_lengths: list[int],
        forward_only: bool,
        rl: dict[str, Any] | None = None,
        stage_failure: StageFailureHooks | None = None,
        routes: list[Any] | None = None,
        watch_routes: bool = False,
    ) -> CallResult:
        """One forward_backward (or forward) call over this rank's micro-batches; ``rl``: SkyRL's RL path, with the
        loss (``loss_fn``, ``config``) and each datum's sampling log-probs and advantages (``inputs``).
        ``stage_failure``: what the worker does when this pipeline stage fails (see ``StageFailureHooks``). ``routes``:
        an MoE model's recorded routes per datum (``route_replay``; ignored with replay off); ``watch_routes``: report
        the ids the routers used per row (``CallResult.routes``), recording them where no routes are given."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        trainer = self.endpoint.trainer
        batches = build_microbatches(
            shape,
            datum_lengths,
            self.seed,
            self.arch.vocab_size,
            self.dp_rank,
            self.dp,
            self.tp,
            trainer.max_tokens_per_microbatch,
            [tuple(pair) for pair in rl["inputs"]] if rl is not None else None,  # type: ignore[misc]
        )
        result = CallResult()
        self.model.train(not forward_only)
        containment = self._containment(batches, stage_failure) if self.stage is not None else None
        replay = None
        if self.route_replay is not None and (routes is not None or watch_routes):
            replay = RouteSetup(routes, shape.rows, watch_routes)
        try:
            with device_scope(), torch.set_grad_enabled(not forward_only), self._route_scope(replay):
                with containment.installed() if containment is not None else contextlib.nullcontext():
                    get_forward_backward_func()(
                        forward_step_func=partial(self._forward_step, result, rl if not forward_only else None, replay),
                        data_iterator=iter(batches),
                        model=[self.schedule_model],
                        num_microbatches=len(batches),
                        seq_length=shape.width,
                        micro_batch_size=max(len(b.lengths) for b in batches),
                        forward_only=forward_only,
                    )
                if containment is not None:
                    containment.agree()  # raises this stage's failure, or PeerStageFailed
        except BaseException:
            self._restore_grads()
            raise
        finally:
            self._has_snapshot = False
            del batches
            gc.collect()
        return result

    @contextlib.contextmanager
    def _route_scope(self, replay: RouteSetup | None) -> Iterator[None]:
        """The replay state scoped to this schedule (``RouteReplay.schedule``); recording when only watched."""
        if self.route_replay is None or replay is None:
            yield
            return
        with self.route_replay.schedule(True):
            if replay.routes is None:
                self.route_replay.record()
            yield

    def optim_step(self, learning_rate: float) -> dict[str, float]:
        """Adam on the adapters with this step's learning rate (DP: gradients summed across replicas first; an
        expert's adapter across the ranks that hold that expert)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.full:  # the DDP buffer was reduce-scattered by the schedule (finalize_model_grads)
            self.optimizer.step(learning_rate)
            return {"learning_rate:mean": learning_rate}
        if self.dp > 1:
            group = parallel_state.get_data_parallel_group()
            # an expert's replicas are the ranks of its expert-data-parallel group (DP / EP of them), not all of DP
            expert_group = parallel_state.get_expert_data_parallel_group()
            expert_replicas = dist.get_world_size(expert_group)
            for grad, expert in zip(self.optimizer.grads, self.expert_adapter, strict=True):
                if not expert:
                    dist.all_reduce(grad, group=group)
                elif expert_replicas > 1:
                    dist.all_reduce(grad, group=expert_group)
        self.optimizer.step(learning_rate)  # the gradient buffers stay allocated (see the module docstring)
        return {"learning_rate:mean": learning_rate}

    def merged_shard(self) -> dict[str, torch.Tensor]:
        """This rank's parameters with LoRA merged, on CPU, under their names in the whole model (for the HF
        checkpoint; a pipeline stage's layers renamed from their stage-local index)."""
        return {to_global(k, self.stage): v.detach().to("cpu") for k, v in merged_state_dict(self.model).items()}

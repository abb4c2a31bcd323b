"""SkyRL's FSDP trainer on one rank: the Hugging Face model under torch FSDP2, with peft LoRA or every weight trained.

Built as SkyRL 0.4.0's FSDP worker builds it (``workers/fsdp/fsdp_worker.py``: ``FSDPPolicyWorkerBase.init_model``;
``workers/model_wrapper.py``: ``HFModelWrapper``; ``distributed/fsdp_strategy.py``: ``FSDPStrategy``;
``distributed/fsdp_utils.py``: ``apply_fsdp2``):

- transformers' ``LlamaForCausalLM`` of the architecture (the same seeded weights as the Megatron workers and the
  checkpoint vLLM serves: ``hf_export.init_hf_weights``), loaded in fp32 (``bf16=inference_only_init``), SDPA
  attention (``flash_attn`` needs CUDA), ``use_cache`` off;
- LoRA (``lora.rank``; not with ``trainer.train_base_weights``): ``enable_input_require_grads`` and peft's
  ``get_peft_model`` (task CAUSAL_LM, no dropout, no bias, ``lora.targets`` as Hugging Face module names);
- gradient checkpointing (``trainer.recompute`` not ``none``) without reentrancy, before sharding;
- ``fully_shard`` on each decoder layer, on the input embedding when the embeddings are not tied, then on the root,
  over a one-dimensional ``fsdp`` mesh of the data-parallel ranks (gloo on CPU), with
  ``MixedPrecisionPolicy(param_dtype=trainer.params_dtype, reduce_dtype=fsdp.reduce_dtype,
  cast_forward_inputs=True)``, ``reshard_after_forward`` and, with ``fsdp.cpu_offload``, ``CPUOffloadPolicy``;
- ``torch.optim.AdamW`` over every parameter (betas 0.9/0.999, weight decay 0.01; lr per step);
  ``optimizer.zero_grad()`` after each step (the gradients are freed: set to None, as SkyRL's ``optimizer_step``).

A call (``run_pass``): the rows of each micro-batch left-padded to the call's global width with an attention mask
(SkyRL's FSDP worker trims nothing: ``skyrl_train_backend.py`` pads every row of a call to its longest,
``worker.py``: ``SampleBasedBatchIterator`` slices rows), the position ids from the mask, the logits divided by the
temperature in place, the target log-probs from ``logprobs_from_logits`` (on CPU its ``logprobs_from_logits_v2``:
fp32 logits: a gather and a per-row ``logsumexp``; 16-bit: a per-row ``log_softmax``), the entropy metric under
``no_grad`` in chunks of ``logprobs_chunk_size`` positions (``chunked_entropy_from_logits``; forward_backward only),
and the loss over ``log_probs[:, -num_actions - 1 : -1]``: cross-entropy summed over the weighted targets (scaled by
the DP size, as the worker corrects FSDP's gradient averaging), or an RL loss (``rl_loss.policy_loss``).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.nn.functional as F

from skyrl_sim.api import CallShape, Endpoint, ModelArch
from skyrl_sim_plugins.megatron_vllm.batch import MicroBatchTensors, build_microbatches
from skyrl_sim_plugins.megatron_vllm.hf_export import init_hf_weights, rms_norm_eps, rope_theta
from skyrl_sim_plugins.megatron_vllm.model_builder import params_dtype
from skyrl_sim_plugins.megatron_vllm.rl_loss import masked_mean, policy_loss
from skyrl_sim_plugins.megatron_vllm.trainer import CallResult

HF_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""Hugging Face module names of the endpoint's LoRA targets (``all-linear``: peft's own expansion)."""
TEMPERATURE = 1.0  # SkyRL's algorithm.temperature default: the logits are divided by it in place


def hf_config(arch: ModelArch) -> Any:
    """transformers' ``LlamaConfig`` of the architecture (the layout ``hf_export`` writes for vLLM)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        rms_norm_eps=rms_norm_eps(arch),
        rope_theta=rope_theta(arch),
        tie_word_embeddings=arch.tied_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        max_position_embeddings=int(arch.extra.get("max_position_embeddings", 32768)),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return config


def logprobs_from_logits_v2(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """SkyRL's ``utils/torch_utils.py``: ``logprobs_from_logits_v2`` (what ``logprobs_from_logits`` runs off CUDA)."""
    if logits.dtype in (torch.float32, torch.float64):
        logits_labels = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        logsumexp_values = torch.stack([torch.logsumexp(logit, dim=-1) for logit in logits])
        return logits_labels - logsumexp_values
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):
        row_logprobs = F.log_softmax(row_logits, dim=-1)
        rows.append(row_logprobs.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def chunked_entropy_from_logits(logits: torch.Tensor, attention_mask: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """SkyRL's ``chunked_entropy_from_logits`` without grad (``entropy_requires_grad``: ``use_entropy_loss``, false)."""
    with torch.no_grad():
        entropy = torch.zeros((logits.shape[0], logits.shape[1]), dtype=logits.dtype, device=logits.device)
        for start in range(0, logits.size(1), chunk_size):
            chunk = logits[:, start : start + chunk_size]
            chunk_logprob = F.log_softmax(chunk, dim=-1)
            chunk_probs = chunk_logprob.exp()
            chunk_entropy = -(chunk_probs * chunk_logprob).sum(-1)
            entropy[:, start : start + chunk_size] = chunk_entropy
        return entropy * attention_mask


class FsdpModel:
    """The rank's FSDP2-sharded Hugging Face model, its AdamW, and one call's passes (see the module docstring)."""

    stage = None  # no pipeline stages under FSDP

    def __init__(self, arch: ModelArch, endpoint: Endpoint, seed: int, max_sequence_length: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import LlamaForCausalLM

        self.arch, self.endpoint, self.seed = arch, endpoint, seed
        self.dp = dist.get_world_size()
        self.dp_rank = dist.get_rank()
        trainer = endpoint.trainer
        self.dtype = params_dtype(trainer.params_dtype)
        model = LlamaForCausalLM(hf_config(arch))
        model.load_state_dict(init_hf_weights(arch, seed), strict=False)  # tied: no lm_head.weight of its own
        model.config.use_cache = False
        self.lora = not endpoint.full_fine_tune
        if self.lora:
            from peft import LoraConfig, TaskType, get_peft_model

            model.enable_input_require_grads()
            torch.manual_seed(seed)  # peft's kaiming init of lora_A: the same adapter on every rank
            config = LoraConfig(
                task_type=TaskType.CAUSAL_LM,
                r=endpoint.lora.rank,
                lora_alpha=endpoint.lora.alpha,
                target_modules=self._target_modules(),
                lora_dropout=0.0,
                bias="none",
                init_lora_weights=True,
            )
            model = get_peft_model(model, config)
        if trainer.recompute.granularity != "none":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mesh = init_device_mesh("cpu", (self.dp,), mesh_dim_names=("fsdp",))
        reduce = params_dtype(trainer.fsdp.reduce_dtype)
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=reduce, cast_forward_inputs=True),
            "reshard_after_forward": trainer.fsdp.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy(pin_memory=False) if trainer.fsdp.cpu_offload else None,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        layer_class = "LlamaDecoderLayer"  # the model's _no_split_modules (apply_fsdp2's default wrap policy)
        units = [
            m
            for m in model.modules()
            if type(m).__name__ == layer_class or (isinstance(m, torch.nn.Embedding) and not arch.tied_embeddings)
        ]
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=1e-2)
        self._grad_backup: list[torch.Tensor | None] = []
        self._has_snapshot = False

    def _target_modules(self) -> str | list[str]:
        targets = self.endpoint.lora.targets
        if targets == "all-linear":
            return "all-linear"
        return [name for target in targets for name in HF_TARGETS.get(target, ())]

    # ------------------------------------------------------------------ state

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def held_tensors(self) -> list[torch.Tensor]:
        """What the rank keeps between calls: every parameter's local shard, the gradients that exist, the AdamW
        moments (``DTensor`` local tensors, each storage once in the meter)."""
        held: list[torch.Tensor] = []
        for p in self.model.parameters():
            held.append(_local(p))
            if p.grad is not None:
                held.append(_local(p.grad))
        for state in self.optimizer.state.values():
            held += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    def adapter_state(self) -> list[torch.Tensor]:
        """No adapter store under FSDP (SkyRL swaps adapters on Megatron only): an empty live state."""
        return []

    def snapshot_grads(self) -> None:
        """The gradients as they are before a call (None where none exist), to restore them if it fails."""
        with torch.no_grad():
            self._grad_backup = [None if p.grad is None else p.grad.detach().clone() for p in self.trainable()]
        self._has_snapshot = True

    def _restore_grads(self) -> None:
        """After a failed call: FSDP2's iteration state reset from the root (``FSDPState._reset_iter_state``: every
        unit resharded, the post-backward callback no longer marked as queued, in-flight reductions dropped; without it
        the next backward never reshards at its end) and the gradients as they were (FSDP may have replaced a
        parameter's gradient mid-backward): this backend's bookkeeping, so a failed request leaves no trace, as on the
        Megatron workers."""
        self.model._get_fsdp_state()._reset_iter_state()
        if not self._has_snapshot:
            return
        for p, backup in zip(self.trainable(), self._grad_backup, strict=True):
            p.grad = backup
        self._grad_backup = []

    # ------------------------------------------------------------------ passes

    def run_pass(
        self,
        shape: CallShape,
        datum_lengths: list[int],
        forward_only: bool,
        rl: dict[str, Any] | None = None,
        stage_failure: Any = None,
        routes: list[Any] | None = None,
        watch_routes: bool = False,
    ) -> CallResult:
        """One forward_backward (or forward) call over this rank's micro-batches (see the module docstring)."""
        trainer = self.endpoint.trainer
        batches = build_microbatches(
            shape,
            datum_lengths,
            self.seed,
            self.arch.vocab_size,
            self.dp_rank,
            self.dp,
            1,
            trainer.max_tokens_per_microbatch,
            [tuple(pair) for pair in rl["inputs"]] if rl is not None else None,  # type: ignore[misc]
        )
        result = CallResult()
        self.model.train(not forward_only)
        try:
            with torch.set_grad_enabled(not forward_only):
                for mb in batches:
                    self._microbatch(result, mb, rl if not forward_only else None, forward_only)
        except BaseException:
            self._restore_grads()
            raise
        finally:
            self._has_snapshot = False
            del batches
            gc.collect()
        return result

    def _microbatch(
        self, result: CallResult, mb: MicroBatchTensors, rl: dict[str, Any] | None, forward_only: bool
    ) -> None:
        width = mb.global_width
        rows = len(mb.lengths)
        sequences = torch.zeros(rows, width, dtype=torch.long)  # left-padded to the call's width, as SkyRL pads
        attention_mask = torch.zeros(rows, width, dtype=torch.long)
        for r, n in enumerate(mb.lengths):
            sequences[r, width - n :] = mb.tokens[r, :n]
            attention_mask[r, width - n :] = 1
        position_ids = attention_mask.cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        rolled = torch.roll(sequences, shifts=-1, dims=1)
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        logits = output["logits"]
        logits.div_(TEMPERATURE)
        log_probs = logprobs_from_logits_v2(logits, rolled)
        entropy = None
        if not forward_only:
            entropy = chunked_entropy_from_logits(logits, attention_mask, self.endpoint.trainer.logprobs_chunk_size)
        del logits  # the worker's ``output`` keeps them until its micro-batch returns (``_forward_backward_micro``)
        num_actions = width - 1  # the longest datum's targets: the call's width less the appended last target
        actions = log_probs[:, -num_actions - 1 : -1]
        weights = mb.loss_mask[:, width - 1 - num_actions : width - 1]
        if rl is None:
            loss = -(actions * weights).sum()
            elementwise = -actions * weights
        else:
            zeros = torch.zeros_like(weights)
            span = slice(width - 1 - num_actions, width - 1)
            sampling = mb.sampling_logprobs[:, span] if mb.sampling_logprobs is not None else zeros
            advantages = mb.advantages[:, span] if mb.advantages is not None else zeros
            config = dict(rl.get("config") or {})
            loss, elementwise = policy_loss(rl["loss_fn"], actions, sampling, advantages, weights, config)
            if entropy is not None and mb.row_index and max(mb.row_index) >= 0:
                result.entropy.append(float(masked_mean(entropy[:, -num_actions - 1 : -1], weights)))
        if not forward_only:
            (loss * self.dp).backward()  # the worker's grad_sum_correction_factor: FSDP averages over DP
        lp, el = actions.detach().float(), elementwise.detach().float()
        for r, (index, n) in enumerate(zip(mb.row_index, mb.lengths, strict=True)):
            if index >= 0 and weights[r].any():
                span_r = slice(num_actions - (n - 1), num_actions)
                result.rows[index] = {"logprobs": lp[r, span_r].tolist(), "elementwise_loss": el[r, span_r].tolist()}
        result.total_loss += float(loss.detach())
        result.num_tokens += float(weights.sum())
        del output  # released with the micro-batch, as SkyRL's worker releases it

    def optim_step(self, learning_rate: float) -> dict[str, float]:
        """AdamW with this step's learning rate (the gradients were reduce-scattered by FSDP in backward), then
        ``zero_grad()``: the gradients are freed until the next backward makes them."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        self.optimizer.step()
        self.optimizer.zero_grad()
        return {"learning_rate:mean": learning_rate}

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The full Hugging Face state dict with LoRA merged (every rank takes part in the gathers; rank 0's is
        written), for the checkpoint vLLM serves."""
        full: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            full[name] = _full(param).detach().to("cpu", torch.float32)
        if not self.lora:
            return {name: value for name, value in full.items()}
        scale = self.endpoint.lora.alpha / self.endpoint.lora.rank
        merged: dict[str, torch.Tensor] = {}
        for name, value in full.items():
            if ".lora_" in name:
                continue
            clean = name.replace("base_model.model.", "").replace(".base_layer", "")
            prefix = name.removesuffix(".base_layer.weight")
            a, b = full.get(prefix + ".lora_A.default.weight"), full.get(prefix + ".lora_B.default.weight")
            merged[clean] = value + scale * (b @ a) if a is not None and b is not None else value
        return merged


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (a plain tensor as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` gathered whole (a collective: every rank calls it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

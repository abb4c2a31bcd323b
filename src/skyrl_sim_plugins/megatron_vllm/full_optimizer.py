"""Full fine-tuning on the Megatron workers: megatron-core's ``DistributedDataParallel`` and ``DistributedOptimizer``.

As SkyRL's Megatron worker trains every weight (``trainer.policy.model.lora.rank: 0``; the endpoint's
``trainer.train_base_weights``): the model wrapped in ``DistributedDataParallel`` with
``DistributedDataParallelConfig(grad_reduce_in_fp32, overlap_grad_reduce=False, use_distributed_optimizer=True)``
(SkyRL's ``MegatronDDPConfig`` defaults), which moves every parameter into one contiguous buffer and gives each a
``main_grad`` view of one gradient buffer (fp32 with ``grad_reduce_in_fp32``); a hook adds each weight's gradient into
it and drops it. ``get_megatron_optimizer`` with ``use_distributed_optimizer``: Adam over this rank's 1/DP shard of
the buffer (fp32 main parameters copied from 16-bit weights; the fp32 weights' own shard otherwise), its moments made
at the first step (torch's Adam, TransformerEngine and Apex being absent here), the gradient norm clipped to 1.0
(SkyRL's ``max_grad_norm``), the updated shard all-gathered into every rank's weights. megatron-core's schedule
reduce-scatters the gradient buffer after the last micro-batch (``finalize_model_grads``).

On CPU the optimizer is built and stepped inside ``cpu_shims.optimizer_scope`` (megatron checks CUDA type names).
"""

from __future__ import annotations

from typing import Any

import torch

ADAM_BETAS = (0.9, 0.95)  # Tinker's AdamParams defaults (as the adapters' optimizer)
ADAM_EPS = 1e-12
MAX_GRAD_NORM = 1.0  # SkyRL's optimizer_config.max_grad_norm


class FullOptimizer:
    """megatron-core's DDP and distributed optimizer over every weight of ``model`` (see the module docstring)."""

    mixed = False  # gradients live in DDP's buffer, never in a parameter's own ``.grad``

    def __init__(self, model: torch.nn.Module, grad_reduce_in_fp32: bool) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from skyrl_sim_plugins.megatron_vllm.cpu_shims import optimizer_scope

        for param in model.parameters():
            param.requires_grad_(True)
        config = model.config  # type: ignore[attr-defined]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        dtype = next(model.parameters()).dtype
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            weight_decay=0.0,
            adam_beta1=ADAM_BETAS[0],
            adam_beta2=ADAM_BETAS[1],
            adam_eps=ADAM_EPS,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
            clip_grad=MAX_GRAD_NORM,
        )
        with optimizer_scope():
            self.optimizer = get_megatron_optimizer(optimizer_config, [self.ddp])
        config.finalize_model_grads_func = finalize_model_grads

    @property
    def grads(self) -> list[torch.Tensor]:
        """The gradient buffers (every weight's ``main_grad`` is a view of one of them)."""
        return [buffer.grad_data for buffer in self.ddp.buffers]

    def _inner(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def held_tensors(self) -> list[torch.Tensor]:
        """What the optimizer keeps between calls: the gradient buffers, fp32 main parameters of 16-bit weights, and
        Adam's moments once a step made them (the parameters' buffer is the model's own)."""
        held = list(self.grads)
        for inner in self._inner():
            for group in getattr(inner, "shard_fp32_from_float16_groups", []):
                held += [t for t in group if isinstance(t, torch.Tensor)]
            for state in inner.optimizer.state.values():
                held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, learning_rate: float) -> None:
        """One Adam step at this learning rate (gradients clipped, the shard's update all-gathered), then the gradient
        buffer zeroed (kept allocated)."""
        from skyrl_sim_plugins.megatron_vllm.cpu_shims import optimizer_scope

        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        with optimizer_scope():
            self.optimizer.step()
        self.zero_grad()

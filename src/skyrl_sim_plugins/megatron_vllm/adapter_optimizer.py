"""The LoRA adapters' gradients and Adam, held as Megatron's DDP and distributed optimizer hold them for LoRA-only
training (what the simulator's walk sizes: ``memory.trainable_state_bytes``).

* fp32 adapters: the parameter's own ``.grad`` is the persistent gradient buffer (autograd accumulates into it in
  place) and Adam steps the parameters (fp32 moments): 16 bytes a parameter.
* 16-bit adapters (``lora.dtype: bf16``): an fp32 main gradient per parameter (DDP's ``main_grad``: a hook adds
  autograd's 16-bit gradient into it and drops it), an fp32 master copy that Adam steps (fp32 moments), copied back
  into the 16-bit parameter after every step: 2 + 4 + 4 + 8 = 18 bytes a parameter.

Everything is allocated when the model is built and zeroed, never freed, afterwards (Megatron's DDP keeps one
persistent gradient buffer; the Adam fields are made up front, as torch's Adam makes them at its first step), so the
memory a call finds held does not depend on whether an ``optim_step`` came before it.
"""

from __future__ import annotations

from functools import partial

import torch

ADAM_BETAS = (0.9, 0.95)  # Tinker's AdamParams defaults
ADAM_EPS = 1e-12


def _into_main_grad(main: torch.Tensor, param: torch.Tensor) -> None:
    """DDP's gradient hook: accumulate the 16-bit gradient autograd made into the fp32 main gradient, drop it."""
    assert param.grad is not None
    main.add_(param.grad)
    param.grad = None


class AdapterOptimizer:
    """Adam over the adapters with the gradient buffers and master weights their dtype calls for."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.mixed = any(p.dtype != torch.float32 for p in params)
        if self.mixed:
            self.masters = [p.detach().float().clone() for p in params]
            for master, param in zip(self.masters, params, strict=True):
                master.grad = torch.zeros_like(master)
                param.register_post_accumulate_grad_hook(partial(_into_main_grad, master.grad))
        else:
            self.masters = list(params)
            for param in params:
                param.grad = torch.zeros_like(param)
        self.adam = torch.optim.Adam(self.masters, lr=1e-4, betas=ADAM_BETAS, eps=ADAM_EPS)
        for master in self.masters:
            # the fields torch's Adam creates at its first step (a step count of 0: the first real step is step 1)
            self.adam.state[master] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format),
            }

    @property
    def grads(self) -> list[torch.Tensor]:
        """The persistent gradient buffers (fp32 main gradients, or the fp32 parameters' own ``.grad``)."""
        grads = [m.grad for m in self.masters]
        assert all(g is not None for g in grads)
        return grads  # type: ignore[return-value]

    def held_tensors(self) -> list[torch.Tensor]:
        """What this state keeps between calls besides the parameters: gradients, master copies, Adam's fields."""
        held = list(self.grads)
        if self.mixed:
            held += self.masters
        for state in self.adam.state.values():
            held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    def zero_grad(self) -> None:
        with torch.no_grad():
            for grad in self.grads:
                grad.zero_()

    def step(self, learning_rate: float) -> None:
        """One Adam step with this learning rate; the gradients are zeroed (kept allocated) afterwards."""
        for group in self.adam.param_groups:
            group["lr"] = learning_rate
        self.adam.step()
        if self.mixed:
            with torch.no_grad():
                for param, master in zip(self.params, self.masters, strict=True):
                    param.copy_(master)
        self.zero_grad()

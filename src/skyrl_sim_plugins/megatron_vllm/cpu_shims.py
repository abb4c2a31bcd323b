"""The four CUDA assumptions megatron-core 0.16.1 makes, shimmed for CPU-only machines (applied only without CUDA).

Measured on these machines (``/work/shared/notes/cpu-stack.md``), each one was needed:

1. the model-parallel RNG tracker reads ``torch.cuda.get_rng_state()``: replaced by a tracker holding CPU generator states
   (and activation recompute's save/restore of the cuda generator reads the CPU one and restores nothing);
2. ~40 call sites build tensors on ``torch.cuda.current_device()`` (RoPE frequencies first): it returns the CPU device;
3. the default causal mask is built on ``"cuda"``: the worker always passes an explicit boolean mask (True = masked),
   so this module only documents it (see ``worker.attention_mask``);
4. the no-pipelining schedule allocates ``torch.zeros(..., device="cuda")``: ``CudaToCpu``, a ``TorchFunctionMode``
   that maps any cuda device argument to cpu, wraps the ``forward_backward_func`` call;
5. a sliding-window layer's softmax builds its banded mask with ``get_sliding_window_causal_mask``, which allocates on
   ``"cuda"`` outside any schedule too (a forward-only pass): ``fused_softmax``'s name for it is bound to the same
   function with the mask made on the CPU (the same ``ones``, ``triu``, ``tril`` and negation).

Two more fixes, for MoE models only, on any device (``fix_moe_router``): ``moe_utils`` imports ``te_general_gemm``
inside a ``try`` and never binds the name when TransformerEngine is missing, so the router's gating GEMM raises
``NameError`` (bound to None: megatron's ``torch.mm`` path); and ``TopKRouter._apply_expert_bias`` ands the
``[tokens, experts]`` routing map with the ``[tokens]`` router padding mask without a trailing dimension, so the
expert-bias count fails whenever a padding mask is given (the mask gets its dimension, as the aux-loss paths of
``moe_utils`` give it).

One more, for multi-latent attention on any device without TransformerEngine (``fix_mla``):
``MultiLatentAttention.__init__`` checks ``isinstance(self.linear_proj, TELinear)`` behind ``HAVE_TE``, which the
module sets whenever ``megatron.core.extensions.transformer_engine`` imports, and that module imports without
TransformerEngine with ``MagicMock`` placeholders for its classes, so ``isinstance`` raises ``TypeError``; the
module's ``HAVE_TE`` is set false when ``TELinear`` is no class (the branch is for TransformerEngine's fp8/fp4 only).

megatron-core's process-wide ``GlobalMemoryBuffer`` (the unfused attention's ``baddbmm`` input) is kept as it is on
both devices: it grows to the largest score matrix the process has seen and is never freed, and the simulator carries
it from call to call (``memory.buffer_growth``). ``memory_meter.process_buffers`` counts it as held memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_applied = False


class CpuRngStatesTracker:
    """Megatron's RNG tracker interface (add / fork / get_states / set_states / reset) over CPU generator states."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._initialized = False

    def is_initialized(self) -> bool:
        return self._initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self._initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _cpu_device(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value


class CudaToCpu(TorchFunctionMode):
    """Rewrites ``device=cuda`` arguments of torch calls to cpu (shim 4, and any stray cuda mask of shim 3)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return func(*args, **kwargs)


class CudaTypeNames(CudaToCpu):
    """``CudaToCpu`` that also names a CPU tensor's type as its CUDA twin (``Tensor.type()`` of a CPU float tensor is
    ``torch.FloatTensor``): megatron-core's ``DistributedOptimizer`` sorts its parameters by those names
    (``_build_model_and_main_param_groups``) and refuses any other. Used around building it (shim 5)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            return out.replace("torch.", "torch.cuda.", 1) if not out.startswith("torch.cuda.") else out
        return out


def optimizer_scope() -> contextlib.AbstractContextManager[Any]:
    """The context to build megatron's optimizer in: ``CudaTypeNames`` on CPU, nothing on CUDA."""
    return CudaTypeNames() if on_cpu() else contextlib.nullcontext()


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> bool:
    """Install shims 1 and 2 (idempotent); a no-op where CUDA exists. Returns whether they are active."""
    global _applied
    if not on_cpu():
        return False
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRngStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.initialize_rng_tracker = lambda *_a, **_k: None  # keep ours even when asked to reset
    # activation recompute saves and restores the "cuda" generator beside the CPU one: on CPU the CPU state is all
    # there is (restored separately by megatron), so the cuda side reads the CPU state and restores nothing
    mrandom._get_cuda_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *_a, **_k: None
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_sliding_window_causal_mask = cpu_sliding_window_causal_mask
    _applied = True
    return True


def cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """megatron-core's ``get_sliding_window_causal_mask`` (``transformer/utils.py``) with its tensors on the CPU:
    True where a query may not attend (outside ``[i - window[0], i + window[1]]``)."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def fix_moe_router() -> None:
    """The two MoE router fixes of the module docstring (idempotent)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    TopKRouter._apply_expert_bias = _apply_expert_bias  # type: ignore[method-assign]


def fix_mla() -> None:
    """The multi-latent attention fix of the module docstring (idempotent)."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def _apply_expert_bias(self: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
    """megatron-core's ``TopKRouter._apply_expert_bias`` with the padding mask broadcast over the experts: count the
    tokens routed to each expert, padding left out, outside evaluation and recompute."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask).unsqueeze(-1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def device_scope() -> contextlib.AbstractContextManager[Any]:
    """The context to run megatron schedule calls in: ``CudaToCpu`` on CPU, nothing on CUDA."""
    return CudaToCpu() if on_cpu() else contextlib.nullcontext()

"""Where a real call ran out of memory, named the way the simulator's walk names it.

The walk names a failing allocation by phase (forward | backward), stage (forward | recompute | backward), decoder
layer, op and tensor shape. The real backend names it from what was running when the allocation was refused:

- ``ModuleScope`` keeps the stack of the model's modules whose forward is running (forward pre/post hooks). A
  forward that fails never runs its post hook, so after the failure the stack still names the innermost module
  (``decoder.layers.1.mlp.linear_fc1``), in the forward and in a recompute inside backward alike.
- Autograd's current node (``torch._C._current_autograd_node``) tells backward from forward, and names the backward
  function outside a recompute (``MmBackward0``).
- On CPU the tensor limit (``memory_meter.LiveTensorMeter``) hands over the refused aten op and its output's shape
  and dtype. On CUDA the device allocator raises inside the op, so only the module, the phase and the stack's frames
  are known.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
BACKWARD_FRAMES = ("backward", "run_backward", "_engine_run_backward")
SKIPPED_FILES = ("memory_meter.py", "cpu_shims.py", "failure_site.py")  # wrappers around every op: not its site


class ModuleScope:
    """The model's modules whose forward is running, innermost last, while the context is entered."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(module): name for name, module in model.named_modules() if name}
        self.modules = [module for name, module in model.named_modules() if name]
        self.stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ModuleScope:
        self.stack.clear()
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, module: torch.nn.Module, _args: Any) -> None:
        self.stack.append(self.names[id(module)])

    def _leave(self, module: torch.nn.Module, _args: Any, _out: Any) -> None:
        name = self.names[id(module)]
        while self.stack:  # a module left by an exception earlier in the call is popped with its parent
            if self.stack.pop() == name:
                break

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None


def autograd_node() -> str | None:
    """The backward function autograd is running on this thread (None outside a backward)."""
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else None


def refusal_site(func: Any, tensor: torch.Tensor) -> dict[str, Any]:
    """What the CPU tensor limit knows when it refuses an op's output: the op, the output and the autograd node."""
    return {
        "aten_op": str(func),
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "autograd_node": autograd_node(),
    }


def failure_site(exc: BaseException, module: str | None, refusal: dict[str, Any] | None = None) -> dict[str, Any]:
    """The walk's names for a failed allocation: ``phase``, ``stage``, ``layer``, ``module``, the two innermost frames
    of our code or megatron-core (``op``), and on CPU the refused op, shape and dtype."""
    frames = traceback.extract_tb(exc.__traceback__)
    node = (refusal or {}).get("autograd_node")
    in_backward = node is not None or any(f.name in BACKWARD_FRAMES for f in frames)
    phase = "backward" if in_backward else "forward"
    stage = ("recompute" if module is not None else "backward") if in_backward else "forward"
    ours = [
        f
        for f in frames
        if ("megatron" in f.filename or "skyrl_sim" in f.filename or "plugins" in f.filename)
        and not f.filename.endswith(SKIPPED_FILES)
    ]
    op = " > ".join(f"{Path(f.filename).stem}:{f.name}" for f in ours[-2:])
    match = LAYER.search(module or "")
    site: dict[str, Any] = {"phase": phase, "stage": stage, "op": op, "module": module}
    site["layer"] = int(match.group(1)) if match else None
    if refusal:
        site.update(refusal)
    return site

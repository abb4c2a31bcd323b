"""A segment's forward as a dataflow graph, and the allocation programs it implies in forward and in backward.

Each op creates one output tensor (or a view), reads inputs, and may save tensors for backward. From that alone the
allocation order follows, the way autograd produces it:

* forward without grad (inside a fully recomputed layer): every tensor is freed after its last reader;
* forward with grad: a tensor some op saves stays alive until that op's backward has run;
* backward: ops in reverse order; each allocates the gradient of each input (same shape and dtype; a second
  gradient for the same tensor is accumulated in place), frees its output's gradient and the tensors it saved.

A view (a split of a fused projection) costs nothing, and saving it keeps its base alive. Per-op workspaces
(``temps`` in forward, ``backward_extra`` in backward) live only while the op runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from skyrl_sim_plugins.sim.allocator import CATEGORY_INDEX, Step, round_allocated, round_reserved

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "int64": 8, "int32": 4, "bool": 1}

Shape = tuple[int, ...]
Workspace = tuple[str, Shape, str]


def nbytes(shape: Shape, dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: Shape
    dtype: str
    category: str
    base: str | None = None  # set for a view
    external: bool = False  # allocated before the segment (the layer input, the incoming gradient)
    requires_grad: bool = True

    @property
    def nbytes(self) -> int:
        return 0 if self.base is not None else nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class OpSpec:
    name: str
    out: str
    inputs: tuple[str, ...]
    saves: tuple[str, ...]
    temps: tuple[Workspace, ...] = ()
    backward_extra: tuple[Workspace, ...] = ()
    core_attn: bool = False  # recomputed instead of saved under selective recompute
    holds: tuple[str, ...] = ()  # tensors a Python reference keeps alive until this op (no gradient flows)


@dataclass
class Graph:
    """The forward of one segment: tensors and ops in execution order."""

    category: str = "transient"
    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    ops: list[OpSpec] = field(default_factory=list)

    def external(self, key: str, shape: Shape, dtype: str, category: str, requires_grad: bool = True) -> str:
        self.tensors[key] = TensorSpec(key, shape, dtype, category, external=True, requires_grad=requires_grad)
        return key

    def op(
        self,
        name: str,
        shape: Shape,
        dtype: str,
        inputs: tuple[str, ...] = (),
        saves: tuple[str, ...] = (),
        save_output: bool = False,
        temps: tuple[Workspace, ...] = (),
        backward_extra: tuple[Workspace, ...] = (),
        core_attn: bool = False,
        category: str | None = None,
        holds: tuple[str, ...] = (),
    ) -> str:
        """Add an op; returns its output's key (the op name)."""
        key = name
        if key in self.tensors:
            raise ValueError(f"duplicate tensor {key}")
        requires = any(self.tensors[i].requires_grad for i in inputs)
        self.tensors[key] = TensorSpec(key, shape, dtype, category or self.category, requires_grad=requires)
        kept = saves + ((key,) if save_output else ())
        self.ops.append(OpSpec(name, key, inputs, kept, temps, backward_extra, core_attn, holds))
        return key

    def view(self, key: str, base: str, shape: Shape) -> str:
        """A view into ``base`` (a split of a fused output): no bytes; saving it keeps the base."""
        spec = self.tensors[base]
        root = spec.base or base
        self.tensors[key] = TensorSpec(key, shape, spec.dtype, spec.category, base=root, requires_grad=spec.requires_grad)
        return key

    def storage(self, key: str) -> str:
        return self.tensors[key].base or key

    def saved_storages(self, grad: bool, selective: bool) -> dict[str, int]:
        """Storage -> index of the first op that saves it (it is freed after that op's backward)."""
        if not grad:
            return {}
        first: dict[str, int] = {}
        for index, op in enumerate(self.ops):
            if selective and op.core_attn:
                continue
            for key in op.saves:
                first.setdefault(self.storage(key), index)
        return first

    def _step(self, key: str, sign: int, op: str, category: str | None = None) -> Step:
        spec = self.tensors[key]
        size = spec.nbytes
        return Step(
            key=key,
            nbytes=sign * round_allocated(size),
            reserved=sign * round_reserved(size),
            category=CATEGORY_INDEX[category or spec.category],
            op=op,
            shape=spec.shape,
            dtype=spec.dtype,
        )

    @staticmethod
    def _workspace(name: str, shape: Shape, dtype: str, sign: int, category: str) -> Step:
        size = nbytes(shape, dtype)
        return Step(
            name, sign * round_allocated(size), sign * round_reserved(size), CATEGORY_INDEX[category], name, shape, dtype
        )

    def forward_steps(self, grad: bool, keep: tuple[str, ...], selective: bool = False) -> list[Step]:
        """Allocations and frees of the forward; ``keep`` outputs outlive the segment."""
        saved = self.saved_storages(grad, selective)
        keep_storage = {self.storage(k) for k in keep}
        last_use: dict[str, int] = {}
        for index, op in enumerate(self.ops):
            last_use[self.storage(op.out)] = index
            for key in op.inputs + op.holds:
                last_use[self.storage(key)] = index
        steps: list[Step] = []
        for index, op in enumerate(self.ops):
            category = self.category
            for name, shape, dtype in op.temps:
                steps.append(self._workspace(f"{op.name}.{name}", shape, dtype, 1, category))
            spec = self.tensors[op.out]
            if spec.base is None:
                steps.append(self._step(op.out, 1, op.name, self.alloc_category(op.out, saved)))
            for name, shape, dtype in op.temps:
                steps.append(self._workspace(f"{op.name}.{name}", shape, dtype, -1, category))
            for storage, last in last_use.items():
                if last != index or storage in saved or storage in keep_storage or self.tensors[storage].external:
                    continue
                steps.append(self._step(storage, -1, op.name, self.alloc_category(storage, saved)))
        return steps

    def alloc_category(self, storage: str, saved: dict[str, int]) -> str:
        """A transient tensor that some op saves for backward counts as a saved activation."""
        declared = self.tensors[storage].category
        return "saved_activations" if storage in saved and declared == "transient" else declared

    def backward_steps(
        self,
        grad_seed: str,
        keep_forward: tuple[str, ...],
        free_after: tuple[str, ...],
        grad_input: str | None,
        selective: bool = False,
        seed_external: bool = True,
    ) -> list[Step]:
        """Backward after a grad-mode forward of this graph.

        ``grad_seed``: the tensor whose gradient arrives (external when it was allocated by the previous segment);
        ``grad_input``: the external input whose gradient this segment hands on (kept); ``free_after``: tensors
        freed when the segment's backward ends (the layer input, a recomputed output).
        """
        saved = self.saved_storages(True, selective)
        steps: list[Step] = []
        grads: dict[str, TensorSpec] = {}
        seed = self.tensors[grad_seed]
        grads[grad_seed] = TensorSpec(f"grad:{grad_seed}", seed.shape, seed.dtype, "transient")
        if not seed_external:
            steps.append(self._grad_step(grads[grad_seed], 1, f"{grad_seed}.backward"))
        for index in range(len(self.ops) - 1, -1, -1):
            op = self.ops[index]
            name = f"{op.name}.backward"
            out_storage = self.storage(op.out)
            views = [k for k in list(grads) if k != op.out and self.storage(k) == out_storage and self.tensors[k].base]
            if views and self.tensors[op.out].base is None:
                if op.out not in grads:
                    spec = self.tensors[op.out]
                    grads[op.out] = TensorSpec(f"grad:{op.out}", spec.shape, spec.dtype, "transient")
                    steps.append(self._grad_step(grads[op.out], 1, name))
                for view in views:
                    steps.append(self._grad_step(grads.pop(view), -1, name))
            if op.out not in grads:
                continue  # not on the gradient path
            if selective and op.core_attn:
                for key in op.saves:
                    steps.append(self._step(self.storage(key), 1, f"{op.name}.recompute", "transient"))
            for ws_name, shape, dtype in op.backward_extra:
                steps.append(self._workspace(f"{name}.{ws_name}", shape, dtype, 1, self.category))
            for key in op.inputs:
                spec = self.tensors[key]
                if not spec.requires_grad or key in grads:
                    continue
                grads[key] = TensorSpec(f"grad:{key}", spec.shape, spec.dtype, "transient")
                steps.append(self._grad_step(grads[key], 1, name))
            for ws_name, shape, dtype in op.backward_extra:
                steps.append(self._workspace(f"{name}.{ws_name}", shape, dtype, -1, self.category))
            steps.append(self._grad_step(grads.pop(op.out), -1, name))
            if selective and op.core_attn:
                for key in op.saves:
                    steps.append(self._step(self.storage(key), -1, f"{op.name}.recompute", "transient"))
            for storage, first in saved.items():
                kept = storage in {self.storage(k) for k in keep_forward}
                if first == index and not kept and not self.tensors[storage].external:
                    steps.append(self._step(storage, -1, name, self.alloc_category(storage, saved)))
        for key, spec in list(grads.items()):
            if key != grad_input:
                steps.append(self._grad_step(spec, -1, "backward.end"))
        for key in free_after:
            steps.append(self._step(key, -1, "backward.end"))
        return steps

    @staticmethod
    def _grad_step(spec: TensorSpec, sign: int, op: str) -> Step:
        size = nbytes(spec.shape, spec.dtype)
        return Step(
            spec.key,
            sign * round_allocated(size),
            sign * round_reserved(size),
            CATEGORY_INDEX["transient"],
            op,
            spec.shape,
            spec.dtype,
        )

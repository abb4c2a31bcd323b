"""A segment's forward as a dataflow graph, and the allocation step arrays it implies in forward and in backward.

Each op creates one output tensor (or a view), reads inputs, and may save tensors for backward. From that alone the
allocation order follows, the way autograd produces it:

* forward without grad (inside a fully recomputed layer): every tensor is freed after its last reader;
* forward with grad: a tensor some op saves stays alive until that op's backward has run;
* backward: ops in reverse order; each allocates the gradient of each input (same shape and dtype; a second
  gradient for the same tensor is accumulated in place), frees its output's gradient and the tensors it saved.

A view (a split of a fused projection) costs nothing, and saving it keeps its base alive. Per-op workspaces
(``temps`` in forward, ``backward_extra`` in backward) live only while the op runs.

Which tensor is allocated or freed when depends only on the graph's topology, never on its sizes, so the analysis
(``forward_plan``, ``backward_plan``) yields size-free ``StepSpec``s; the compiled plan of a topology
(``CompiledPlan``, which the bound memory model keeps per topology: ``PlanSource``) serves every micro-batch shape,
which only reads its tensors' sizes into it (``CompiledPlan.sized``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from skyrl_sim.api import DTYPE_BYTES
from skyrl_sim_plugins.sim.reference.allocator import (
    CATEGORIES,
    CATEGORY_INDEX,
    CUDA_CACHING,
    AllocatorRule,
    Step,
    StepArray,
)

Shape = tuple[int, ...]
Workspace = tuple[str, Shape, str]
# What a step's size is read from: ("storage" | "grad", tensor key, -1, -1) or ("temp" | "extra", workspace name,
# op index, position in the op's workspaces). A grad has its tensor's shape, a view's too; a view's storage is free.
SizeRef = tuple[str, str, int, int]


def nbytes(shape: Shape, dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


def size_table(entries: list[tuple[Shape, int]], n: int) -> np.ndarray:
    """``nbytes`` of every entry (a shape and its bytes per element; 0 for a view's free storage) as an [n, entries]
    int64 table, for shapes whose dimensions are ints or arrays of ``n`` values (``memory_lanes.Lanes``: one value
    per micro-batch shape of a tile).

    The same integers as ``nbytes`` entry by entry, with far fewer array operations: a shape's int dimensions and
    element bytes multiply as Python ints, and its array dimensions once per distinct set of arrays (a graph's
    shapes share a few: the sequence, its TP shard), so the table is one gather and one multiply. Integer products
    do not depend on their order (int64 wraps alike), and a Python int past int64 raises ``OverflowError`` as
    ``Lanes`` arithmetic does.
    """
    coefficients: list[int] = []
    groups: list[int] = []
    products: list[np.ndarray] = [np.ones(n, dtype=np.int64)]  # group 0: no array dimension
    group_of: dict[tuple[int, ...], int] = {(): 0}
    # Shapes and arrays are alive in ``entries``, so their ids name them; a tensor's storage and gradient share one.
    factors: dict[int, tuple[int, int]] = {}  # id(shape) -> (product of its int dimensions, its group)
    for shape, element_bytes in entries:
        found = factors.get(id(shape))
        if found is None:
            whole = 1
            arrays: list[Any] = []
            for dim in shape:
                if isinstance(dim, int):
                    whole *= dim
                else:
                    arrays.append(dim)
            key = tuple(map(id, arrays))
            group = group_of.get(key)
            if group is None:
                product = products[0]  # [n]: each product broadcasts to one value per lane (or raises ValueError)
                for a in arrays:
                    product = product * np.asarray(a, dtype=np.int64)  # a plain array: no subclass per operation
                group = group_of[key] = len(products)
                products.append(product)
            found = factors[id(shape)] = (whole, group)
        coefficients.append(found[0] * element_bytes)
        groups.append(found[1])
    if not coefficients:
        return np.empty((n, 0), dtype=np.int64)
    return np.stack(products, axis=1)[:, groups] * np.array(coefficients, dtype=np.int64)


@dataclass(frozen=True)
class StepSpec:
    """One allocation (``sign`` 1) or free (-1) of a segment before sizes are known: a graph's liveness analysis
    depends only on its topology, so one plan serves every micro-batch shape (``Graph.steps`` sizes it)."""

    key: str
    sign: int
    category: int
    op: str
    ref: SizeRef


class TensorSpec(NamedTuple):
    """A tensor of the graph (a named tuple: graphs are built per micro-batch shape, so construction is hot)."""

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


class OpSpec(NamedTuple):
    """An op: its output, inputs, what it saves for backward, its workspaces."""

    name: str
    out: str
    inputs: tuple[str, ...]
    saves: tuple[str, ...]
    temps: tuple[Workspace, ...] = ()
    backward_extra: tuple[Workspace, ...] = ()
    core_attn: bool = False  # recomputed instead of saved under selective recompute
    holds: tuple[str, ...] = ()  # tensors a Python reference keeps alive until this op (no gradient flows)
    grad_in_output: bool = False  # the gradient arriving at the output is written into the saved output in place
    grad_passthrough: bool = False  # the input's gradient is the output's gradient storage (a clone's backward)
    grad_after_workspaces: bool = False  # the input's gradient is made after the backward workspaces are freed
    grad_before_workspaces: bool = False  # the input's gradient is made before the backward workspaces
    detached: bool = False  # computed without grad (a metric): its output needs no gradient
    grad_slices: bool = False  # each input's gradient is a slice of the output's (a concatenation's backward)
    # the backward's own order (``Graph.op``'s ``backward_order``): workspace allocations and frees, the input's
    # gradient and the release of the output's, in the order autograd runs them (empty: the default order)
    backward_order: tuple[tuple[str, int], ...] = ()
    aliases_input: bool = False  # the output is a view of its first input (``unbind``): no storage of its own


EXTERNAL, VIEW, OP = "external", "view", "op"  # the kinds of record in a graph's log


@dataclass
class Graph:
    """The forward of one segment: tensors and ops in execution order.

    Building a graph only logs the calls (``external``, ``op``, ``view``): a walk builds the graphs of every new
    micro-batch shape and needs only their sizes (``size_bytes``) and their topology (the key of an already
    compiled plan). ``tensors`` and ``ops``, which the liveness analysis reads, are derived from the log when asked.
    """

    category: str = "transient"
    allocator: AllocatorRule = CUDA_CACHING  # how the device sizes this graph's tensors
    _log: list[tuple[Any, ...]] = field(default_factory=list, repr=False, compare=False)
    _derived: dict[str, tuple[int, Any]] = field(default_factory=dict, repr=False, compare=False)

    def external(self, key: str, shape: Shape, dtype: str, category: str, requires_grad: bool = True) -> str:
        """A tensor allocated before the segment (the layer input, the incoming gradient)."""
        self._log.append((EXTERNAL, key, shape, dtype, category, requires_grad))
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
        grad_in_output: bool = False,
        grad_passthrough: bool = False,
        grad_after_workspaces: bool = False,
        grad_before_workspaces: bool = False,
        detached: bool = False,
        grad_slices: bool = False,
        backward_order: tuple[tuple[str, int], ...] = (),
        aliases_input: bool = False,
    ) -> str:
        """Add an op; returns its output's key (the op name).

        ``grad_in_output``: the op saves its output and its backward rewrites it into the gradient (megatron's
        cross-entropy turns its saved softmax into the logits' gradient): the gradient arriving at the output costs
        nothing and frees the output. ``grad_passthrough``: the input's gradient is the output's gradient itself (a
        clone's or a contiguous copy's backward). ``grad_after_workspaces``: the input's gradient is allocated only
        after the backward workspaces are freed; ``grad_before_workspaces``: before them (a preallocated gradient
        buffer the workspaces stream into). ``detached``: the op runs without grad (the RL path's entropy metric),
        so its output needs no gradient and no gradient flows back through it. ``grad_slices``: each input's gradient
        is a view of the output's gradient (a concatenation's backward): nothing is allocated, and the output's
        gradient lives until the last of those views is freed. ``backward_order``: a backward that allocates and frees
        its workspaces one after another (a chain of autograd nodes run as one op), as ``("alloc", i)`` and
        ``("free", i)`` of ``backward_extra[i]``, ``("grad", 0)`` where the input's gradient is made and
        ``("release", 0)`` where the output's gradient is freed; each exactly once. ``aliases_input``: the output is a
        view of the first input's storage (``torch.unbind``): the forward allocates nothing, and the backward makes
        the output's gradient from its views' gradients (``unbind``'s backward stacks them) before handing it on.
        """
        if grad_after_workspaces and grad_before_workspaces:
            raise ValueError(f"op {name}: its input gradient cannot come both before and after its workspaces")
        if backward_order:
            _check_backward_order(name, backward_order, len(backward_extra), grad_after_workspaces or grad_before_workspaces)
        flags = (
            grad_in_output,
            grad_passthrough,
            grad_after_workspaces,
            grad_before_workspaces,
            detached,
            grad_slices,
            backward_order,
            aliases_input,
        )
        self._log.append(
            (OP, name, shape, dtype, inputs, saves, save_output, temps, backward_extra, core_attn, category, holds, flags)
        )
        return name

    def view(self, key: str, base: str, shape: Shape) -> str:
        """A view into ``base`` (a split of a fused output): no bytes; saving it keeps the base."""
        self._log.append((VIEW, key, base, shape))
        return key

    def output(self) -> str:
        """The last op's output (the segment's result), read from the log."""
        return next(r[1] for r in reversed(self._log) if r[0] == OP)

    def _memo(self, name: str, make: Callable[[], Any]) -> Any:
        """A value derived from the log, kept until the log grows."""
        found = self._derived.get(name)
        if found is None or found[0] != len(self._log):
            found = self._derived[name] = (len(self._log), make())
        return found[1]

    @property
    def tensors(self) -> dict[str, TensorSpec]:
        return self._memo("structure", self._structure)[0]

    @property
    def ops(self) -> list[OpSpec]:
        return self._memo("structure", self._structure)[1]

    def _structure(self) -> tuple[dict[str, TensorSpec], list[OpSpec]]:
        tensors: dict[str, TensorSpec] = {}
        ops: list[OpSpec] = []
        for record in self._log:
            if record[0] == EXTERNAL:
                _, key, shape, dtype, category, requires_grad = record
                tensors[key] = TensorSpec(key, shape, dtype, category, external=True, requires_grad=requires_grad)
            elif record[0] == VIEW:
                _, key, base, shape = record
                spec = tensors[base]
                root = spec.base or base
                tensors[key] = TensorSpec(key, shape, spec.dtype, spec.category, base=root, requires_grad=spec.requires_grad)
            else:
                _, name, shape, dtype, inputs, saves, save_output, temps, extra, core_attn, category, holds, flags = record
                if name in tensors:
                    raise ValueError(f"duplicate tensor {name}")
                requires = not flags[4] and any(tensors[i].requires_grad for i in inputs)
                base = (tensors[inputs[0]].base or inputs[0]) if flags[7] else None
                tensors[name] = TensorSpec(name, shape, dtype, category or self.category, base, requires_grad=requires)
                kept = saves + (name,) if save_output else saves
                ops.append(OpSpec(name, name, inputs, kept, temps, extra, core_attn, holds, *flags))
        return tensors, ops

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

    def topology(self) -> tuple[object, ...]:
        """Everything in the log but shapes and dtypes: equal topologies give equal step plans (a plan's key)."""
        return self._memo("topology", self._topology)

    def _topology(self) -> tuple[object, ...]:
        records: list[tuple[object, ...]] = []
        for r in self._log:
            if r[0] == OP:
                workspaces = (tuple(w[0] for w in r[7]), tuple(w[0] for w in r[8])) if r[7] or r[8] else ()
                records.append((r[1], r[4], r[5], r[6], r[9], r[10], r[11], r[12], workspaces))
            elif r[0] == VIEW:
                records.append((VIEW, r[1], r[2]))
            else:
                records.append((EXTERNAL, r[1], r[4], r[5]))
        return (self.category, tuple(records))

    def size_entries(self) -> list[tuple[Shape, str, int]]:
        """Shape, dtype and bytes of everything a step can allocate, in ``size_positions`` order: each tensor's storage
        (a view's is free), each tensor's gradient (a view's has the view's shape), then every op's workspaces."""
        return self._memo("entries", self._size_entries)

    def _size_entries(self) -> list[tuple[Shape, str, int]]:
        dtypes: dict[str, str] = {}
        storages: list[tuple[Shape, str, int]] = []
        grads: list[tuple[Shape, str, int]] = []
        workspaces: list[tuple[Shape, str, int]] = []
        for r in self._log:
            if r[0] == VIEW:
                _, key, base, shape = r
                dtype = dtypes[key] = dtypes[base]
                storages.append((shape, dtype, 0))
                grads.append((shape, dtype, nbytes(shape, dtype)))
                continue
            key, shape, dtype = r[1], r[2], r[3]
            dtypes[key] = dtype
            entry = (shape, dtype, nbytes(shape, dtype))
            storages.append((shape, dtype, 0) if r[0] == OP and r[12][7] else entry)  # an alias's storage is free
            grads.append(entry)
            if r[0] == OP:
                workspaces += [(ws_shape, ws_dtype, nbytes(ws_shape, ws_dtype)) for _, ws_shape, ws_dtype in r[7] + r[8]]
        return storages + grads + workspaces

    def size_bytes(self) -> list[int]:
        """The bytes of ``size_entries`` alone (what a walk needs of a new shape; the shapes only to name a step)."""
        return self._memo("bytes", lambda: [math.prod(shape) * element for shape, element in self.size_shapes()])

    def size_shapes(self) -> list[tuple[Shape, int]]:
        """The shape and bytes per element (0: a view's free storage) of everything a step can allocate, in
        ``size_entries`` order: what ``size_bytes`` multiplies out, and ``size_table`` for a tile of shapes."""
        return self._memo("shapes", self._size_shapes)

    def _size_shapes(self) -> list[tuple[Shape, int]]:
        dtypes: dict[str, str] = {}
        storages: list[tuple[Shape, int]] = []
        grads: list[tuple[Shape, int]] = []
        workspaces: list[tuple[Shape, int]] = []
        for r in self._log:
            if r[0] == VIEW:
                dtype = dtypes[r[1]] = dtypes[r[2]]
                storages.append((r[3], 0))
                grads.append((r[3], DTYPE_BYTES[dtype]))
                continue
            dtypes[r[1]] = r[3]
            entry = (r[2], DTYPE_BYTES[r[3]])
            storages.append((r[2], 0) if r[0] == OP and r[12][7] else entry)  # an alias's storage is free
            grads.append(entry)
            if r[0] == OP and (r[7] or r[8]):
                workspaces += [(ws_shape, DTYPE_BYTES[ws_dtype]) for _, ws_shape, ws_dtype in r[7] + r[8]]
        return storages + grads + workspaces

    def size_positions(self) -> dict[SizeRef, int]:
        """Where each ``SizeRef`` of this graph sits in ``size_entries`` (the same for every graph of one topology)."""
        where: dict[SizeRef, int] = {}
        count = len(self.tensors)
        for index, key in enumerate(self.tensors):
            where[("storage", key, -1, -1)] = index
            where[("grad", key, -1, -1)] = count + index
        position = 2 * count
        for op_index, op in enumerate(self.ops):
            for kind, workspaces, prefix in (
                ("temp", op.temps, op.name),
                ("extra", op.backward_extra, f"{op.name}.backward"),
            ):
                for i, (name, _, _) in enumerate(workspaces):
                    where[(kind, f"{prefix}.{name}", op_index, i)] = position
                    position += 1
        return where

    def rounded_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """``size_bytes`` rounded to allocated and to reserved bytes."""

        def rounded() -> tuple[np.ndarray, np.ndarray]:
            return self.allocator.rounded_arrays(np.array(self.size_bytes(), dtype=np.int64))

        return self._memo("rounded", rounded)

    def step(self, spec: StepSpec, position: int) -> Step:
        """A step of a plan with this graph's sizes, rounded as the allocator rounds them."""
        shape, dtype, size = self.size_entries()[position]
        return Step(
            spec.key,
            spec.sign * self.allocator.allocated(size),
            spec.sign * self.allocator.reserved(size),
            spec.category,
            spec.op,
            shape,
            dtype,
        )

    def steps(self, plan: list[StepSpec]) -> list[Step]:
        """A plan with this graph's sizes."""
        where = self.size_positions()
        return [self.step(spec, where[spec.ref]) for spec in plan]

    def forward_steps(self, grad: bool, keep: tuple[str, ...], selective: bool = False) -> list[Step]:
        """Allocations and frees of the forward; ``keep`` outputs outlive the segment."""
        return self.steps(self.forward_plan(grad, keep, selective))

    def _tensor(self, key: str, sign: int, op: str, category: str | None = None) -> StepSpec:
        return StepSpec(key, sign, CATEGORY_INDEX[category or self.tensors[key].category], op, ("storage", key, -1, -1))

    @staticmethod
    def _workspaces(op_index: int, kind: str, names: list[str], sign: int, category: str) -> list[StepSpec]:
        return [
            StepSpec(name, sign, CATEGORY_INDEX[category], name, (kind, name, op_index, i)) for i, name in enumerate(names)
        ]

    def forward_plan(
        self,
        grad: bool,
        keep: tuple[str, ...],
        selective: bool = False,
        release: tuple[str, ...] = (),
        release_early: bool = False,
    ) -> list[StepSpec]:
        """The forward's allocations and frees, without sizes; ``keep`` outputs outlive the segment, and the external
        tensors in ``release`` (a forward-only pass's layer input) are freed when it ends, or after their last reader
        with ``release_early`` (a forward-only head's input: the decoder's output, which its final norm replaces)."""
        saved = self.saved_storages(grad, selective)
        tensors = self.tensors
        keep_storage = {self.storage(k) for k in keep}
        last_use: dict[str, int] = {}
        for index, op in enumerate(self.ops):
            last_use[tensors[op.out].base or op.out] = index
            for key in op.inputs + op.holds:
                last_use[tensors[key].base or key] = index
        freed_after = _by_index(last_use)  # linear: each op frees the storages it used last, in last_use's order
        steps: list[StepSpec] = []
        for index, op in enumerate(self.ops):
            category = self.category
            temps = [f"{op.name}.{name}" for name, _, _ in op.temps]
            steps += self._workspaces(index, "temp", temps, 1, category)
            spec = tensors[op.out]
            if spec.base is None:
                steps.append(self._tensor(op.out, 1, op.name, self.alloc_category(op.out, saved)))
            steps += self._workspaces(index, "temp", temps, -1, category)
            for storage in freed_after.get(index, ()):
                early = release_early and storage in release
                if storage in saved or storage in keep_storage or (tensors[storage].external and not early):
                    continue
                category = tensors[storage].category if early else self.alloc_category(storage, saved)
                steps.append(self._tensor(storage, -1, op.name, category))
        if not release_early:
            steps += [self._tensor(self.storage(k), -1, "forward.end", self.tensors[k].category) for k in release]
        return steps

    def alloc_category(self, storage: str, saved: dict[str, int]) -> str:
        """A transient tensor that some op saves for backward counts as a saved activation."""
        declared = self.tensors[storage].category
        return "saved_activations" if storage in saved and declared == "transient" else declared

    def backward_plan(
        self,
        grad_seed: str,
        keep_forward: tuple[str, ...],
        free_after: tuple[str, ...],
        grad_input: str | None,
        selective: bool = False,
        seed_external: bool = True,
    ) -> list[StepSpec]:
        """Backward after a grad-mode forward of this graph, without sizes.

        ``grad_seed``: the tensor whose gradient arrives (external when it was allocated by the previous segment);
        ``grad_input``: the external input whose gradient this segment hands on (kept); ``free_after``: tensors
        freed when the segment's backward ends (the layer input, a recomputed output).
        """
        saved = self.saved_storages(True, selective)
        tensors = self.tensors
        kept_storages = {self.storage(k) for k in keep_forward}
        in_output = {op.out for op in self.ops if op.grad_in_output}  # their gradient is their saved output
        freed_at = _by_index(saved)  # each op's backward frees the storages it saved first, in saved's order
        steps: list[StepSpec] = []
        # live gradients, by the key of the tensor they belong to, in creation order (a dict as an ordered set: a
        # call's LM head has one op per log-prob chunk, and a list's membership tests made long rows quadratic);
        # the live gradients of views, per storage, in the same order
        grads: dict[str, None] = {}
        view_grads: dict[str, dict[str, None]] = {}

        def add(key: str) -> None:
            grads[key] = None
            base = tensors[key].base
            if base:
                view_grads.setdefault(base, {})[key] = None

        def remove(key: str) -> None:
            del grads[key]
            base = tensors[key].base
            if base:
                del view_grads[base][key]

        # gradients that are slices of another's (``grad_slices``): key -> the owner, and each owner's live slices
        slice_of: dict[str, str] = {}
        slices_left: dict[str, int] = {}
        # gradients that are a saved output's storage (``grad_in_output``, handed on by ``grad_passthrough``): the
        # category that storage was allocated under, which its free takes back
        storage_category: dict[str, int] = {}

        def release(key: str, op_name: str) -> None:
            """Free a gradient that was allocated, or a slice: the owner's storage goes with its last slice."""
            owner = slice_of.pop(key, None)
            if owner is None:
                spec = self._grad(key, -1, op_name)
                category = storage_category.pop(key, None)
                steps.append(spec if category is None else replace(spec, category=category))
                return
            slices_left[owner] -= 1
            if not slices_left[owner]:
                steps.append(self._grad(owner, -1, op_name))

        add(grad_seed)
        if not seed_external:
            steps.append(self._grad(grad_seed, 1, f"{grad_seed}.backward"))
        for index in range(len(self.ops) - 1, -1, -1):
            op = self.ops[index]
            name = f"{op.name}.backward"
            out_storage = tensors[op.out].base or op.out
            views = [k for k in view_grads.get(out_storage, ()) if k != op.out]
            if views and (tensors[op.out].base is None or op.aliases_input):
                if op.out not in grads:
                    add(op.out)
                    steps.append(self._grad(op.out, 1, name))
                for view in views:
                    remove(view)
                    release(view, name)
            if op.out not in grads:
                continue  # not on the gradient path
            if selective and op.core_attn:
                steps += [self._tensor(self.storage(key), 1, f"{op.name}.recompute", "transient") for key in op.saves]
            extra = [f"{name}.{ws_name}" for ws_name, _, _ in op.backward_extra]
            inputs: list[StepSpec] = []
            handed_on = False  # the output's gradient storage became the input's gradient
            for key in op.inputs:
                if not tensors[key].requires_grad or key in grads:
                    continue
                add(key)
                if key in in_output:
                    storage_category[key] = CATEGORY_INDEX[self.alloc_category(self.storage(key), saved)]
                    continue  # written into that op's saved output: no allocation
                if op.grad_passthrough and not handed_on:
                    handed_on = True
                    if op.out in storage_category:
                        storage_category[key] = storage_category.pop(op.out)
                    continue
                if op.grad_slices:
                    slice_of[key] = op.out
                    slices_left[op.out] = slices_left.get(op.out, 0) + 1
                    continue
                inputs.append(self._grad(key, 1, name))
            if op.backward_order:  # a chain of autograd nodes run as one op, in their order
                for kind, i in op.backward_order:
                    if kind == "grad":
                        steps += inputs
                    elif kind == "release":
                        remove(op.out)
                        if not handed_on:
                            release(op.out, name)
                    else:
                        sign, ref = 1 if kind == "alloc" else -1, ("extra", extra[i], index, i)
                        steps.append(StepSpec(extra[i], sign, CATEGORY_INDEX[self.category], extra[i], ref))
            else:
                if op.grad_before_workspaces:
                    steps += inputs
                steps += self._workspaces(index, "extra", extra, 1, self.category)
                if not op.grad_after_workspaces and not op.grad_before_workspaces:
                    steps += inputs
                steps += self._workspaces(index, "extra", extra, -1, self.category)
                remove(op.out)
                if op.grad_slices and slices_left.get(op.out):
                    pass  # the slices hold it: freed with the last of them
                elif not handed_on:
                    release(op.out, name)
                if op.grad_after_workspaces:
                    steps += inputs
            if selective and op.core_attn:
                steps += [self._tensor(self.storage(key), -1, f"{op.name}.recompute", "transient") for key in op.saves]
            for storage in freed_at.get(index, ()):
                if storage in in_output and storage == op.out:
                    continue  # freed as the gradient it became
                if storage not in kept_storages and not tensors[storage].external:
                    steps.append(self._tensor(storage, -1, name, self.alloc_category(storage, saved)))
        for key in [k for k in grads if k != grad_input]:
            release(key, "backward.end")
        steps += [self._tensor(key, -1, "backward.end") for key in free_after]
        return steps

    @staticmethod
    def _grad(key: str, sign: int, op: str) -> StepSpec:
        """A gradient: the shape and dtype of its tensor (of a view too), always transient."""
        return StepSpec(f"grad:{key}", sign, CATEGORY_INDEX["transient"], op, ("grad", key, -1, -1))

    def plan(self, recipe: Recipe) -> list[StepSpec]:
        """The steps a recipe names: ``forward_recipe`` or ``backward_recipe`` arguments."""
        if recipe[0] == "forward":
            return self.forward_plan(*recipe[1:])
        return self.backward_plan(*recipe[1:])


Recipe = tuple[object, ...]


def _check_backward_order(name: str, order: tuple[tuple[str, int], ...], workspaces: int, grad_flag: bool) -> None:
    """``Graph.op``'s ``backward_order``: every workspace allocated once and then freed once, the input's gradient
    made once and the output's gradient released once, and no other placement flag beside it."""
    if grad_flag:
        raise ValueError(f"op {name}: backward_order places the input's gradient itself")
    allocs = [i for kind, i in order if kind == "alloc"]
    frees = [i for kind, i in order if kind == "free"]
    marks = sorted(kind for kind, _ in order if kind not in ("alloc", "free"))
    position = {entry: k for k, entry in enumerate(order)}  # each entry's place (once each, checked first)
    if (
        sorted(allocs) != list(range(workspaces))
        or sorted(frees) != list(range(workspaces))
        or any(position[("free", i)] < position[("alloc", i)] for i in allocs)
        or marks != ["grad", "release"]
    ):
        raise ValueError(f"op {name}: backward_order must allocate then free each workspace once, grad and release once")


def _by_index(positions: dict[str, int]) -> dict[int, list[str]]:
    """``{key: index}`` inverted to ``{index: [keys]}``, each list in the mapping's order: a loop over indices that
    asks "which keys end here" reads each key once instead of scanning the whole mapping at every index."""
    out: dict[int, list[str]] = {}
    for key, index in positions.items():
        out.setdefault(index, []).append(key)
    return out


def forward_recipe(
    grad: bool,
    keep: tuple[str, ...],
    selective: bool = False,
    release: tuple[str, ...] = (),
    release_early: bool = False,
) -> Recipe:
    """``Graph.forward_plan``'s arguments, as a hashable value."""
    return ("forward", grad, keep, selective, release, release_early)


def backward_recipe(
    grad_seed: str,
    keep_forward: tuple[str, ...],
    free_after: tuple[str, ...],
    grad_input: str | None,
    selective: bool = False,
    seed_external: bool = True,
) -> Recipe:
    """``Graph.backward_plan``'s arguments, as a hashable value."""
    return ("backward", grad_seed, keep_forward, free_after, grad_input, selective, seed_external)


@dataclass(frozen=True)
class CompiledPlan:
    """The steps of one or more recipes run back to back over one graph topology, as arrays.

    Step ``i`` has the size at ``positions[i]`` of a graph's ``size_table`` (a graph of this topology) times
    ``sign[i]``. ``lengths``: how many steps each recipe contributed (a recompute's count, for the timeline).
    """

    specs: list[StepSpec]
    positions: np.ndarray
    sign: np.ndarray
    category: np.ndarray
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, graph: Graph, recipes: tuple[Recipe, ...]) -> CompiledPlan:
        parts = [graph.plan(recipe) for recipe in recipes]
        specs = [spec for part in parts for spec in part]
        where = graph.size_positions()
        return cls(
            specs=specs,
            positions=np.array([where[spec.ref] for spec in specs], dtype=np.int64),
            sign=np.array([spec.sign for spec in specs], dtype=np.int64),
            category=np.array([spec.category for spec in specs], dtype=np.int64),
            lengths=tuple(len(part) for part in parts),
        )

    @cached_property
    def category_split(self) -> tuple[int, np.ndarray, np.ndarray]:
        """The steps' categories as ``memory_lanes.LaneStats.of_steps`` sums them: the most frequent category, the
        steps of the others and their one-hot rows ([other steps, categories])."""
        return category_split(self.category)

    def sized(self, graph: Graph, work: float = 0.0) -> StepArray:
        """This plan with ``graph``'s sizes (a graph of the plan's topology), rounded as the allocator rounds them."""
        allocated, reserved = graph.rounded_sizes()
        specs, positions = self.specs, self.positions
        return StepArray(
            allocated[positions] * self.sign,
            reserved[positions] * self.sign,
            self.category,
            lambda i: graph.step(specs[i], int(positions[i])),
            work,
            lambda i: specs[i].op,
        )


PlanSource = Callable[[Graph, tuple[Recipe, ...]], CompiledPlan]
"""Where a walk gets the compiled plan of a graph's topology and recipes: ``CompiledPlan.of``, or the bound memory
model's plans kept per topology (the liveness analysis runs once per layer kind and setting, not per shape)."""


def category_split(category: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """A step array's step categories split for summing bytes per category over many lanes: its most frequent
    category, the indices of the steps of the others and their one-hot rows ([other steps, categories]): the main
    category's bytes are the total less the others'."""
    main = int(np.bincount(category, minlength=len(CATEGORIES)).argmax())
    others = np.flatnonzero(category != main)
    return main, others, np.eye(len(CATEGORIES), dtype=np.int64)[category[others]]

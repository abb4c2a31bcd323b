"""The segments of a micro-batch: what each part of its memory walk allocates and frees, compiled, and their order.

For every micro-batch, in execution order: the embedding, each decoder layer's forward (without grad inside a fully
recomputed layer, with grad otherwise), the LM head and log-prob forward and backward, then each layer's backward in
reverse (preceded by its recompute under full recompute). Each of these is a segment: a ``SegmentSpec`` (a graph of
``memory_ops`` and the recipes of ``memory_graph`` that give its allocations and frees), compiled to a step array
(``allocator.StepArray``) by ``build_segments``, once per micro-batch shape. ``SegmentLayout`` places a shape's
segments in execution order over a stage's layers (``ShapeSegments.order`` fills it: a ``SegmentOrder``), and what
may wrap a micro-batch is a segment too: its held inputs, a pipeline stage's sends and receives, its routed-expert
replay (``moe_routes.replay_mb_tensors``, category ``routed_expert_replay``, freed after its last layer's backward),
the activations 1F1B keeps in flight beside it, and the growth of megatron-core's persistent buffer.

Which tensor is allocated or freed when depends only on a graph's topology, so the liveness analysis of a topology
(``memory_graph.CompiledPlan``) serves every micro-batch shape; the caller supplies it (``PlanSource``: the bound
model keeps one per topology). One definition of the segments for every caller: the walk (``memory_walk``), the
width lanes that evaluate a tile of widths at once (``fast.memory_lanes``, through ``body_specs`` and
``head_specs``), a fitted call's timeline (``fast.memory_fit``) and the bound effects (``bound.memory_effects``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from skyrl_sim.api import DTYPE_BYTES, CallShape, Endpoint, MicroBatch, ModelArch, Stage
from skyrl_sim_plugins.sim.description.moe_routes import moe_layer_dims, replay_mb_tensors
from skyrl_sim_plugins.sim.reference.allocator import CATEGORY_INDEX, Step, StepArray, StepArraySequence
from skyrl_sim_plugins.sim.reference.device_memory import endpoint_allocator
from skyrl_sim_plugins.sim.reference.memory_fsdp import fsdp_segment_graphs
from skyrl_sim_plugins.sim.reference.memory_graph import (
    CompiledPlan,
    Graph,
    PlanSource,
    Recipe,
    backward_recipe,
    forward_recipe,
)
from skyrl_sim_plugins.sim.reference.memory_graph import nbytes as tensor_bytes
from skyrl_sim_plugins.sim.reference.memory_ops import (
    Dims,
    embedding_graph,
    head_graph,
    layer_graph,
    microbatch_inputs,
    reads_row_tokens,
    scores_buffer,
)

REPLAY_LAYER = "routed_expert_replay"  # the timeline's "layer" of a micro-batch's replay setup and release
INPUTS_LAYER = "microbatch_inputs"  # the timeline's "layer" of a micro-batch's mask and rotary table
BUFFER_LAYER = "global_memory_buffer"  # the timeline's "layer" of a persistent buffer's growth
P2P_LAYER = "p2p"  # the timeline's "layer" of a pipeline stage's received activations and gradients
IN_FLIGHT_LAYER = "pipeline_in_flight"  # the timeline's "layer" of other micro-batches' activations held under 1F1B
FORWARD_WORK, RECOMPUTE_WORK, BACKWARD_WORK = 1.0, 1.0, 2.0  # relative cost of a layer's passes per token


@dataclass
class Segment:
    """A compiled step array and where it sits in the call: phase, layer, and how many of its steps are a recompute."""

    array: StepArray
    phase: str
    recompute_steps: int = 0


Slot = tuple[str, tuple[str, bool] | None]  # which step array of a micro-batch: ("forward", layer kind), ("embedding", None)


@dataclass(frozen=True)
class SegmentLayout:
    """A micro-batch's segments in execution order, as slots of its step arrays, each with its layer: embedding, each
    layer's forward, the LM head's forward and backward, each layer's backward in reverse. The same for every
    micro-batch shape of an endpoint (``ShapeSegments.order`` fills it with one shape's step arrays)."""

    positions: list[tuple[Slot, Any]]
    distinct: list[Slot]
    index: np.ndarray  # position -> distinct slot
    layers: list[Any]  # position -> layer (a layer index, "embedding", "lm_head")

    @cached_property
    def order(self) -> list[int]:
        """``index`` as a list (a fitted call's timeline reads it position by position)."""
        return self.index.tolist()

    @classmethod
    def of(
        cls,
        layers: list[int],
        kinds: list[tuple[str, bool]],
        forward_only: bool = False,
        first: bool = True,
        last: bool = True,
    ) -> SegmentLayout:
        """A training pass's positions, or a forward-only pass's (the embedding, the layers, the LM head).

        A pipeline stage that is not the ``first`` receives its input from the previous stage instead of running the
        embedding (``recv_forward``); one that is not the ``last`` sends its output on instead of running the LM head,
        and its backward starts from the gradient the next stage sends back (``recv_backward``; in a forward-only
        pass ``send_forward`` frees the output once sent); after its backward a stage that is not the first sends its
        input's gradient back (``send_backward``), the first frees it (``embedding_grad_released``: the embedding is
        frozen, nothing reads it), and one that is not the last drops its output (``output_released``). In a
        forward-only pass a later stage's received input stays after its first layer frees it (``input_kept``) until
        the micro-batch ends (``input_released``); on the first stage the embedding's output does
        (``decoder_input_kept``) until the decoder returns (``decoder_input_released``, before the LM head)."""
        entry: tuple[Slot, Any] = (("embedding", None), "embedding") if first else (("recv_forward", None), P2P_LAYER)
        positions: list[tuple[Slot, Any]] = [entry]
        positions += [(("forward", kinds[i]), layer) for i, layer in enumerate(layers)]
        if forward_only and not first:  # the received input outlives the first layer (the schedule's references)
            positions.insert(2, (("input_kept", None), P2P_LAYER))
        elif forward_only and layers:  # GPTModel.forward's ``decoder_input`` outlives the first layer, to the decoder's end
            positions.insert(2, (("decoder_input_kept", None), "embedding"))
            positions += [(("decoder_input_released", None), "embedding")]
        if last:
            positions += [(("head_forward", None), "lm_head")]
        elif forward_only:
            positions += [(("send_forward", None), P2P_LAYER)]
        if forward_only and not first:
            positions += [(("input_released", None), P2P_LAYER)]
        if not forward_only:
            positions += [(("head_backward", None), "lm_head") if last else (("recv_backward", None), P2P_LAYER)]
            positions += [(("backward", kinds[i]), layer) for i, layer in reversed(list(enumerate(layers)))]
            if first:  # the embedding's output gradient dies with its (frozen) backward
                positions += [(("embedding_grad_released", None), "embedding")]
            else:
                positions += [(("send_backward", None), P2P_LAYER)]
            if not last:
                positions += [(("output_released", None), P2P_LAYER)]
        return cls.from_positions(positions)

    @classmethod
    def from_positions(cls, positions: list[tuple[Slot, Any]]) -> SegmentLayout:
        """A layout of the given (slot, layer) positions in execution order (``of`` for Megatron's passes,
        ``memory_fsdp.fsdp_positions`` for the FSDP trainer's)."""
        distinct: dict[Slot, int] = {}
        index = [distinct.setdefault(slot, len(distinct)) for slot, _ in positions]
        return cls(positions, list(distinct), np.array(index, dtype=np.int64), [layer for _, layer in positions])


@dataclass
class ShapeSegments:
    """Every segment of one micro-batch shape, and (cached) their order over a stage's layers."""

    embedding: Segment
    forward: dict[tuple[str, bool], Segment]
    head_forward: Segment
    head_backward: Segment | None  # None in a forward-only pass, which has no backward segments
    backward: dict[tuple[str, bool], Segment]
    inputs: tuple[Segment, Segment] | None = None  # made before the embedding, freed after the last backward
    p2p: dict[str, Segment] = field(default_factory=dict)  # a pipeline stage's sends and receives (``p2p_segments``)
    _orders: dict[int, tuple[SegmentLayout, SegmentOrder]] = field(default_factory=dict)

    def segment(self, slot: Slot) -> Segment:
        name, kind = slot
        if name in self.p2p:
            return self.p2p[name]
        if kind is not None:
            return (self.forward if name == "forward" else self.backward)[kind]
        heads = {"head_forward": self.head_forward, "head_backward": self.head_backward}
        found = self.embedding if name == "embedding" else heads[name]
        assert found is not None, f"a forward-only pass has no {name} segment"
        return found

    def order(self, layout: SegmentLayout) -> SegmentOrder:
        """The micro-batch in execution order (``layout`` filled with this shape's segments)."""
        found = self._orders.get(id(layout))
        if found is not None and found[0] is layout:  # held here, so its id cannot be reused
            return found[1]
        distinct = [self.segment(slot) for slot in layout.distinct]
        kinds = [kind for (name, kind), _ in layout.positions if name == "forward"]
        backward = [self.backward[k].array.work for k in kinds if k in self.backward]  # none when forward-only
        work = sum(self.forward[k].array.work for k in kinds) + sum(backward)
        sequence = StepArraySequence([segment.array for segment in distinct], layout.index)
        order = SegmentOrder(distinct, layout.layers, work, sequence)
        if self.inputs is not None:
            order = order.wrapped(*self.inputs, INPUTS_LAYER)
        self._orders[id(layout)] = (layout, order)
        return order


@dataclass
class SegmentOrder:
    """A micro-batch's segments in execution order: ``distinct[sequence.index[i]]`` runs ``i``-th, for layer
    ``layers[i]``; their totals as arrays (``sequence``)."""

    distinct: list[Segment]
    layers: list[Any]
    work: float  # the layers' work (the progress of a failed call is measured against it)
    sequence: StepArraySequence

    @cached_property
    def phase_work(self) -> tuple[float, float]:
        """The work of the micro-batch's forward and of its backward (a recompute inside the backward counted there)."""
        forward = sum(s.array.work for s, _ in self.segments if s.phase == "forward")
        return forward, sum(s.array.work for s, _ in self.segments) - forward

    @cached_property
    def segments(self) -> list[tuple[Segment, Any]]:
        """Each position's segment and layer."""
        return [(self.distinct[i], layer) for i, layer in zip(self.sequence.index.tolist(), self.layers, strict=True)]

    def timeline(self, bases: np.ndarray, count: int, microbatch: int) -> list[dict[str, Any]]:
        """The timeline of the first ``count`` segments, given the allocated bytes before each (and after the last)
        (``timeline_rows``)."""
        phases = [s.phase for s in self.distinct]
        ops = [s.array.peak_op for s in self.distinct]
        after = bases[1 : count + 1].tolist()
        peaks = (bases[:count] + self.sequence.peak_allocated[:count]).tolist()
        index = self.sequence.index[:count].tolist()
        return timeline_rows(microbatch, phases, ops, index, self.layers, after, peaks)

    def inserted(self, segment: Segment, position: int, layer: str) -> SegmentOrder:
        """This order with ``segment`` run before its ``position``-th segment (a persistent buffer's growth at the
        layer that asks for it)."""
        n = len(self.distinct)
        index = np.concatenate([self.sequence.index[:position], [n], self.sequence.index[position:]]).astype(np.int64)
        distinct = [*self.distinct, segment]
        sequence = StepArraySequence([s.array for s in distinct], index)
        layers = [*self.layers[:position], layer, *self.layers[position:]]
        return SegmentOrder(distinct, layers, self.work, sequence)

    def wrapped(self, first: Segment | None, last: Segment | None, layer: str) -> SegmentOrder:
        """This order with a segment before and/or one after it (a micro-batch's routed-expert replay, a persistent
        buffer's growth)."""
        n = len(self.distinct)
        extra = [segment for segment in (first, last) if segment is not None]
        before = [n] if first is not None else []
        after = [n + len(extra) - 1] if last is not None else []
        index = np.concatenate([before, self.sequence.index, after]).astype(np.int64)
        distinct = [*self.distinct, *extra]
        sequence = StepArraySequence([segment.array for segment in distinct], index)
        layers = [layer] * len(before) + self.layers + [layer] * len(after)
        return SegmentOrder(distinct, layers, self.work, sequence)


@dataclass(frozen=True)
class SegmentSpec:
    """One segment of a micro-batch before it is compiled: its slot, the graph and recipes that give its steps, its
    phase, its work per token (the progress of a failed call) and whether its first recipe is a recompute."""

    slot: Slot
    graph: Graph
    recipes: tuple[Recipe, ...]
    phase: str
    work_per_token: float = 0.0
    recompute: bool = False


def segment_specs(
    d: Dims, model: ModelArch, endpoint: Endpoint, layer_keys: set[tuple[str, bool]], forward_only: bool = False
) -> list[SegmentSpec]:
    """Every segment of one micro-batch shape: the body's (``body_specs``) and the LM head's (``head_specs``). One
    definition for the compiled step arrays (``build_segments``) and for the effects of a tile of widths at once
    (``memory_lanes``, which shares a block's body between the logits widths that come with it)."""
    if d.model_code == "hf":  # the FSDP trainer: the Hugging Face model's graphs and FSDP2's units (memory_fsdp)
        return hf_segment_specs(d, model, endpoint, layer_keys, forward_only)
    return body_specs(d, model, endpoint, layer_keys, forward_only) + head_specs(d, model, forward_only)


def hf_segment_specs(
    d: Dims, model: ModelArch, endpoint: Endpoint, layer_keys: set[tuple[str, bool]], forward_only: bool = False
) -> list[SegmentSpec]:
    """The FSDP trainer's segments (``memory_fsdp.fsdp_segment_graphs``), with each layer's work per token."""
    specs = []
    for slot, graph, recipes, phase, recompute in fsdp_segment_graphs(d, model, endpoint, layer_keys, forward_only):
        work = 0.0
        if slot[0] == "forward":
            work = FORWARD_WORK
        elif slot[0] == "backward":
            work = RECOMPUTE_WORK + BACKWARD_WORK if recompute else BACKWARD_WORK
        specs.append(SegmentSpec(slot, graph, recipes, phase, work, recompute))
    return specs


def body_specs(
    d: Dims, model: ModelArch, endpoint: Endpoint, layer_keys: set[tuple[str, bool]], forward_only: bool = False
) -> list[SegmentSpec]:
    """The segments of a micro-batch shape that do not read its logits width: each layer kind's forward and
    backward (with its recompute under full recompute) and the embedding.

    A forward-only pass (a ``forward`` call: Megatron's ``forward_only`` schedule under ``no_grad``, the model in eval
    mode, so no recompute) runs each layer without grad and frees the layer's input when the layer returns."""
    granularity = endpoint.trainer.recompute.granularity
    out = "mlp.residual_add"
    specs: list[SegmentSpec] = []
    for kind, moe in sorted(layer_keys):
        terms = moe_layer_dims(d.rows * d.seq, endpoint, model) if moe else None
        g = layer_graph(d, model, kind, moe, terms)
        if forward_only:
            no_grad = forward_recipe(grad=False, keep=(out,), release=("in",))
            specs.append(SegmentSpec(("forward", (kind, moe)), g, (no_grad,), "forward", FORWARD_WORK))
        elif granularity == "full":
            recompute = forward_recipe(grad=True, keep=(out,))
            bwd = backward_recipe(out, keep_forward=(out,), free_after=("in", out), grad_input="in")
            no_grad = forward_recipe(grad=False, keep=(out,))
            specs.append(SegmentSpec(("forward", (kind, moe)), g, (no_grad,), "forward", FORWARD_WORK))
            work = RECOMPUTE_WORK + BACKWARD_WORK
            specs.append(SegmentSpec(("backward", (kind, moe)), g, (recompute, bwd), "backward", work, recompute=True))
        else:
            selective = granularity == "selective"
            fwd = forward_recipe(grad=True, keep=(out,), selective=selective)
            bwd = backward_recipe(out, keep_forward=(out,), free_after=("in",), grad_input="in", selective=selective)
            specs.append(SegmentSpec(("forward", (kind, moe)), g, (fwd,), "forward", FORWARD_WORK))
            specs.append(SegmentSpec(("backward", (kind, moe)), g, (bwd,), "backward", BACKWARD_WORK))
    emb = embedding_graph(d)
    specs.append(SegmentSpec(("embedding", None), emb, (forward_recipe(grad=False, keep=(emb.output(),)),), "forward"))
    if forward_only:
        # GPTModel.forward keeps the embedding's output in its local ``decoder_input`` until the decoder returns
        # (``megatron/core/models/gpt/gpt_model.py``: ``forward``), so the first layer's release of its input frees
        # nothing: held again after that layer, released before the LM head (a pass with grad keeps it anyway, as the
        # first layer's saved or checkpointed input)
        key, shape = "embedding.decoder_input", (d.sp_seq, d.rows, d.hidden)
        kept = Graph(allocator=d.allocator)
        kept.op(key, shape, d.act, category="saved_activations")
        specs.append(SegmentSpec(("decoder_input_kept", None), kept, (forward_recipe(grad=False, keep=(key,)),), "forward"))
        released = Graph(allocator=d.allocator)
        released.external(key, shape, d.act, "saved_activations")
        recipe = forward_recipe(grad=False, keep=(), release=(key,))
        specs.append(SegmentSpec(("decoder_input_released", None), released, (recipe,), "forward"))
    else:
        # the first layer's backward hands its input's gradient on like any layer's; the embedding is frozen, so its
        # backward only drops it (on the first stage: ``SegmentLayout.of``)
        grad = Graph(allocator=d.allocator)
        grad.external("embedding.output_grad", (d.sp_seq, d.rows, d.hidden), d.act, "transient")
        if d.train_base:  # a trained embedding's gradient [V/tp, h] (embedding_dense_backward), added to main_grad
            vocab = -(-model.vocab_size // d.tp)
            grad.op("embedding.weight_grad", (vocab, d.hidden), d.act, ("embedding.output_grad",), detached=True)
        released = forward_recipe(grad=False, keep=(), release=("embedding.output_grad",))
        specs.append(SegmentSpec(("embedding_grad_released", None), grad, (released,), "backward"))
    return specs


def head_specs(d: Dims, model: ModelArch, forward_only: bool = False) -> list[SegmentSpec]:
    """The LM head's forward and backward (the only segments that read the logits width); a forward-only pass's
    head runs without grad, frees its input (the decoder's output) once the final norm has replaced it, and its
    log-probs when it ends."""
    head = head_graph(d, model)
    last = head.output()
    if forward_only:
        no_grad = forward_recipe(grad=False, keep=(), release=("in",), release_early=True)
        return [SegmentSpec(("head_forward", None), head, (no_grad,), "forward")]
    head_bwd = backward_recipe(last, keep_forward=(last,), free_after=("in", last), grad_input="in", seed_external=False)
    return [
        SegmentSpec(("head_forward", None), head, (forward_recipe(grad=True, keep=(last,)),), "forward"),
        SegmentSpec(("head_backward", None), head, (head_bwd,), "backward"),
    ]


def build_segments(
    d: Dims,
    model: ModelArch,
    endpoint: Endpoint,
    layer_keys: set[tuple[str, bool]],
    plans: PlanSource | None = None,
    forward_only: bool = False,
) -> ShapeSegments:
    """Compile every segment of one micro-batch shape (once per shape; reused across layers and micro-batches).

    ``plans`` gives each graph topology's compiled steps (kept across shapes by the bound model; compiled afresh
    when not given).
    """
    plan_of = plans if plans is not None else CompiledPlan.of
    tokens = float(d.rows * d.seq)
    segments: dict[Slot, Segment] = {}
    for spec in segment_specs(d, model, endpoint, layer_keys, forward_only):
        plan = plan_of(spec.graph, spec.recipes)
        array = plan.sized(spec.graph, spec.work_per_token * tokens)
        segments[spec.slot] = Segment(array, spec.phase, plan.lengths[0] if spec.recompute else 0)
    released = {} if forward_only else {"embedding_grad_released": segments[("embedding_grad_released", None)]}
    standard = {"embedding", "forward", "backward", "head_forward", "head_backward"}
    named = {name: seg for (name, _), seg in segments.items() if name not in standard}  # FSDP's units, log-probs
    return ShapeSegments(
        embedding=segments[("embedding", None)],
        forward={kind: seg for (name, kind), seg in segments.items() if name == "forward" and kind is not None},
        head_forward=segments[("head_forward", None)],
        head_backward=segments.get(("head_backward", None)),
        backward={kind: seg for (name, kind), seg in segments.items() if name == "backward" and kind is not None},
        inputs=input_segments(d, model, forward_only),
        p2p={**p2p_segments(d), **released, **named},
    )


def p2p_segments(d: Dims) -> dict[str, Segment]:
    """A pipeline stage's point-to-point tensors, each ``[s, b, h]`` (the sequence split over TP under sequence
    parallelism, as megatron-core's ``get_tensor_shapes`` sizes them) in the activation dtype.

    ``recv_forward``: the previous stage's output, received into a new buffer that stands for the embedding's output
    (the first layer saves it; its backward frees it). ``recv_backward``: the next stage's gradient of this stage's
    output, the seed of the last layer's backward (which frees it). ``send_backward``: after the first layer's
    backward, the gradient of the received input is sent back and freed. ``output_released``: the stage's output,
    which megatron-core keeps in its ``output_tensors`` until the micro-batch's backward (``deallocate_pipeline_outputs``
    off, its default), is dropped. ``send_forward`` (forward-only): the output is freed once sent.

    ``input_grad_held`` / ``input_grad_released``: the input gradient a later stage sent back for the previous
    micro-batch, still referenced by the schedule's ``input_tensor_grad`` until the next ``backward_step`` returns (a
    Python local of megatron-core's 1F1B loop): held over the next micro-batch of the stage, freed at its end.
    Forward-only: ``input_kept`` / ``input_released``, the received input, referenced by the loop's ``input_tensor``
    and the model's ``set_input_tensor`` until the next micro-batch's forward, so held again after the first layer
    frees it, to the micro-batch's end; ``output_held`` / ``output_dropped``, the previous micro-batch's output, which
    the loop's ``output_tensor`` keeps until the next ``forward_step`` returns.
    (``embedding_grad_released``, the first stage's counterpart of ``send_backward``, is a body segment:
    ``body_specs``, as are a forward-only pass's ``decoder_input_kept`` / ``decoder_input_released``.)
    """
    shape = (d.sp_seq, d.rows, d.hidden)
    size = tensor_bytes(shape, d.act)
    rule = d.allocator
    allocated, reserved = rule.allocated(size), rule.reserved(size)
    saved, transient = CATEGORY_INDEX["saved_activations"], CATEGORY_INDEX["transient"]

    def step(name: str, sign: int, category: int) -> Step:
        return Step(name, sign * allocated, sign * reserved, category, name, shape, d.act)

    def segment(phase: str, *steps: Step) -> Segment:
        return Segment(StepArray.compile(list(steps)), phase)

    return {
        "recv_forward": segment("forward", step("p2p.recv_forward", 1, saved)),
        "send_forward": segment("forward", step("p2p.send_forward", -1, saved)),
        "recv_backward": segment("backward", step("p2p.recv_backward", 1, transient)),
        "send_backward": segment("backward", step("p2p.send_backward", -1, transient)),
        "output_released": segment("backward", step("p2p.output_released", -1, saved)),
        "input_grad_held": segment("forward", step("p2p.previous_input_grad", 1, transient)),
        "input_grad_released": segment("backward", step("p2p.previous_input_grad", -1, transient)),
        "input_kept": segment("forward", step("p2p.input_kept", 1, saved)),
        "input_released": segment("forward", step("p2p.input_kept", -1, saved)),
        "output_held": segment("forward", step("p2p.previous_output", 1, transient)),
        "output_dropped": segment("forward", step("p2p.previous_output", -1, transient)),
    }


def input_segments(d: Dims, model: ModelArch, forward_only: bool = False) -> tuple[Segment, Segment] | None:
    """A micro-batch's held inputs (``memory_ops.microbatch_inputs``): allocated before its embedding, freed after
    its last layer's backward (a forward-only pass: after its LM head). None when the layer spec makes none."""
    tensors = microbatch_inputs(d, model) if d.model_code != "hf" else ()  # the FSDP trainer's: its own segments
    if not tensors:
        return None
    category = CATEGORY_INDEX["transient"]
    rule = d.allocator
    end = "forward" if forward_only else "backward"

    def step(name: str, shape: tuple[int, ...], dtype: str, sign: int) -> Step:
        size = tensor_bytes(shape, dtype)
        return Step(name, sign * rule.allocated(size), sign * rule.reserved(size), category, name, shape, dtype)

    setup = [step(name, shape, dtype, 1) for name, shape, dtype in tensors]
    release = [step(name, shape, dtype, -1) for name, shape, dtype in tensors]
    return Segment(StepArray.compile(setup), "forward"), Segment(StepArray.compile(release), end)


def replay_segments(
    slots: int, endpoint: Endpoint, model: ModelArch, stage: Stage | None = None
) -> tuple[Segment, Segment] | None:
    """A micro-batch's routed-expert replay: the setup before its embedding and the release after its last backward.
    On a pipeline ``stage`` the compact ids are that stage's slice of the MoE layers.

    None for a dense model or with replay off. Transient tensors die as the next one is made from them, inside the
    setup; ids that live until the schedule ends (``moe_routes.ids_lifetime``) are not released after the micro-batch,
    so the call's later micro-batches find them held.
    """
    if model.moe is None:
        return None
    tensors = replay_mb_tensors(slots, endpoint, model, None if stage is None else stage.layers)
    if not tensors:
        return None

    rule = endpoint_allocator(endpoint)

    def step(name: str, nbytes: int, sign: int, held: bool, shape: tuple[int, ...], dtype: str) -> Step:
        category = CATEGORY_INDEX["routed_expert_replay" if held else "transient"]
        return Step(name, sign * rule.allocated(nbytes), sign * rule.reserved(nbytes), category, name, shape, dtype)

    setup: list[Step] = []
    previous = None  # a transient dies as soon as the next tensor is made from it
    for t in tensors:
        setup.append(step(t.name, t.nbytes, 1, t.held, t.shape, t.dtype))
        if previous is not None:
            setup.append(step(previous.name, previous.nbytes, -1, False, previous.shape, previous.dtype))
        previous = t if not t.held else None
    release = [step(t.name, t.nbytes, -1, True, t.shape, t.dtype) for t in tensors if t.lifetime == "microbatch"]
    return Segment(StepArray.compile(setup), "forward"), Segment(StepArray.compile(release), "backward")


def in_flight_residue(order: SegmentOrder, replay: tuple[Segment, Segment] | None) -> tuple[int, int]:
    """What a micro-batch leaves allocated (and reserved) between its forward and its backward: the sum of its
    forward-phase segments (held inputs, embedding or received input, the layers' saved activations, its replayed
    expert ids), which 1F1B keeps while the stage runs other micro-batches."""
    segments = [s for s, _ in order.segments if s.phase == "forward"]
    if replay is not None:
        segments.append(replay[0])
    return sum(s.array.end_allocated for s in segments), sum(s.array.end_reserved for s in segments)


def in_flight_segments(residues: list[tuple[int, int]], endpoint: Endpoint) -> tuple[Segment, Segment]:
    """The activations of the other micro-batches a 1F1B stage holds while one micro-batch runs, as one hold before
    it and one release after it. Each micro-batch's is held while this one's backward runs: the later ones (warm-up
    forwards ahead of it in the schedule), fewer in the drain. Category ``saved_activations``."""
    allocated = sum(r[0] for r in residues)
    reserved = sum(r[1] for r in residues)
    category = CATEGORY_INDEX["saved_activations"]
    op = f"pipeline.in_flight_activations[{len(residues)} micro-batches]"
    hold = Step("pipeline.in_flight", allocated, reserved, category, op, (), endpoint.trainer.params_dtype)
    release = Step("pipeline.in_flight", -allocated, -reserved, category, op, (), endpoint.trainer.params_dtype)
    return Segment(StepArray.compile([hold]), "forward"), Segment(StepArray.compile([release]), "backward")


def growth_position(layers: list[Any], growth: Segment, model: ModelArch) -> int:
    """Where a micro-batch's buffer growth runs: before everything (0) when its first layer asks for the buffer, else
    at the forward of the first full-attention layer that makes the scores request (a hybrid whose first layers are
    gated DeltaNet: the buffer does not exist while they run)."""
    if not shifted_growth(growth, model):
        return 0
    for position, layer in enumerate(layers):
        if isinstance(layer, int) and model.layer_types[layer] == "full_attention":
            return position
    return 0


def shifted_growth(growth: Segment, model: ModelArch) -> bool:
    """Whether a buffer growth is the attention scores' request of a model whose first layer is no full attention."""
    return growth.array.step(0).op.endswith("matmul_input_buffer") and model.layer_types[0] != "full_attention"


def buffer_growth(
    held: dict[str, int], d: Dims, model: ModelArch, endpoint: Endpoint | None = None
) -> tuple[Segment | None, dict[str, int]]:
    """The growth of megatron-core's persistent ``GlobalMemoryBuffer`` a micro-batch of these dims causes, and the
    buffers held after it.

    ``get_tensor`` allocates a new buffer of the requested size when the one it holds is smaller, then drops the old
    one: both are briefly alive. The new buffer is never freed (it stays for every later call of the process). The
    growth is walked before the micro-batch's embedding (in the real model it happens at the first attention layer's
    forward, or an MoE layer's dispatch: the same allocation, a few of the layer's tensors earlier). None when nothing
    grows. ``endpoint``: an MoE model's all-gather dispatcher gathers its tokens into the same buffer under TP or EP.
    A hybrid's scores request comes at its first full-attention layer: the walk runs the growth there
    (``growth_position``).
    """
    gathered = 0
    if model.moe is not None and endpoint is not None:
        moe = moe_layer_dims(d.rows * d.seq, endpoint, model)
        gathered = moe.gathered if moe.gathered != moe.tokens else 0
    request = scores_buffer(d, model, gathered)
    if request is None:
        return None, held
    name, shape, dtype = request
    rule = d.allocator
    size = rule.allocated(tensor_bytes(shape, dtype))
    old = held.get(name, 0)
    if size <= old:
        return None, held
    category = CATEGORY_INDEX["persistent_buffers"]
    # the scores' [b * heads, s, s] input, or the MoE dispatcher's [tokens, hidden] gather
    op = "self_attention.core_attention.matmul_input_buffer" if len(shape) == 3 else "mlp.dispatch.gather_tokens"
    steps = [Step(name, size, rule.reserved(size), category, op, shape, dtype)]
    if old:
        steps.append(Step(name, -old, -rule.reserved(old), category, op, (old // DTYPE_BYTES[dtype],), dtype))
    return Segment(StepArray.compile(steps), "forward"), {**held, name: size}


def timeline_rows(
    microbatch: int,
    phases: list[str],
    ops: list[tuple[str, int]],
    index: list[int],
    layers: list[Any],
    after: list[int],
    peaks: list[int],
) -> list[dict[str, Any]]:
    """A micro-batch's timeline, one row per position (as far as ``index`` goes): the phase and layer of the segment
    ``index[i]`` that ran there, the op and bytes of the allocation at which it peaks (``ops``), the allocated total
    after it and its peak."""
    return [
        {
            "microbatch": microbatch,
            "phase": phases[i],
            "layer": layer,
            "op": ops[i][0],
            "bytes": ops[i][1],
            "allocated": end,
            "peak": peak,
        }
        for i, layer, end, peak in zip(index, layers, after, peaks, strict=False)
    ]


def microbatch_dims(mb: MicroBatch, shape: CallShape, endpoint: Endpoint, model: ModelArch) -> Dims:
    """The dims of a micro-batch of a call (a packed one runs its sequences as one row)."""
    rows, seq = (1, mb.width) if mb.packed else (mb.rows, mb.width)
    masked = not mb.packed and any(tokens < mb.width for tokens in mb.all_row_tokens)  # a left-padded row
    short = short_rows(mb, endpoint)
    return Dims.of(endpoint, model, rows, seq, shape.logits_width, shape.rl_path, masked, short)


def short_rows(mb: MicroBatch, endpoint: Endpoint) -> tuple[int, ...]:
    """How many tokens each row of the micro-batch is short of its width, in its row order (its rows, then its dummy
    rows: the real backend's ``batch.build_microbatches`` orders them so), where the LM head reads each row's tokens
    (``memory_ops.reads_row_tokens``); () where it does not, for a packed micro-batch, and when every row is the
    micro-batch's width. Part of a micro-batch shape's key wherever its segments are kept (``shape_key``)."""
    if mb.packed or not reads_row_tokens(endpoint):
        return ()
    width = mb.width
    short = tuple([width - tokens for tokens in mb.all_row_tokens])
    return short if any(short) else ()


ShapeKey = tuple[int, int, bool, tuple[int, ...]]
"""A micro-batch shape's key (``shape_key``): rows, width, packing, its rows' shortfalls (``short_rows``)."""


def shape_key(mb: MicroBatch, endpoint: Endpoint) -> ShapeKey:
    """What decides a micro-batch's segments: its rows, width, packing and (where the head reads them) its rows'
    tokens (``short_rows``)."""
    return (mb.rows, mb.width, mb.packed, short_rows(mb, endpoint))

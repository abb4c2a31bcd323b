"""The FSDP trainer's micro-batch, the reference: its segments in execution order, with FSDP2's units in flight.

What one micro-batch of SkyRL's FSDP trainer allocates and frees (the graphs are ``memory_ops_hf``'s), and when
torch's ``fully_shard`` gathers and frees each unit (``description.trainers.fsdp_units``), as the real trainer does on
one rank (``megatron_vllm.fsdp_trainer``; ``scripts/trace_call_memory.py --endpoint tiny-cpu-fsdp`` shows both):

* forward: the root unit (the output layer and final norm) is all-gathered first and stays until the model's forward
  returns (``FSDPState._root_pre_forward``; its ``post_forward`` reshards it like any unit); the input embedding's unit
  around the lookup; each layer's unit around its forward (``reshard_after_forward``; kept to its backward when
  false); the root's reshard between ``lm_head`` and the worker's log-probs;
* backward: the log-probs' backward, the root gathered again for ``lm_head``'s backward and kept to the end of the
  backward (its ``post_backward`` runs last); each layer's unit gathered before its recompute and backward and freed
  after them, its trainable parameters' gradients (unsharded, the compute dtype) and the reduce-scatter's input
  (``foreach_reduce``, the reduce dtype; world > 1) made and freed at its end; the embedding's unit gathered for
  its backward (its output requires grad: peft's ``enable_input_require_grads``, or every weight trains);
* the worker's ``output`` keeps the logits until the micro-batch's backward returns (``logits_released``).

With more than one rank a unit's all-gather also makes a flat output of the whole unit (``foreach_all_gather``),
freed once it is copied into the parameters (in forward only at the next unit's copy-out: ``wait_for_unshard``), and
the next layer's unit is all-gathered ahead in backward (FSDP2's backward prefetch of one unit).
"""

from __future__ import annotations

from typing import Any

from skyrl_sim.api import Endpoint, ModelArch
from skyrl_sim_plugins.sim.description.trainers import FsdpUnit, fsdp_units
from skyrl_sim_plugins.sim.reference.memory_graph import Graph, Recipe, backward_recipe, forward_recipe
from skyrl_sim_plugins.sim.reference.memory_ops import Dims
from skyrl_sim_plugins.sim.reference.memory_ops_hf import (
    hf_embedding_graph,
    hf_head_graph,
    hf_layer_graph,
    hf_logprob_graph,
    hf_microbatch_inputs,
)

FSDP_LAYER = "fsdp"  # the timeline's "layer" of a unit's gather, free and gradient reduction
BACKWARD = "_in_backward"  # a unit segment's slot when it runs in the backward (the same steps, the backward's phase)
Position = tuple[tuple[str, Any], Any]


def fsdp_positions(
    layers: list[int],
    kinds: list[tuple[str, bool]],
    forward_only: bool,
    embedding_unit: bool,
    keep_units: bool,
    flat: bool = False,
) -> list[Position]:
    """A micro-batch's segments in execution order (see the module doc). ``embedding_unit``: the input embedding is
    its own unit (untied embeddings); ``keep_units``: ``reshard_after_forward`` false (each layer's unit stays from
    its forward to its backward); ``flat``: more than one rank, so each all-gather makes a flat output first."""
    f = FSDP_LAYER

    def seg(name: str, layer: Any = f) -> Position:
        return ((name, None), layer)

    def gather(unit: str, previous: str | None = None) -> list[Position]:
        """A unit's all-gather in forward: its flat output (kept until the next unit's copy-out), the previous
        unit's flat output freed, its parameters copied out."""
        out = [seg(f"fsdp_{unit}_flat")] if flat else []
        if flat and previous:
            out.append(seg(f"fsdp_{previous}_flat_released"))
        return [*out, seg(f"fsdp_{unit}_unshard")]

    out: list[Position] = [seg("hf_inputs", "inputs"), *gather("root")]
    previous = "root"
    if embedding_unit:
        out += [*gather("embedding", previous), seg("embedding", "embedding"), seg("fsdp_embedding_reshard")]
        previous = "embedding"
    else:
        out.append(seg("embedding", "embedding"))
    for i, layer in enumerate(layers):
        out += gather("layer", previous)
        previous = "layer"
        out.append((("forward", kinds[i]), layer))
        if not keep_units or forward_only:
            out.append(seg("fsdp_layer_reshard"))
        if forward_only and i:  # the loop's ``hidden_states`` drops the previous layer's output
            out.append(seg("hidden_released", layer))
    if forward_only:  # LlamaModel.forward returns: its locals (the embedding's output, the mask, the rotary) go
        out += [seg("hidden_released", "embedding"), seg("hf_inputs_released", "inputs")]
    out += [seg("head_forward", "lm_head"), seg("fsdp_root_reshard")]
    if flat:  # the last flat output goes with the root's post-forward
        out.append(seg(f"fsdp_{previous}_flat_released"))
    out.append(seg("logprob_forward", "logprobs"))
    if forward_only:
        return [*out, seg("logits_released", "logprobs")]

    def regather(unit: str) -> list[Position]:
        """A unit's all-gather in backward: the flat output (prefetched, or made now) freed once copied out."""
        gathered = [seg(f"fsdp_{unit}_unshard{BACKWARD}")]
        return [*gathered, seg(f"fsdp_{unit}_flat_released{BACKWARD}")] if flat else gathered

    out.append(seg("logprob_backward", "logprobs"))
    out += ([seg(f"fsdp_root_flat{BACKWARD}")] if flat else []) + regather("root") + [seg("head_backward", "lm_head")]
    for position, (i, layer) in enumerate(reversed(list(enumerate(layers)))):
        if not keep_units:
            if flat and position == 0:  # the first layer's all-gather; the others were prefetched
                out.append(seg(f"fsdp_layer_flat{BACKWARD}"))
            out += regather("layer")
        if flat and i > 0:  # FSDP2's backward prefetch: the next layer's all-gather, ahead
            out.append(seg(f"fsdp_layer_flat{BACKWARD}"))
        elif flat and embedding_unit:
            out.append(seg(f"fsdp_embedding_flat{BACKWARD}"))
        out.append((("backward", kinds[i]), layer))
        out += [seg("fsdp_layer_reduce"), seg(f"fsdp_layer_reshard{BACKWARD}")]
    if embedding_unit:
        out += regather("embedding")
    out.append(seg("embedding_grad_released", "embedding"))
    if embedding_unit:
        out += [seg("fsdp_embedding_reduce"), seg(f"fsdp_embedding_reshard{BACKWARD}")]
    out += [seg("fsdp_root_reduce"), seg(f"fsdp_root_reshard{BACKWARD}"), seg("logits_released", "logprobs")]
    return [*out, seg("hf_inputs_released", "inputs")]


def _unit_specs(unit: FsdpUnit, dtype: str, reduce_dtype: str, d: Dims) -> dict[str, tuple[Graph, Recipe]]:
    """One unit's parameters copied out and freed, its flat all-gather output made and freed, and its gradient
    reduction (its unsharded gradients and the reduce-scatter input, made and freed), as graphs of one op each."""
    name, elements = f"fsdp.{unit.name}", max(1, unit.unsharded // _bytes(dtype))
    specs: dict[str, tuple[Graph, Recipe]] = {}
    for what, key in (("unshard", "unsharded_params"), ("flat", "all_gather_output")):
        made = Graph(category="fsdp_units", allocator=d.allocator)
        made.op(f"{name}.{key}", (elements,), dtype, detached=True)
        freed = Graph(category="fsdp_units", allocator=d.allocator)
        freed.external(f"{name}.{key}", (elements,), dtype, "fsdp_units", requires_grad=False)
        released = "reshard" if what == "unshard" else "flat_released"
        specs[f"fsdp_{unit.name}_{what}"] = (made, forward_recipe(grad=False, keep=(f"{name}.{key}",)))
        specs[f"fsdp_{unit.name}_{released}"] = (freed, forward_recipe(grad=False, keep=(), release=(f"{name}.{key}",)))
    reduce = Graph(category="fsdp_units", allocator=d.allocator)
    grads = max(0, unit.grad_unsharded // _bytes(dtype))
    scatter = unit.reduce_scatter // _bytes(reduce_dtype) if unit.reduce_scatter else 0
    if grads or scatter:
        temps = (("unsharded_grads", (grads,), dtype),) if grads else ()
        reduce.op(f"{name}.reduce_scatter_input", (scatter,), reduce_dtype, temps=temps, detached=True)
    else:  # nothing of the unit trains (a frozen output layer under LoRA): no step
        reduce.external(f"{name}.nothing_to_reduce", (0,), reduce_dtype, "fsdp_units", requires_grad=False)
    specs[f"fsdp_{unit.name}_reduce"] = (reduce, forward_recipe(grad=False, keep=()))
    return specs


def _bytes(dtype: str) -> int:
    from skyrl_sim.api import DTYPE_BYTES

    return DTYPE_BYTES[dtype]


def fsdp_segment_graphs(
    d: Dims, model: ModelArch, endpoint: Endpoint, layer_keys: set[tuple[str, bool]], forward_only: bool
) -> list[tuple[tuple[str, Any], Graph, tuple[Recipe, ...], str, bool]]:
    """Every segment of one micro-batch shape of the FSDP trainer: (slot, graph, recipes, phase, recompute)."""
    granularity = endpoint.trainer.recompute.granularity
    out: list[tuple[tuple[str, Any], Graph, tuple[Recipe, ...], str, bool]] = []

    def add(slot: tuple[str, Any], graph: Graph, recipes: tuple[Recipe, ...], phase: str, recompute: bool = False) -> None:
        out.append((slot, graph, recipes, phase, recompute))

    inputs = Graph(allocator=d.allocator)
    released = Graph(allocator=d.allocator)
    names = []
    for name, shape, dtype in hf_microbatch_inputs(d, model):
        names.append(inputs.op(name, shape, dtype, detached=True))
        released.external(name, shape, dtype, "transient", requires_grad=False)
    add(("hf_inputs", None), inputs, (forward_recipe(grad=False, keep=tuple(names)),), "forward")
    end = "forward" if forward_only else "backward"
    add(("hf_inputs_released", None), released, (forward_recipe(grad=False, keep=(), release=tuple(names)),), end)
    hidden = Graph(allocator=d.allocator)
    hidden.external("hidden_states", (d.rows, d.seq, d.hidden), d.act, "saved_activations", requires_grad=False)
    add(("hidden_released", None), hidden, (forward_recipe(grad=False, keep=(), release=("hidden_states",)),), "forward")
    result = "mlp.residual_add"
    for key in sorted(layer_keys):
        g = hf_layer_graph(d, model, d.lora_targets)
        if forward_only:  # no_grad: the layer's input is the loop's to drop (``hidden_released``)
            add(("forward", key), g, (forward_recipe(grad=False, keep=(result,)),), "forward")
        elif granularity != "none":  # gradient checkpointing: no-grad forward, recompute and backward
            bwd = backward_recipe(result, keep_forward=(result,), free_after=("in", result), grad_input="in")
            add(("forward", key), g, (forward_recipe(grad=False, keep=(result,)),), "forward")
            add(("backward", key), g, (forward_recipe(grad=True, keep=(result,)), bwd), "backward", True)
        else:
            bwd = backward_recipe(result, keep_forward=(result,), free_after=("in",), grad_input="in")
            add(("forward", key), g, (forward_recipe(grad=True, keep=(result,)),), "forward")
            add(("backward", key), g, (bwd,), "backward")
    emb = hf_embedding_graph(d)
    add(("embedding", None), emb, (forward_recipe(grad=False, keep=(emb.output(),)),), "forward")
    vocab = model.vocab_size
    head = hf_head_graph(d, model, vocab)
    logits = head.output()
    if forward_only:
        add(("head_forward", None), head, (forward_recipe(grad=False, keep=(logits,), release=("in",)),), "forward")
    else:
        add(("head_forward", None), head, (forward_recipe(grad=True, keep=(logits,)),), "forward")
        head_bwd = backward_recipe(logits, keep_forward=(logits,), free_after=("in",), grad_input="in")
        add(("head_backward", None), head, (head_bwd,), "backward")
    logprob = hf_logprob_graph(d, vocab, entropy=not forward_only)
    loss = logprob.output()
    if forward_only:
        add(("logprob_forward", None), logprob, (forward_recipe(grad=False, keep=()),), "forward")
    else:
        add(("logprob_forward", None), logprob, (forward_recipe(grad=True, keep=(loss,)),), "forward")
        lp_bwd = backward_recipe(loss, keep_forward=(loss,), free_after=(loss,), grad_input="in", seed_external=False)
        add(("logprob_backward", None), logprob, (lp_bwd,), "backward")
        grad = Graph(allocator=d.allocator)
        grad.external("embedding.output_grad", (d.rows, d.seq, d.hidden), d.act, "transient")
        released = forward_recipe(grad=False, keep=(), release=("embedding.output_grad",))
        add(("embedding_grad_released", None), grad, (released,), "backward")
    kept = Graph(category="logits", allocator=d.allocator)
    kept.external("lm_head.logits", (d.rows, d.seq, vocab), d.act, "logits", requires_grad=False)
    release = forward_recipe(grad=False, keep=(), release=("lm_head.logits",))
    add(("logits_released", None), kept, (release,), "forward" if forward_only else "backward")
    units = fsdp_units(model, endpoint)
    reduce_dtype = endpoint.trainer.fsdp.reduce_dtype
    for unit in (units.layer, units.root, *((units.embedding,) if units.embedding is not None else ())):
        for name, (graph, recipe) in _unit_specs(unit, d.act, reduce_dtype, d).items():
            if name.endswith("_reduce"):
                add((name, None), graph, (recipe,), "backward")
                continue
            add((name, None), graph, (recipe,), "forward")
            add((name + BACKWARD, None), graph, (recipe,), "backward")
    return out

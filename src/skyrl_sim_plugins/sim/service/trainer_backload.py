"""The trainer's backload piece by piece, in the order SkyRL's ``backload_to_gpu`` allocates it, so that a backload
that does not fit runs out at the allocation that crosses the device's free memory, as PyTorch's message names it.

SkyRL 0.4.0 reloads an offloaded trainer rank in this order (``worker_dispatch.py``: ``_ensure_on_gpu`` calls the
strategy's ``backload_to_gpu``):

- **Megatron** (``megatron_strategy.py``: ``MegatronStrategy.backload_to_gpu``):

  1. the model (``megatron_utils.py``: ``load_megatron_model_to_gpu``): full fine-tuning reloads each DDP buffer's
     ``param_data`` (megatron-core ``param_and_grad_buffer.py``: ``_ParamAndGradBuffer.reload_from_cpu``, one
     ``storage().resize_`` of the whole buffer: the dense buffer, then the expert-parallel one of an MoE model).
     With LoRA the buffers (the adapters) never left; the frozen base weights come back one parameter at a time
     (``param._offload_cpu_data.to(device_id)``), in ``named_parameters()`` order.
  2. the gradients (``load_megatron_grads_to_gpu``: DDP's ``restore_grad_buffers``, ``reload_from_cpu(
     move_grads=True)``): one ``grad_data`` resize per buffer, the buckets being views of it.
  3. the optimizer (``load_megatron_optimizer``): first the fp32 main parameters, one tensor per parameter's shard
     (``load_megatron_copy_params``: ``shard_fp32_from_float16_groups``), then each parameter's ``exp_avg`` and
     ``exp_avg_sq`` in turn (``optimizer.state.values()``).

- **FSDP** (``fsdp_strategy.py``: ``FSDPStrategy.backload_to_gpu``): the model (``fsdp_utils.py``:
  ``load_fsdp2_model_to_gpu``, ``model.to(device)``: torch's ``Module._apply`` moves each parameter's shard and then
  its gradient, if it has one), then the optimizer (``load_fsdp_optimizer``: per parameter of the param groups, each
  tensor of its state: ``exp_avg`` and ``exp_avg_sq``).

The sizes are the trainer's state terms (``description.trainers``: ``megatron_terms``, ``fsdp_terms``), split into
the tensors the code above allocates. What is approximate, and why:

- Megatron's per-parameter tensors are the model's Hugging Face tensors (``weight_tensors.model_tensors``: q, k and v
  apart where Megatron fuses them into ``linear_qkv``, gate and up apart where it fuses ``linear_fc1``), a tensor of
  at most ``hidden_size`` elements (a norm) replicated across TP and every other one split over TP; a main
  parameter's or moment's shard is its tensor over DP (the distributed optimizer's shards are contiguous ranges of
  the buffer, so a rank's first and last shards are partial). They are taken in order until the term's bytes are
  used, the last one cut to fit (with pipeline or expert parallelism the list is the whole model's, not the
  rank's, so the order of its pieces is approximate).
- LoRA's optimizer part under Megatron (the adapters' gradient buffer, main parameters and moments) is one piece:
  the adapters are small beside the base model.
- torch's AdamW keeps ``step`` as a one-element tensor, which ``load_fsdp_optimizer`` moves too; its 512-byte
  blocks are not counted, as the state terms do not count them.

Consecutive identical pieces are grouped (``Piece.count``), so a model of many equal layers is a few groups, and the
pieces are only computed when a backload does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyrl_sim.api import DTYPE_BYTES, Endpoint, ModelArch, stage_layers
from skyrl_sim_plugins.sim.description.trainers import (
    ADAM_MOMENTS,
    FP32,
    fsdp_terms,
    hf_end_params,
    hf_layer_params,
    hf_lora_modules,
    lora_params_per_rank,
    megatron_terms,
    shard_numel,
)
from skyrl_sim_plugins.sim.service.inference.weight_tensors import model_tensors


@dataclass(frozen=True)
class Piece:
    """``count`` consecutive allocations of ``nbytes`` each, what they are (``what``)."""

    what: str
    nbytes: int
    count: int = 1


@dataclass(frozen=True)
class ShortPiece:
    """The first allocation of a backload that does not fit: what it is, its size, and what the backload had
    already placed on the device before it."""

    what: str
    attempted: int
    placed: int


def _grouped(pieces: list[Piece]) -> list[Piece]:
    """Consecutive pieces of the same size and kind as one group."""
    out: list[Piece] = []
    for p in pieces:
        if p.count <= 0 or p.nbytes <= 0:
            continue
        if out and out[-1].what == p.what and out[-1].nbytes == p.nbytes:
            out[-1] = Piece(p.what, p.nbytes, out[-1].count + p.count)
        else:
            out.append(p)
    return out


def _cut(what: str, sizes: list[int], total: int) -> list[Piece]:
    """``sizes`` in order until ``total`` bytes are used (the last one cut to fit); what is left over is one last
    piece."""
    out: list[Piece] = []
    left = total
    for size in sizes:
        if left <= 0:
            break
        out.append(Piece(what, min(size, left)))
        left -= size
    if left > 0:
        out.append(Piece(what, left))
    return out


def _megatron_tensor_elements(model: ModelArch, endpoint: Endpoint) -> list[int]:
    """One TP rank's parameters in elements, in the model's order (see the module doc for what is approximate)."""
    tp, h = endpoint.parallelism.tp, model.hidden_size
    return [e if e <= h else -(-e // tp) for e in model_tensors(model, 1)]


def _megatron_expert_share(model: ModelArch, endpoint: Endpoint) -> float:
    """The share of the rank's weights in the expert-parallel DDP buffer (megatron-core's DDP keeps the routed
    experts' parameters in ``expert_parallel_buffers``, after the dense ``buffers``)."""
    if model.moe is None:
        return 0.0
    p = endpoint.parallelism
    per_expert = 3 * model.hidden_size * model.moe.expert_ffn_hidden_size
    layers = [i for i in stage_layers(model, endpoint) if model.is_moe_layer(i)]
    experts = len(layers) * -(-model.moe.num_experts // p.ep) * per_expert / p.tp
    weights = next(t.nbytes for t in megatron_terms(model, endpoint) if t.category == "weights")
    return min(1.0, experts * DTYPE_BYTES[endpoint.trainer.params_dtype] / weights) if weights else 0.0


def _buffers(what: str, nbytes: int, expert_share: float) -> list[Piece]:
    """A DDP buffer kind as its allocations: the dense buffer, then the expert-parallel one."""
    experts = int(nbytes * expert_share)
    return [Piece(what, nbytes - experts), Piece(what, experts)]


def megatron_pieces(model: ModelArch, endpoint: Endpoint, model_part: bool, optimizer_part: bool) -> list[Piece]:
    """Megatron's backload in allocation order (``MegatronStrategy.backload_to_gpu``; see the module doc)."""
    terms = {t.category: t.nbytes for t in megatron_terms(model, endpoint)}
    pbytes = DTYPE_BYTES[endpoint.trainer.params_dtype]
    elements = _megatron_tensor_elements(model, endpoint)
    pieces: list[Piece] = []
    if not endpoint.full_fine_tune:
        if model_part:  # load_megatron_model_to_gpu: the frozen base weights, one parameter at a time
            pieces += _cut("a frozen weight", [e * pbytes for e in elements], terms["weights"])
        if optimizer_part:  # the adapters' gradient buffer, main parameters and moments: one piece (module doc)
            lora_dtype = DTYPE_BYTES[endpoint.lora.dtype or endpoint.trainer.params_dtype]
            kept = lora_params_per_rank(model, endpoint, stage_layers(model, endpoint)) * lora_dtype  # stay resident
            pieces.append(Piece("the adapters' gradients and optimizer state", terms.get("adapters", 0) - kept))
        return _grouped(pieces)
    share = _megatron_expert_share(model, endpoint)
    if model_part:  # _ParamAndGradBuffer.reload_from_cpu(move_params=True): param_data, one buffer at a time
        pieces += _buffers("the DDP parameter buffer", terms["weights"], share)
    if optimizer_part:
        pieces += _buffers("the DDP gradient buffer", terms.get("gradients", 0), share)  # restore_grad_buffers
        dp = endpoint.parallelism.dp
        shards = [-(-e // dp) for e in elements]
        pieces += _cut("an fp32 main parameter", [s * FP32 for s in shards], terms.get("master_weights", 0))
        moments = [s * FP32 for s in shards for _ in range(ADAM_MOMENTS // FP32)]  # exp_avg, exp_avg_sq
        pieces += _cut("an Adam moment", moments, terms.get("optimizer_state", 0))
    return _grouped(pieces)


def fsdp_pieces(model: ModelArch, endpoint: Endpoint, model_part: bool, optimizer_part: bool) -> list[Piece]:
    """FSDP's backload in allocation order (``FSDPStrategy.backload_to_gpu``): each parameter's fp32 shard and its
    gradient's (``Module._apply``), then each trained parameter's two moments (``load_fsdp_optimizer``)."""
    if endpoint.trainer.fsdp.cpu_offload:
        return []
    world, full = endpoint.parallelism.dp, endpoint.full_fine_tune
    layer = hf_layer_params(model, endpoint.lora.rank, hf_lora_modules(endpoint, model))
    ends = hf_end_params(model)
    params = ends[:1] + layer * model.num_layers + ends[1:]  # embed_tokens, the layers, norm, lm_head
    terms = {t.category: t.nbytes for t in fsdp_terms(model, endpoint)}
    pieces: list[Piece] = []
    if model_part:  # load_fsdp2_model_to_gpu: model.to(device)
        for p in params:
            shard = shard_numel(p.shape, world) * FP32
            pieces.append(Piece("a parameter shard", shard))
            if (full or p.lora) and terms.get("gradients", 0):
                pieces.append(Piece("a gradient shard", shard))
    if optimizer_part and terms.get("optimizer_state", 0):  # load_fsdp_optimizer: exp_avg, exp_avg_sq per parameter
        for p in params:
            if full or p.lora:
                pieces += [Piece("an AdamW moment", shard_numel(p.shape, world) * FP32)] * (ADAM_MOMENTS // FP32)
    return _grouped(pieces)


def backload_pieces(model: ModelArch, endpoint: Endpoint, model_part: bool, optimizer_part: bool) -> list[Piece]:
    """The trainer rank's backload as the allocations its strategy makes, in order, grouped."""
    if endpoint.trainer.strategy == "fsdp":
        return fsdp_pieces(model, endpoint, model_part, optimizer_part)
    return megatron_pieces(model, endpoint, model_part, optimizer_part)


def first_short(pieces: list[Piece], room: int) -> ShortPiece | None:
    """The first allocation that does not fit in ``room`` bytes once the ones before it are placed (None: all fit)."""
    placed = 0
    for p in pieces:
        fitting = max(0, room - placed) // p.nbytes
        if fitting < p.count:
            return ShortPiece(p.what, p.nbytes, placed + fitting * p.nbytes)
        placed += p.count * p.nbytes
    return None

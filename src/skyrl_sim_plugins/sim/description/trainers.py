"""The trainer axis: what each rank of a SkyRL-Train trainer keeps, and what it has in flight, per training stack.

SkyRL 0.4.0 trains with Megatron (``trainer.strategy: megatron``) or FSDP2 (``fsdp``), either LoRA adapters on frozen
weights or every weight (``trainer.train_base_weights``, SkyRL's ``trainer.policy.model.lora.rank: 0``). Each
combination is an entry of ``TRAINERS``, chosen by the endpoint (``trainer_of``) and read by the memory walk (its
static memory and, for FSDP, its units in flight and the Hugging Face model's graphs), the time model (FSDP's
collectives) and colocation (what an offload moves). A new trainer is an entry here plus its tests.

Every term names the code it comes from (paths inside the ``skyrl==0.4.0`` wheel, megatron-core 0.16.1, torch 2.13):

* **Megatron** (``distributed/megatron/megatron_strategy.py``, ``workers/megatron/megatron_worker.py``): the model's
  weights sharded over TP (and PP, EP) in ``params_dtype``. LoRA: Megatron-Bridge's adapters with fp32 main gradients
  and the distributed optimizer's fp32 master copy and Adam moments sharded over DP. Full fine-tuning: megatron-core's
  ``DistributedDataParallel`` gradient buffer over every weight (``distributed_data_parallel.py``: ``grad_dtype =
  torch.float if grad_reduce_in_fp32 else param.dtype``; SkyRL's ``MegatronDDPConfig.grad_reduce_in_fp32`` defaults to
  true), reduce-scattered in place bucket by bucket, and the ``DistributedOptimizer``'s fp32 main parameters
  (``distrib_optimizer.py``: ``_build_model_and_main_param_groups``, ``shard_main_param``; none when the weights are
  fp32 already) and Adam's ``exp_avg``/``exp_avg_sq`` (``init_shard``), each a 1/DP shard. ``optimizer_offload``
  (SkyRL's ``optimizer_config_kwargs.optimizer_cpu_offload``) keeps the optimizer state on the host.
* **FSDP** (``distributed/fsdp_strategy.py``: ``FSDPStrategy._fsdp_init_model``; ``fsdp_utils.py``: ``apply_fsdp2``;
  torch's ``fully_shard``): the Hugging Face model (``workers/model_wrapper.py``: ``HFModelWrapper``) loaded in fp32
  (``bf16=inference_only_init``, false for training), every parameter sharded on its first dimension over the
  ``fsdp`` mesh (``_fsdp_param.py``: ``FSDPParam._init_sharded_param``, each rank a ``ceil(d0 / W)`` padded chunk).
  LoRA: peft's adapters (``get_peft_model``) inside the same units, fp32 like the base; AdamW
  (``optim.AdamW(fsdp_module.parameters())``) keeps ``exp_avg`` and ``exp_avg_sq`` for the parameters that get a
  gradient only (``torch/optim/adamw.py``: ``_init_group``). Full fine-tuning: every parameter's sharded fp32
  gradient and moments. No separate master copy: the sharded parameters are the fp32 masters. ``fsdp.cpu_offload``
  (``CPUOffloadPolicy``) keeps all of it on the host. The units (``apply_fsdp2``): each decoder layer (the model's
  ``_no_split_modules`` class), the input embedding when the embeddings are not tied, and the root (the output layer,
  the final norm, and the tied embedding): ``fsdp_units``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from skyrl_sim.api import DTYPE_BYTES, Endpoint, ModelArch, Stage, stage_layers
from skyrl_sim_plugins.sim.description.layer_ops import MoE, decoder_layer

Category = Literal["weights", "adapters", "gradients", "master_weights", "optimizer_state"]
FP32 = 4
ADAM_MOMENTS = 2 * FP32  # exp_avg and exp_avg_sq, fp32

MEGATRON_SOURCE = "skyrl workers/megatron/megatron_worker.py (Megatron-Bridge model), megatron-core"
FSDP_SOURCE = "skyrl distributed/fsdp_strategy.py: FSDPStrategy._fsdp_init_model; torch fully_shard"


@dataclass(frozen=True)
class StateTerm:
    """One kind of memory a trainer rank keeps between calls: its allocator category, its bytes on the device, what
    it is and the code it comes from."""

    category: Category
    nbytes: int
    what: str
    source: str
    lazy: bool = False  # made by the first backward (gradients) or optim_step (moments): carried, not held from the start


# ---------------------------------------------------------------------------------------------------------- Megatron


def lora_params_per_rank(model: ModelArch, endpoint: Endpoint, layers: list[int], experts: bool | None = None) -> int:
    """LoRA A and B parameters of ``layers`` on one TP (and expert-parallel) rank: every adapted linear of the layer
    description, split as Megatron-Bridge's ParallelLinearAdapter splits it (``Linear.adapter_parameters_per_rank``).
    ``experts``: only the routed experts' adapters (True) or only the others (False); None: all."""
    p, rank, targets = endpoint.parallelism, endpoint.lora.rank, endpoint.adapted_targets(model)
    total = 0
    for index in layers:
        layer = decoder_layer(model, index)
        routed = [id(x) for x in layer.mlp.experts.linears] if isinstance(layer.mlp, MoE) else []
        for linear, copies in layer.adapted_linears(targets, p.ep):
            if experts is None or (id(linear) in routed) == experts:
                total += copies * linear.adapter_parameters_per_rank(rank, p.tp)
    return total


def trainable_state_bytes(params: int, endpoint: Endpoint, dtype: str | None = None, replicas: int | None = None) -> int:
    """Parameters (in ``dtype``, the trainer's ``params_dtype`` when not given) plus fp32 main gradients plus Adam
    (an fp32 master copy unless the parameters are fp32, two fp32 moments).

    The distributed optimizer shards the optimizer state over the parameters' data-parallel replicas (``replicas``:
    DP, or DP / EP for routed experts' parameters); ``optimizer_offload`` moves it to the host.
    """
    pbytes = DTYPE_BYTES[dtype or endpoint.trainer.params_dtype]
    shards = replicas if replicas is not None else endpoint.parallelism.dp
    return params * (pbytes + FP32) + math.ceil(params * megatron_optimizer_bytes(endpoint, pbytes) / shards)


def megatron_optimizer_bytes(endpoint: Endpoint, pbytes: int) -> int:
    """Bytes per parameter of megatron-core's optimizer state before sharding: the fp32 main copy (none for fp32
    parameters) and Adam's two moments; none on the device with ``optimizer_offload``."""
    if endpoint.trainer.optimizer_offload:
        return 0
    return ADAM_MOMENTS + (FP32 if pbytes < FP32 else 0)


def megatron_weight_params(model: ModelArch, endpoint: Endpoint, stage: Stage | None = None) -> int:
    """The model's weights on one rank of ``stage`` (the last pipeline stage when not given): TP-sharded, the experts
    of its EP rank only; the first stage holds the word embeddings (and the vision tower unless
    ``language_model_only``), the last the output layer (a copy of tied embeddings, as megatron-core keeps one)."""
    p, t = endpoint.parallelism, endpoint.trainer
    layers = stage_layers(model, endpoint) if stage is None else list(stage.layers)
    vocab = model.vocab_size * model.hidden_size
    if stage is None or p.pp == 1:
        vocab_copies = 1 if model.tied_embeddings or p.pp > 1 else 2
        vision = not t.language_model_only and p.pp == 1
    else:
        vocab_copies = int(stage.first) + int(stage.last)
        vision = not t.language_model_only and stage.first
    # each layer's own count: a DeepSeek-style model's dense first layers and its MoE layers differ, as do a hybrid's
    stage_params = vocab * vocab_copies + sum(model.layer_parameter_count(i) for i in layers)
    if model.moe is not None and p.ep > 1:  # expert parallelism: a rank holds its own experts' weights only
        per_expert = 3 * model.hidden_size * model.moe.expert_ffn_hidden_size
        others = model.moe.num_experts - math.ceil(model.moe.num_experts / p.ep)
        stage_params -= sum(1 for i in layers if model.is_moe_layer(i)) * others * per_expert
    if vision:
        stage_params += model.vision_params
    return math.ceil(stage_params / p.tp)


def megatron_adapter_bytes(model: ModelArch, endpoint: Endpoint, layers: list[int]) -> int:
    """The LoRA adapters' state on one rank (``trainable_state_bytes`` in the adapters' dtype); under expert
    parallelism an expert's adapters shard their optimizer state over the DP / EP ranks that hold that expert."""
    if not endpoint.adapted_targets(model):
        return 0
    p, dtype = endpoint.parallelism, endpoint.lora.dtype
    if model.moe is not None and p.ep > 1:  # an expert's replicas are DP / EP ranks (its expert-data-parallel group)
        dense = lora_params_per_rank(model, endpoint, layers, experts=False)
        routed = lora_params_per_rank(model, endpoint, layers, experts=True)
        return trainable_state_bytes(dense, endpoint, dtype, p.dp) + trainable_state_bytes(
            routed, endpoint, dtype, max(1, p.dp // p.ep)
        )
    return trainable_state_bytes(lora_params_per_rank(model, endpoint, layers), endpoint, dtype)


def megatron_terms(model: ModelArch, endpoint: Endpoint, stage: Stage | None = None) -> list[StateTerm]:
    """Megatron's state on one rank of ``stage``: the weights, and either the LoRA adapters' state or (full
    fine-tuning) the gradient buffer and the distributed optimizer's shard."""
    t = endpoint.trainer
    params = megatron_weight_params(model, endpoint, stage)
    pbytes = DTYPE_BYTES[t.params_dtype]
    weights = StateTerm("weights", params * pbytes, f"weights, TP-sharded, {t.params_dtype}", MEGATRON_SOURCE)
    if not endpoint.full_fine_tune:
        layers = stage_layers(model, endpoint) if stage is None else list(stage.layers)
        adapters = megatron_adapter_bytes(model, endpoint, layers)
        what = "LoRA adapters: parameters, fp32 main gradients, Adam (master copy, moments) sharded over DP"
        return [weights, StateTerm("adapters", adapters, what, "Megatron-Bridge LoRA; megatron-core DistributedOptimizer")]
    grad_bytes = FP32 if t.grad_reduce_in_fp32 else pbytes
    grad_dtype = "fp32" if t.grad_reduce_in_fp32 else t.params_dtype
    dp, host = endpoint.parallelism.dp, " (on the host: optimizer_offload)" if t.optimizer_offload else ""
    on_device = 0 if t.optimizer_offload else 1
    terms = [
        weights,
        StateTerm(
            "gradients",
            params * grad_bytes,
            f"the DDP gradient buffer over every weight, {grad_dtype} (grad_reduce_in_fp32), reduce-scattered per bucket",
            "megatron-core distributed/distributed_data_parallel.py: DistributedDataParallel (grad_dtype)",
        ),
    ]
    if pbytes < FP32:  # 16-bit weights: fp32 main parameters, made with the optimizer
        terms.append(
            StateTerm(
                "master_weights",
                math.ceil(params * FP32 / dp) * on_device,
                f"fp32 main parameters, a 1/DP shard{host}",
                "megatron-core optimizer/distrib_optimizer.py: _build_model_and_main_param_groups (shard_main_param)",
            )
        )
    terms.append(
        StateTerm(
            "optimizer_state",
            math.ceil(params * ADAM_MOMENTS / dp) * on_device,
            f"Adam's moments, a 1/DP shard{host}: made by the first optim_step",
            "megatron-core optimizer/__init__.py: torch's AdamW (TransformerEngine and Apex absent) over the shard",
            lazy=True,
        )
    )
    return terms


# -------------------------------------------------------------------------------------------------------------- FSDP

HF_LORA_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""The Hugging Face Llama/Qwen modules each Megatron LoRA target names (peft's ``all-linear`` wraps all seven)."""


@dataclass(frozen=True)
class HfParam:
    """One parameter of the Hugging Face model, with the FSDP unit that holds it and whether it is a LoRA one."""

    name: str
    shape: tuple[int, ...]
    unit: Literal["embedding", "layer", "root"]
    lora: bool = False


def fsdp_supported(model: ModelArch) -> str | None:
    """Why the FSDP trainer's Hugging Face layout does not describe ``model`` (None: it does). The walk models the
    dense decoder of Llama and Qwen3 (``LlamaDecoderLayer``-like: q/k/v/o, gate/up/down)."""
    if model.moe is not None:
        return "an MoE model (the FSDP trainer's walk models dense Hugging Face decoders)"
    if model.linear_attention is not None or set(model.layer_types) != {"full_attention"}:
        return "linear-attention layers (the FSDP trainer's walk models full-attention Hugging Face decoders)"
    if model.attention_output_gate:
        return "a gated attention output (the FSDP trainer's walk models Llama/Qwen3 attention)"
    return None


def hf_lora_modules(endpoint: Endpoint, model: ModelArch) -> frozenset[str]:
    """The Hugging Face modules peft wraps: every linear of a layer for ``all-linear`` (peft excludes the output
    layer), else the modules of the Megatron names in ``lora.targets``; none with full fine-tuning."""
    if endpoint.full_fine_tune:
        return frozenset()
    targets = endpoint.lora.targets
    names = HF_LORA_MODULES if targets == "all-linear" else {t: HF_LORA_MODULES.get(t, ()) for t in targets}
    return frozenset(m for modules in names.values() for m in modules)


def hf_layer_params(model: ModelArch, lora_rank: int, lora_modules: frozenset[str]) -> list[HfParam]:
    """One decoder layer's parameters as transformers' ``LlamaDecoderLayer`` (or Qwen3's) holds them, with peft's
    ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` of each wrapped module."""
    h, hd = model.hidden_size, model.head_dim
    q, kv, f = model.num_attention_heads * hd, model.num_kv_heads * hd, model.ffn_hidden_size
    linears = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (f, h),
        "mlp.up_proj": (f, h),
        "mlp.down_proj": (h, f),
    }
    params = [HfParam("input_layernorm.weight", (h,), "layer"), HfParam("post_attention_layernorm.weight", (h,), "layer")]
    if model.extra.get("qk_layernorm", True):
        params += [HfParam("self_attn.q_norm.weight", (hd,), "layer"), HfParam("self_attn.k_norm.weight", (hd,), "layer")]
    for name, (n_out, n_in) in linears.items():
        params.append(HfParam(f"{name}.weight", (n_out, n_in), "layer"))
        if name.split(".")[-1] in lora_modules:
            params.append(HfParam(f"{name}.lora_A.weight", (lora_rank, n_in), "layer", lora=True))
            params.append(HfParam(f"{name}.lora_B.weight", (n_out, lora_rank), "layer", lora=True))
    return params


def hf_end_params(model: ModelArch) -> list[HfParam]:
    """The parameters outside the decoder layers: the input embedding (its own unit unless tied), the final norm and
    the output layer (the root unit; a tied embedding is the root's too)."""
    h, v = model.hidden_size, model.vocab_size
    embedding_unit: Literal["embedding", "root"] = "root" if model.tied_embeddings else "embedding"
    params = [HfParam("model.embed_tokens.weight", (v, h), embedding_unit), HfParam("model.norm.weight", (h,), "root")]
    if not model.tied_embeddings:
        params.append(HfParam("lm_head.weight", (v, h), "root"))
    return params


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements of one rank's padded shard of a parameter: FSDP2 chunks dim 0 into ``ceil(d0 / W)`` rows
    (``_fsdp_param.py``: ``_init_sharded_param``, ``padded_sharded_param_size``)."""
    rest = math.prod(shape[1:])
    return -(-shape[0] // world) * rest


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP2 unit's bytes on one rank while it is in flight (``fsdp_units``)."""

    name: str
    unsharded: int  # its parameters all-gathered, in the compute dtype (each parameter's own tensor)
    flat: int  # the all-gather's flat output (world > 1), freed after the copy-out (in forward: at the next unit's)
    grad_unsharded: int  # its trainable parameters' gradients, unsharded, in the compute dtype
    reduce_scatter: int  # the reduce-scatter's input, in the reduce dtype (world > 1)


@dataclass(frozen=True)
class FsdpUnits:
    """The units of the FSDP trainer on one rank: a decoder layer's, the input embedding's (None when tied: the
    root holds it) and the root's."""

    layer: FsdpUnit
    embedding: FsdpUnit | None
    root: FsdpUnit
    world: int


def _unit(name: str, params: list[HfParam], world: int, compute: int, reduce: int, full: bool) -> FsdpUnit:
    """An all-gathered unit's bytes: every parameter's padded shard times the world (``foreach_all_gather``'s
    output, split into each parameter's unsharded tensor by ``foreach_all_gather_copy_out``)."""
    elements = sum(shard_numel(p.shape, world) * world for p in params)
    trainable = sum(shard_numel(p.shape, world) * world for p in params if full or p.lora)
    return FsdpUnit(
        name,
        unsharded=elements * compute,
        flat=elements * compute if world > 1 else 0,
        grad_unsharded=trainable * compute,
        reduce_scatter=trainable * reduce if world > 1 else 0,
    )


def fsdp_units(model: ModelArch, endpoint: Endpoint) -> FsdpUnits:
    """The sizes of FSDP2's units in flight on one rank (``_fsdp_param_group.py``: ``FSDPParamGroup.unshard``,
    ``wait_for_unshard``; ``_fsdp_collectives.py``: ``foreach_all_gather``, ``foreach_reduce``): a unit all-gathered
    in the mixed-precision ``param_dtype`` (``trainer.params_dtype``); after its backward the gradients of its
    trainable parameters, unsharded in that dtype, copied into a reduce-scatter input in ``fsdp.reduce_dtype``."""
    world = endpoint.parallelism.dp
    compute = DTYPE_BYTES[endpoint.trainer.params_dtype]
    reduce = DTYPE_BYTES[endpoint.trainer.fsdp.reduce_dtype]
    full = endpoint.full_fine_tune
    layer = hf_layer_params(model, endpoint.lora.rank, hf_lora_modules(endpoint, model))
    ends = hf_end_params(model)
    embedding = [p for p in ends if p.unit == "embedding"]
    root = [p for p in ends if p.unit == "root"]
    return FsdpUnits(
        layer=_unit("layer", layer, world, compute, reduce, full),
        embedding=_unit("embedding", embedding, world, compute, reduce, full) if embedding else None,
        root=_unit("root", root, world, compute, reduce, full),
        world=world,
    )


def fsdp_terms(model: ModelArch, endpoint: Endpoint) -> list[StateTerm]:
    """FSDP's state on one rank: every parameter's fp32 shard, and either the LoRA adapters' shards with their
    gradients and moments or (full fine-tuning) every parameter's gradient and moments; nothing on the device with
    ``fsdp.cpu_offload``."""
    world = endpoint.parallelism.dp
    lora = hf_lora_modules(endpoint, model)
    layer = hf_layer_params(model, endpoint.lora.rank, lora)
    params = hf_end_params(model) + layer * model.num_layers
    base = sum(shard_numel(p.shape, world) for p in params if not p.lora)
    adapters = sum(shard_numel(p.shape, world) for p in params if p.lora)
    offload = endpoint.trainer.fsdp.cpu_offload
    host = " (on the host: fsdp.cpu_offload)" if offload else ""
    on_device = 0 if offload else 1
    what = f"every parameter's fp32 shard, 1/{world} (padded per parameter){host}"
    weights = StateTerm("weights", base * FP32 * on_device, what, FSDP_SOURCE)
    trained = base if endpoint.full_fine_tune else adapters
    which = "every parameter's" if endpoint.full_fine_tune else "the LoRA adapters'"
    owners = "every parameter" if endpoint.full_fine_tune else "the LoRA adapters"
    terms = [weights]
    if not endpoint.full_fine_tune:
        what = f"peft LoRA adapters: fp32 shards, 1/{world}{host}"
        source = "skyrl workers/model_wrapper.py: get_peft_model"
        terms.append(StateTerm("adapters", adapters * FP32 * on_device, what, source))
    return terms + [
        StateTerm(
            "gradients",
            trained * FP32 * on_device,
            f"{which} sharded fp32 gradients, 1/{world}{host}: made by a forward_backward's backward, freed by "
            "optim_step's zero_grad",
            "torch _fsdp_collectives.py: foreach_reduce (the sharded gradient); skyrl FSDPStrategy.optimizer_step",
            lazy=True,
        ),
        StateTerm(
            "optimizer_state",
            trained * ADAM_MOMENTS * on_device,
            f"AdamW moments of {owners}, fp32, 1/{world}{host}: made by the first optim_step",
            "skyrl fsdp_strategy.py: optim.AdamW(fsdp_module.parameters()); torch/optim/adamw.py: _init_group",
            lazy=True,
        ),
    ]


# ---------------------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class TrainerDescription:
    """One training stack: its name, where its memory and time come from, and whether it trains every weight."""

    key: str
    strategy: str
    full: bool
    model_code: Literal["megatron", "hf"]  # which model's graphs the walk builds: megatron-core's or transformers'

    def state_terms(self, model: ModelArch, endpoint: Endpoint, stage: Stage | None = None) -> list[StateTerm]:
        """What one rank keeps between calls (``stage``: a pipeline stage's rank, Megatron only)."""
        if self.strategy == "fsdp":
            return fsdp_terms(model, endpoint)
        return megatron_terms(model, endpoint, stage)


TRAINERS: dict[tuple[str, bool], TrainerDescription] = {
    ("megatron", False): TrainerDescription("megatron-lora", "megatron", False, "megatron"),
    ("megatron", True): TrainerDescription("megatron-full", "megatron", True, "megatron"),
    ("fsdp", False): TrainerDescription("fsdp-lora", "fsdp", False, "hf"),
    ("fsdp", True): TrainerDescription("fsdp-full", "fsdp", True, "hf"),
}
"""Every trainer the simulator prices, by (``trainer.strategy``, full fine-tuning). Other strategies (SkyRL's JAX
backend, a plugin's) are priced as Megatron's walk prices them."""


def trainer_of(endpoint: Endpoint) -> TrainerDescription:
    """The endpoint's trainer (see ``TRAINERS``)."""
    strategy = endpoint.trainer.strategy if endpoint.trainer.strategy == "fsdp" else "megatron"
    return TRAINERS[(strategy, endpoint.full_fine_tune)]


def static_bytes(model: ModelArch, endpoint: Endpoint, stage: Stage | None = None) -> dict[str, int]:
    """What one rank keeps between calls, bytes per allocator category (``weights`` and ``adapters`` always; the
    others only when the trainer has them: full fine-tuning's ``gradients`` and ``optimizer_state``)."""
    out: dict[str, int] = {"weights": 0, "adapters": 0}
    for term in trainer_of(endpoint).state_terms(model, endpoint, stage):
        if not term.lazy:
            out[term.category] = out.get(term.category, 0) + term.nbytes
    return out


def lazy_state(model: ModelArch, endpoint: Endpoint) -> dict[str, int]:
    """The state a rank makes on the way rather than at the start (FSDP's gradients at a backward, Adam's moments
    at the first optim_step), bytes per category: carried by the walk from call to call (``CarriedMemory``)."""
    terms = trainer_of(endpoint).state_terms(model, endpoint)
    out: dict[str, int] = {}
    for term in terms:
        if term.lazy:
            out[term.category] = out.get(term.category, 0) + term.nbytes
    return out


LAZY_CATEGORIES = ("gradients", "optimizer_state")
"""The carried entries that are a trainer's lazily made state (held in their own breakdown category)."""


def after_backward(held: dict[str, int], model: ModelArch, endpoint: Endpoint) -> dict[str, int]:
    """A rank's carried state after a forward_backward that completed: its gradients exist (FSDP)."""
    grads = lazy_state(model, endpoint).get("gradients", 0)
    return {**held, "gradients": grads} if grads else held


def after_optim_step(
    held: dict[str, int], model: ModelArch, endpoint: Endpoint, lazy: dict[str, int] | None = None
) -> dict[str, int]:
    """A rank's carried state after an optim_step: the moments exist, the gradients are freed (``zero_grad``).
    ``lazy``: the endpoint's ``lazy_state`` when the caller has it (a run computes it once)."""
    lazy = lazy_state(model, endpoint) if lazy is None else lazy
    if not lazy:
        return held
    out = {name: size for name, size in held.items() if name != "gradients" or "gradients" not in lazy}
    return {**out, "optimizer_state": lazy.get("optimizer_state", 0)} if "optimizer_state" in lazy else out


@dataclass(frozen=True)
class TrainerTraffic:
    """The collectives of a trainer that the layer description does not list, as (kind, bytes, group) each time
    they run: per micro-batch in forward and in backward (FSDP's all-gather of each unit, its reduce-scatter of each
    unit's gradients), per forward_backward call (Megatron's gradient reduction over DP) and per optim_step (the
    distributed optimizer's all-gather of the updated weights); and the parameters Adam updates on one rank."""

    microbatch_forward: tuple[tuple[str, int, int], ...] = ()
    microbatch_backward: tuple[tuple[str, int, int], ...] = ()
    call: tuple[tuple[str, int, int], ...] = ()
    optim_step: tuple[tuple[str, int, int], ...] = ()
    updated_params: int = 0


def trainer_traffic(model: ModelArch, endpoint: Endpoint, lora_params: int) -> TrainerTraffic:
    """The trainer's own collectives (``TrainerTraffic``) over the data-parallel group:

    - Megatron LoRA: the adapters' fp32 gradients all-reduced after a forward_backward (``lora_params`` of them,
      TP-split); Adam on the adapters.
    - Megatron full fine-tuning: megatron-core's DDP reduce-scatters the gradient buffer (``finalize_model_grads``,
      ``grad_reduce_in_fp32``) after a forward_backward; after Adam on its 1/DP shard the distributed optimizer
      all-gathers the updated weights (``DistributedOptimizer``'s param gather).
    - FSDP: per micro-batch, each unit all-gathered in forward (the root, the embedding, every layer) and again in
      backward (every layer with ``reshard_after_forward``, the root, the embedding), each unit's trainable
      gradients reduce-scattered in backward (``foreach_reduce``, ``fsdp.reduce_dtype``); Adam on the rank's shard.
    """
    dp, tp = endpoint.parallelism.dp, endpoint.parallelism.tp
    trainer = trainer_of(endpoint)
    if trainer.strategy == "fsdp":
        units = fsdp_units(model, endpoint)
        ends = [units.root, *([units.embedding] if units.embedding is not None else [])]
        layers = [("all_gather", units.layer.unsharded, dp)] * model.num_layers
        gather = [("all_gather", u.unsharded, dp) for u in ends] + layers
        regather = gather if endpoint.trainer.fsdp.reshard_after_forward else gather[: len(ends)]
        reduce_bytes = DTYPE_BYTES[endpoint.trainer.fsdp.reduce_dtype] / DTYPE_BYTES[endpoint.trainer.params_dtype]
        scatter = [
            ("reduce_scatter", int(u.grad_unsharded * reduce_bytes), dp)
            for u in [units.layer] * model.num_layers + ends
            if u.grad_unsharded
        ]
        lazy = lazy_state(model, endpoint)
        updated = lazy.get("gradients", 0) // FP32
        return TrainerTraffic(tuple(gather), tuple(regather) + tuple(scatter), updated_params=updated)
    if endpoint.full_fine_tune:
        params = megatron_weight_params(model, endpoint)
        grad = FP32 if endpoint.trainer.grad_reduce_in_fp32 else DTYPE_BYTES[endpoint.trainer.params_dtype]
        return TrainerTraffic(
            call=(("reduce_scatter", params * grad, dp),),
            optim_step=(("all_gather", params * DTYPE_BYTES[endpoint.trainer.params_dtype], dp),),
            updated_params=math.ceil(params / dp),
        )
    return TrainerTraffic(call=(("all_reduce", lora_params // tp * FP32, dp),), updated_params=lora_params)

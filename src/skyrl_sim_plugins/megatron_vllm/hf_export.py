"""The Hugging Face Llama layout of a real-backend model: seeded base weights, megatron shards, and the checkpoint.

One definition of how a ``LlamaForCausalLM`` state dict maps to megatron-core's GPTModel parameters on each TP rank
(``to_megatron``) and back (``from_megatron``), so the model the workers train is the model vLLM samples from:

- ``linear_qkv`` holds, per KV group, that group's query heads then its key head then its value head; groups are split
  across TP ranks;
- ``linear_fc1`` holds, per rank, the rank's slice of the gate projection followed by its slice of the up projection;
- ``linear_proj`` / ``linear_fc2`` are split along their input, embeddings and the output layer along the vocabulary.

An MoE layer (``arch.is_moe_layer``) holds the Mixtral layout instead of the dense MLP: ``block_sparse_moe.gate``
(the router, ``[experts, hidden]``) and per expert ``w1`` (gate), ``w3`` (up), ``w2`` (down), mapped to megatron's
``mlp.router`` and ``mlp.experts.local_experts.<j>.linear_fc1`` / ``linear_fc2`` (the experts of this rank's EP slice,
each split over TP like a dense MLP); a shared expert (which Mixtral has not) is ``shared_expert``'s
``gate_proj`` / ``up_proj`` / ``down_proj`` <-> ``mlp.shared_experts``, and Qwen's gate on it
(``MoeDims.shared_expert_gate``) ``shared_expert_gate.weight`` ``[1, hidden]`` <-> ``mlp.shared_experts.gate_weight``
(megatron-core's ``SharedExpertMLP``: replicated over TP, not split).

A multi-latent attention model (``arch.mla``: DeepSeek-V2/V3, GLM-4.7-Flash) holds DeepSeek-V3's layout instead:
``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without a query rank),
``kv_a_proj_with_mqa`` (the latent and the rotary key), ``kv_a_layernorm``, ``kv_b_proj`` (per head: no-position key
then value) and ``o_proj`` <-> megatron-core's ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (or
``linear_q_proj``), ``linear_kv_down_proj``, ``kv_layernorm``, ``linear_kv_up_proj``, ``linear_proj`` (the same row
order: megatron views the up projections' outputs per head as HF does); its MoE layers are DeepSeek's ``mlp.gate``,
``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` and ``mlp.shared_experts``. The rotary parts keep
megatron's (non-interleaved) order: the checkpoint is the trained model's, not DeepSeek's interleaved release layout.

A gated-DeltaNet layer (``linear_attention``; the tiny hybrid the real backend trains) has no Llama counterpart: its
weights are held under ``model.layers.<i>.linear_attn.`` in megatron-core's own layout (``GatedDeltaNet``: ``in_proj``
with q, k, v, the gate z, beta and the decay's a, each split over TP; the depthwise ``conv1d`` over q, k and v;
``dt_bias``, ``A_log``, the value-head ``norm``; ``out_proj``). Such a model is trained only: no checkpoint is
written for vLLM (``from_megatron`` refuses it).

The checkpoint directory (``<run_dir>/checkpoints/<model_id>/<name or "base">/``) holds ``config.json`` for
``LlamaForCausalLM`` (``MixtralForCausalLM`` for an MoE model, ``DeepseekV3ForCausalLM`` for MLA) and
``model.safetensors`` with LoRA merged in; the sampler serves it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from skyrl_sim.api import ModelArch

DEFAULT_ROPE_THETA = 1_000_000.0  # Qwen3's; a preset may set extra["rope_theta"]
DEFAULT_RMS_NORM_EPS = 1e-6
INIT_STD = 0.02  # normal init of every matrix (the HF Llama initializer_range)


def rope_theta(arch: ModelArch) -> float:
    return float(arch.extra.get("rope_theta", DEFAULT_ROPE_THETA))


def rms_norm_eps(arch: ModelArch) -> float:
    return float(arch.extra.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS))


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every parameter of the HF Llama model of this architecture, in a fixed order."""
    h, f, v = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.kv_width
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if arch.layer_types[i] == "linear_attention":
            shapes.update(_deltanet_shapes(arch, p + "linear_attn."))
        elif arch.mla is not None:
            shapes.update(_mla_shapes(arch, p))
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch.is_moe_layer(i):
            shapes.update(_moe_shapes(arch, p))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not arch.tied_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _mla_shapes(arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
    """One layer's multi-latent attention in DeepSeek-V3's layout (see the module docstring)."""
    m = arch.mla
    assert m is not None
    h, heads, p = arch.hidden_size, arch.num_attention_heads, prefix + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank:
        shapes[p + "q_a_proj.weight"] = (m.q_lora_rank, h)
        shapes[p + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        shapes[p + "q_b_proj.weight"] = (heads * m.q_head_dim, m.q_lora_rank)
    else:
        shapes[p + "q_proj.weight"] = (heads * m.q_head_dim, h)
    shapes[p + "kv_a_proj_with_mqa.weight"] = (m.latent_width, h)
    shapes[p + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
    shapes[p + "kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes[p + "o_proj.weight"] = (h, heads * m.v_head_dim)
    return shapes


def moe_names(arch: ModelArch) -> tuple[str, str, tuple[str, str, str], str]:
    """An MoE layer's HF names: the block, the router, an expert's (gate, up, down) and the shared expert's block:
    Mixtral's (``block_sparse_moe``, ``w1`` / ``w3`` / ``w2``) or, with MLA, DeepSeek-V3's (``mlp``, ``gate_proj`` /
    ``up_proj`` / ``down_proj``, ``shared_experts``)."""
    if arch.mla is not None:
        return "mlp.", "gate", ("gate_proj", "up_proj", "down_proj"), "shared_experts."
    return "block_sparse_moe.", "gate", ("w1", "w3", "w2"), "shared_expert."


def _deltanet_shapes(arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
    """One gated-DeltaNet layer's parameters, megatron-core's layout (``GatedDeltaNet.__init__``)."""
    la = arch.linear_attention
    assert la is not None
    conv = 2 * la.qk_width + la.v_width
    return {
        prefix + "in_proj.weight": (la.in_proj_width, arch.hidden_size),
        prefix + "conv1d.weight": (conv, 1, la.conv_kernel),
        prefix + "dt_bias": (la.num_value_heads,),
        prefix + "A_log": (la.num_value_heads,),
        prefix + "norm.weight": (la.value_head_dim,),
        prefix + "out_proj.weight": (arch.hidden_size, la.v_width),
    }


def _deltanet_sections(arch: ModelArch) -> tuple[list[int], list[int]]:
    """The sections of ``in_proj``'s output (q, k, v, z, beta, a) and of ``conv1d``'s channels (q, k, v), each split
    over TP on its own (``GatedDeltaNet.sharded_state_dict``)."""
    la = arch.linear_attention
    assert la is not None
    qk, v, heads = la.qk_width, la.v_width, la.num_value_heads
    return [qk, qk, v, v, heads, heads], [qk, qk, v]


def _moe_shapes(arch: ModelArch, prefix: str) -> dict[str, tuple[int, ...]]:
    """One MoE layer's parameters in the Mixtral (or, with MLA, DeepSeek) layout (see the module docstring)."""
    assert arch.moe is not None
    h, f, shared = arch.hidden_size, arch.moe.expert_ffn_hidden_size, arch.moe.shared_expert_ffn_hidden_size
    block, router, (gate, up, down), shared_block = moe_names(arch)
    p = prefix + block
    shapes: dict[str, tuple[int, ...]] = {p + f"{router}.weight": (arch.moe.num_experts, h)}
    for e in range(arch.moe.num_experts):
        shapes[f"{p}experts.{e}.{gate}.weight"] = (f, h)
        shapes[f"{p}experts.{e}.{up}.weight"] = (f, h)
        shapes[f"{p}experts.{e}.{down}.weight"] = (h, f)
    if shared:
        shapes[prefix + shared_block + "gate_proj.weight"] = (shared, h)
        shapes[prefix + shared_block + "up_proj.weight"] = (shared, h)
        shapes[prefix + shared_block + "down_proj.weight"] = (h, shared)
        if arch.moe.shared_expert_gate:
            shapes[shared_gate_name(arch, prefix)] = (1, h)
    return shapes


def shared_gate_name(arch: ModelArch, prefix: str) -> str:
    """The HF name of the shared expert's gate of the layer at ``prefix`` (``model.layers.<i>.``): the shared
    expert's block name with ``_gate`` (``shared_expert_gate.weight``, Qwen's name)."""
    return prefix + moe_names(arch)[3].rstrip(".") + "_gate.weight"


MLA_NAMES = {
    "q_a_proj": "linear_q_down_proj",
    "q_a_layernorm": "q_layernorm",
    "q_b_proj": "linear_q_up_proj",
    "q_proj": "linear_q_proj",
    "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_a_layernorm": "kv_layernorm",
    "kv_b_proj": "linear_kv_up_proj",
}
"""DeepSeek-V3's multi-latent attention weights (``self_attn.*``) and megatron-core's (``self_attention.*``): every
projection column-parallel (rows split over TP), the norms whole; ``o_proj`` is ``linear_proj`` (columns split)."""


def init_hf_weights(arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 base weights: norms 1, matrices N(0, INIT_STD) from one generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in hf_shapes(arch).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape)  # norms; a DeltaNet's dt_bias (megatron's init) and A_log
        else:
            weights[name] = torch.randn(shape, generator=generator) * INIT_STD
    return weights


def _qkv_full(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q, k, v -> megatron's grouped [q heads of group g, k_g, v_g] for every group g."""
    d, groups = arch.head_dim, arch.num_kv_heads
    per = arch.num_attention_heads // groups
    hidden = q.shape[1]
    qg = q.view(groups, per * d, hidden)
    kg = k.view(groups, d, hidden)
    vg = v.view(groups, d, hidden)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, hidden)


def _qkv_split(arch: ModelArch, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, groups = arch.head_dim, arch.num_kv_heads
    per = arch.num_attention_heads // groups
    g = fused.view(groups, (per + 2) * d, fused.shape[1])
    q, k, v = g[:, : per * d], g[:, per * d : (per + 1) * d], g[:, (per + 1) * d :]
    return q.reshape(-1, fused.shape[1]), k.reshape(-1, fused.shape[1]), v.reshape(-1, fused.shape[1])


def to_megatron(
    hf: dict[str, torch.Tensor], arch: ModelArch, tp: int, rank: int, ep: int = 1, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """This TP rank's megatron-core GPTModel parameters from a full HF state dict (an MoE layer: the experts of
    EP rank ``ep_rank`` of ``ep``)."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[rank].contiguous()

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[rank].contiguous()

    def sections(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.cat([rows(part) for part in t.split(sizes, dim=0)], dim=0)

    out = {"embedding.word_embeddings.weight": rows(hf["model.embed_tokens.weight"])}
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        if arch.layer_types[i] == "linear_attention":
            la, a = f"{p}linear_attn.", f"{m}self_attention."
            proj, conv = _deltanet_sections(arch)
            out[a + "in_proj.weight"] = sections(hf[la + "in_proj.weight"], proj)
            out[a + "conv1d.weight"] = sections(hf[la + "conv1d.weight"], conv)
            out[a + "dt_bias"], out[a + "A_log"] = rows(hf[la + "dt_bias"]), rows(hf[la + "A_log"])
            out[a + "out_norm.weight"] = hf[la + "norm.weight"].clone()
            out[a + "out_proj.weight"] = cols(hf[la + "out_proj.weight"])
        elif arch.mla is not None:
            for hf_name, name in MLA_NAMES.items():
                key = p + "self_attn." + hf_name + ".weight"
                if key in hf:
                    tensor = hf[key]
                    shard = tensor.clone() if tensor.dim() == 1 else rows(tensor)
                    out[m + "self_attention." + name + ".weight"] = shard
            out[m + "self_attention.linear_proj.weight"] = cols(hf[p + "self_attn.o_proj.weight"])
        else:
            qkv = _qkv_full(
                arch, hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"]
            )
            out[m + "self_attention.linear_qkv.weight"] = rows(qkv)
            out[m + "self_attention.linear_proj.weight"] = cols(hf[p + "self_attn.o_proj.weight"])
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        if arch.is_moe_layer(i):
            assert arch.moe is not None
            block, router, (w_gate, w_up, w_down), shared_block = moe_names(arch)
            moe, local = p + block, arch.moe.num_experts // ep
            out[m + "mlp.router.weight"] = hf[moe + f"{router}.weight"].clone()
            for j in range(local):
                e, x = f"{moe}experts.{ep_rank * local + j}.", f"{m}mlp.experts.local_experts.{j}."
                gate_up = [rows(hf[e + f"{w_gate}.weight"]), rows(hf[e + f"{w_up}.weight"])]
                out[x + "linear_fc1.weight"] = torch.cat(gate_up, dim=0)
                out[x + "linear_fc2.weight"] = cols(hf[e + f"{w_down}.weight"])
            if arch.moe.shared_expert_ffn_hidden_size:
                s, x = p + shared_block, m + "mlp.shared_experts."
                gate, up = rows(hf[s + "gate_proj.weight"]), rows(hf[s + "up_proj.weight"])
                out[x + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
                out[x + "linear_fc2.weight"] = cols(hf[s + "down_proj.weight"])
                if arch.moe.shared_expert_gate:  # replicated over TP (SharedExpertMLP.gate_weight)
                    out[x + "gate_weight"] = hf[shared_gate_name(arch, p)].clone()
            continue
        gate, up = rows(hf[p + "mlp.gate_proj.weight"]), rows(hf[p + "mlp.up_proj.weight"])
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = cols(hf[p + "mlp.down_proj.weight"])
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not arch.tied_embeddings:
        out["output_layer.weight"] = rows(hf["lm_head.weight"])
    return out


def from_megatron(shards: list[dict[str, torch.Tensor]], arch: ModelArch) -> dict[str, torch.Tensor]:
    """The full HF state dict from every TP rank's megatron parameters (rank order; at EP 1: every rank holds every
    expert)."""

    if "linear_attention" in arch.layer_types:
        raise NotImplementedError(
            f"model '{arch.name}': a gated-DeltaNet hybrid is trained only on the real backend; no Llama checkpoint "
            "for vLLM can hold its linear-attention layers"
        )

    def rows(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def cols(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    hf = {"model.embed_tokens.weight": rows("embedding.word_embeddings.weight")}
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        hf[p + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"]
        if arch.mla is not None:
            for hf_name, name in MLA_NAMES.items():
                key = m + "self_attention." + name + ".weight"
                if key in shards[0]:
                    one = shards[0][key].dim() == 1
                    hf[p + "self_attn." + hf_name + ".weight"] = shards[0][key] if one else rows(key)
        else:
            q, k, v = _qkv_split(arch, rows(m + "self_attention.linear_qkv.weight"))
            names = (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight")
            hf[names[0]], hf[names[1]], hf[names[2]] = q, k, v
        hf[p + "self_attn.o_proj.weight"] = cols(m + "self_attention.linear_proj.weight")
        hf[p + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"]
        if arch.is_moe_layer(i):
            assert arch.moe is not None
            block, router, (w_gate, w_up, w_down), shared_block = moe_names(arch)
            moe = p + block
            hf[moe + f"{router}.weight"] = shards[0][m + "mlp.router.weight"]
            for e in range(arch.moe.num_experts):
                x = f"{m}mlp.experts.local_experts.{e}."
                gate, up = _fc1_halves(shards, x + "linear_fc1.weight")
                hf[f"{moe}experts.{e}.{w_gate}.weight"], hf[f"{moe}experts.{e}.{w_up}.weight"] = gate, up
                hf[f"{moe}experts.{e}.{w_down}.weight"] = cols(x + "linear_fc2.weight")
            if arch.moe.shared_expert_ffn_hidden_size:
                s, x = p + shared_block, m + "mlp.shared_experts."
                hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"] = _fc1_halves(shards, x + "linear_fc1.weight")
                hf[s + "down_proj.weight"] = cols(x + "linear_fc2.weight")
                if arch.moe.shared_expert_gate:
                    hf[shared_gate_name(arch, p)] = shards[0][x + "gate_weight"]
            continue
        gate, up = _fc1_halves(shards, m + "mlp.linear_fc1.weight")
        hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = gate, up
        hf[p + "mlp.down_proj.weight"] = cols(m + "mlp.linear_fc2.weight")
    hf["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
    if not arch.tied_embeddings:
        hf["lm_head.weight"] = rows("output_layer.weight")
    return {name: t.contiguous() for name, t in hf.items()}


def merge_expert_shards(shards: list[dict[str, torch.Tensor]], arch: ModelArch) -> dict[str, torch.Tensor]:
    """One TP rank's megatron parameters with every expert, from the expert-parallel ranks' (EP rank order: rank ``r``
    holds experts ``r * local .. (r + 1) * local - 1`` as ``local_experts.0 ..``); the other parameters are the same
    on every EP rank and taken from the first."""
    if arch.moe is None:
        raise ValueError(f"model '{arch.name}' has no experts to merge")
    local = arch.moe.num_experts // len(shards)
    merged = {k: v for k, v in shards[0].items() if ".local_experts." not in k}
    for rank, shard in enumerate(shards):
        for name, tensor in shard.items():
            if ".local_experts." in name:
                head, rest = name.split(".local_experts.", 1)
                index, tail = rest.split(".", 1)
                merged[f"{head}.local_experts.{rank * local + int(index)}.{tail}"] = tensor
    return merged


def _fc1_halves(shards: list[dict[str, torch.Tensor]], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up projections of a fused ``linear_fc1`` whose TP shards each hold their gate slice then their up
    slice."""
    halves = [s[name].chunk(2, dim=0) for s in shards]
    return torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)


def write_llama_config(arch: ModelArch, path: Path, dtype: str) -> None:
    """``config.json`` of a ``LlamaForCausalLM`` with this architecture (``dtype``: "float32" or "bfloat16")."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype!r}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "rms_norm_eps": rms_norm_eps(arch),
        "rope_theta": rope_theta(arch),
        "tie_word_embeddings": arch.tied_embeddings,
        "torch_dtype": dtype,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": int(arch.extra.get("max_position_embeddings", 32768)),
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if arch.mla is not None:
        config.update(_deepseek_config(arch))
    elif arch.moe is not None:  # Mixtral: every layer MoE, softmax over the top-k logits (megatron's default routing)
        config.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            intermediate_size=arch.moe.expert_ffn_hidden_size,
            num_local_experts=arch.moe.num_experts,
            num_experts_per_tok=arch.moe.top_k,
            router_aux_loss_coef=0.0,
        )
        if arch.moe.shared_expert_ffn_hidden_size:  # not Mixtral's: written so the checkpoint is complete
            config["shared_expert_intermediate_size"] = arch.moe.shared_expert_ffn_hidden_size
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _deepseek_config(arch: ModelArch) -> dict[str, object]:
    """The DeepSeek-V3 keys of an MLA model's ``config.json`` (its MoE layers after ``first_k_dense_replace`` dense
    ones; softmax routing over the top-k, megatron's default, so no ``noaux_tc``)."""
    m = arch.mla
    assert m is not None
    config: dict[str, object] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "head_dim": m.qk_rope_head_dim,
        "num_key_value_heads": arch.num_attention_heads,
    }
    moe = arch.moe
    if moe is not None:
        first = next(i for i in range(arch.num_layers) if arch.is_moe_layer(i))
        config.update(
            n_routed_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.expert_ffn_hidden_size,
            n_shared_experts=moe.shared_expert_ffn_hidden_size // moe.expert_ffn_hidden_size,
            first_k_dense_replace=first,
            moe_layer_freq=1,
            scoring_func="softmax",
            topk_method="greedy",
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
        )
    return config


def write_checkpoint(hf: dict[str, torch.Tensor], arch: ModelArch, path: Path, dtype: torch.dtype) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (tied embeddings: no ``lm_head.weight``); returns ``path``."""
    from safetensors.torch import save_file

    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    write_llama_config(arch, path, name)
    target = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    save_file({k: v.detach().to("cpu", target).contiguous() for k, v in hf.items()}, str(path / "model.safetensors"))
    return path

"""A flash core attention for megatron-core's local layer spec: ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local spec runs ``DotProductAttention``, which materialises the ``[b * heads, s, s]`` scores and
probabilities; the seed's stack (TransformerEngine) runs flash attention, which keeps nothing quadratic. TransformerEngine
cannot be installed where this backend runs, so ``trainer.attention: flash`` swaps the local spec's ``core_attention``
for ``SdpaFlashAttention`` (``local_layer_spec``) and leaves the rest of the layer (norms, linears, LoRA, rotary,
recompute) as it is. The module calls SDPA with a causal mask (``is_causal``: the worker passes no mask tensor) and
``enable_gqa`` (K/V are never repeated), held to the flash backend: FlashAttention-2 on CUDA, ATen's flash kernel for
CPU on CPU. If that kernel cannot run a shape, SDPA raises instead of falling back to the math path (which would
materialise the scores and break what the simulator's walk models: ``memory_ops.sdpa_flash_attention``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend, sdpa_kernel


class SdpaFlashAttention(MegatronModule):
    """megatron-core's core-attention interface (``[s, b, heads, hd]`` in, ``[s, b, heads * hd]`` out) on SDPA.

    Causal self-attention only: no padding mask (the rows are left-padded and every position attends causally, as
    with megatron's causal mask), no attention bias, no packed (THD) sequences, no dropout.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_unused: Any,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaFlashAttention runs causal self-attention only, not {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SdpaFlashAttention runs without attention dropout")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale  # None: 1 / sqrt(head_dim), SDPA's default and megatron's

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaFlashAttention takes no attention bias and no packed sequences")
        seq, rows, heads, head_dim = query.shape
        # [s, b, n, d] -> [b, n, s, d] views; the kernels accept these strides (last dimension contiguous)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads
            )
        # the kernels lay the output out like the query ([s, b, n, d_v]), so this is a view, not a copy; d_v is the
        # value's width (multi-latent attention's v_head_dim)
        return out.permute(2, 0, 1, 3).reshape(seq, rows, heads * value.shape[-1])


def local_layer_spec(attention: str, num_experts: int | None = None, latent: bool = False) -> ModuleSpec:
    """megatron-core's local layer spec (RMSNorm) with the endpoint's core attention: ``unfused`` keeps megatron's
    ``DotProductAttention``, ``flash`` puts ``SdpaFlashAttention`` in its place. ``num_experts``: an MoE layer
    (megatron-core's local MoE: ``TopKRouter``, the configured token dispatcher, ``SequentialMLP`` experts and the
    shared expert when the config has one; no grouped GEMM without TransformerEngine). ``latent``: multi-latent
    attention (``MLASelfAttention`` with its q and kv norms), which megatron-core 0.16.1 builds only with a flash
    core attention here: its own ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``, which
    ``MultiLatentAttention.__init__`` passes."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        multi_latent_attention=latent,
        qk_layernorm=latent,
    )
    if latent and attention != "flash":
        raise ValueError("multi-latent attention runs with trainer.attention: flash on this backend")
    if attention == "unfused":
        return spec
    if attention != "flash":
        raise ValueError(f"unknown attention kernel {attention!r}")
    layer = spec.submodules
    attn = layer.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=ModuleSpec(module=SdpaFlashAttention))
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(layer, self_attention=dataclasses.replace(attn, submodules=attn_sub))
    )

"""The chunked gated delta rule on the CPU: FLA's algorithm and memory contract, in torch, for megatron-core's
``GatedDeltaNet``.

megatron-core's ``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net.py``) calls flash-linear-attention's
``chunk_gated_delta_rule`` and ``l2norm``, Triton kernels that need a GPU (SkyRL's Megatron extra installs
``flash-linear-attention``; its ``fla/ops/gated_delta_rule/chunk.py`` at commit ``bc3b101d`` is what this follows).
This module is a **reference implementation** of those kernels for the real backend on the CPU: the same algorithm
(chunks of 64 tokens, the WY representation of each chunk, a state per chunk) and the same tensors kept and made,
so what the real backend measures on the CPU is what FLA keeps on a GPU:

* forward (``ChunkGatedDeltaRuleFunction.forward``): the chunk-local cumulative decay ``g`` (fp32 ``[B, T, H]``),
  the solved intra-chunk matrix ``A`` (``[B, T, H, 64]`` in the keys' dtype), ``w`` and ``u`` (``[B, T, H, K]``,
  ``[B, T, H, V]``), the state entering each chunk ``h`` (``[B, NT, H, K, V]``, the keys' dtype) and the new values
  ``v_new``, then the output; it **keeps** ``q, k, v, g, beta, A`` (``ctx.save_for_backward``) and frees the rest;
* backward (``chunk_gated_delta_rule_bwd``): recomputes ``w, u`` and ``h, v_new``, then makes ``dv`` (local),
  ``dh`` (``[B, NT, H, K, V]``) and ``dv2``, ``dq, dk, dw`` and the fp32 ``dg``, the WY backward's ``dk2, dv, db``
  and fp32 ``dg2``, and the reversed cumulative sum of ``dg``; every one lives until the backward returns (they are
  the function's locals).

What differs from FLA: the arithmetic runs chunk by chunk in fp32 on the CPU, with chunk-sized temporaries (FLA
keeps them in registers); decays use ``exp`` rather than FLA's ``exp2`` of log2-scaled gates (the same values).
``l2norm`` (FLA's ``L2NormFunction``: keeps the output and its fp32 reciprocal norm) and the gated output norm
(megatron's ``_apply_gated_norm``, a ``torch.compile``-fused kernel on a GPU: modelled as keeping its two inputs) are
here too. ``install()`` puts them into megatron-core's module (it refuses to build a ``GatedDeltaNet`` without FLA).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 64
"""FLA's chunk size for the gated delta rule (``chunk_size=64``, the default and the fused intra-chunk path)."""


def _chunk_cumsum(g: torch.Tensor) -> torch.Tensor:
    """FLA's ``chunk_local_cumsum``: the gate's cumulative sum within each chunk, in fp32 (``output_dtype``)."""
    out = torch.empty_like(g, dtype=torch.float32)
    for t0 in range(0, g.shape[1], CHUNK):
        out[:, t0 : t0 + CHUNK] = g[:, t0 : t0 + CHUNK].float().cumsum(1)
    return out


def _bhl(x: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """A chunk of a ``[B, T, H, ...]`` tensor as fp32 ``[B, H, L, ...]``."""
    return x[:, t0:t1].float().transpose(1, 2)


def _store(dst: torch.Tensor, t0: int, t1: int, value: torch.Tensor) -> None:
    """Write a ``[B, H, L, ...]`` chunk back into a ``[B, T, H, ...]`` tensor."""
    dst[:, t0:t1] = value.transpose(1, 2).to(dst.dtype)


def _decay(gc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Gamma[i, j] = exp(g_i - g_j)`` for ``i >= j`` (else 0) of a chunk's cumulative gates ``[B, H, L]``, and the
    causal mask."""
    n = gc.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    diff = gc.unsqueeze(-1) - gc.unsqueeze(-2)
    return torch.exp(diff.masked_fill(~causal, float("-inf"))), causal


def _chunks(t: int) -> list[tuple[int, int, int]]:
    return [(c, t0, min(t0 + CHUNK, t)) for c, t0 in enumerate(range(0, t, CHUNK))]


def _w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, g: torch.Tensor) -> tuple[Any, Any]:
    """FLA's ``recompute_w_u_fwd``: ``w = A (beta e^g k)``, ``u = A (beta v)`` chunk by chunk."""
    w, u = k.new_empty(k.shape), torch.empty_like(v)
    for _, t0, t1 in _chunks(k.shape[1]):
        a = _bhl(A, t0, t1)[..., : t1 - t0]
        b, gc = _bhl(beta, t0, t1), _bhl(g, t0, t1)
        _store(w, t0, t1, a @ (_bhl(k, t0, t1) * (b * gc.exp()).unsqueeze(-1)))
        _store(u, t0, t1, a @ (_bhl(v, t0, t1) * b.unsqueeze(-1)))
    return w, u


def _states(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> tuple[Any, Any]:
    """FLA's ``chunk_gated_delta_rule_fwd_h``: the state entering each chunk ``h`` (the keys' dtype) and the new
    values ``v_new = u - w h``; the running state is fp32."""
    b, t, heads, kd = k.shape
    vd = u.shape[-1]
    chunks = _chunks(t)
    h = k.new_empty(b, len(chunks), heads, kd, vd)
    v_new = torch.empty_like(u)
    state = torch.zeros(b, heads, kd, vd, dtype=torch.float32)
    for c, t0, t1 in chunks:
        h[:, c] = state.to(h.dtype)
        vn = _bhl(u, t0, t1) - _bhl(w, t0, t1) @ state
        _store(v_new, t0, t1, vn)
        gc = _bhl(g, t0, t1)
        last = gc[..., -1:]
        kk = _bhl(k, t0, t1) * (last - gc).exp().unsqueeze(-1)
        state = state * last.exp().unsqueeze(-1) + kk.transpose(-1, -2) @ vn
    return h, v_new


def _solve_a(A: Any, k: Any, beta: Any, gcs: Any, t0: int, t1: int) -> None:
    """One chunk of ``A = (I + strictly_lower(beta_i k_i.k_j e^(g_i - g_j)))^-1`` (FLA's fused kkt + solve_tril)."""
    kc, b, gc = _bhl(k, t0, t1), _bhl(beta, t0, t1), _bhl(gcs, t0, t1)
    gamma, causal = _decay(gc)
    upper = causal.logical_not().logical_or(torch.eye(t1 - t0, dtype=torch.bool))  # keep the strictly lower part
    m = (kc @ kc.transpose(-1, -2)).mul_(gamma).mul_(b.unsqueeze(-1)).masked_fill_(upper, 0.0)
    del gamma
    eye = torch.eye(t1 - t0).expand_as(m)
    _store(A[..., : t1 - t0], t0, t1, torch.linalg.solve_triangular(m.add_(eye), eye, upper=False, unitriangular=True))


def _output(o: Any, q: Any, k: Any, gcs: Any, h: Any, v_new: Any, scale: float, c: int, t0: int, t1: int) -> None:
    """One chunk of FLA's ``chunk_fwd_o``: ``scale (q e^g h + tril(q k^T e^(g_i - g_j)) v_new)``."""
    qc, kc, gc = _bhl(q, t0, t1), _bhl(k, t0, t1), _bhl(gcs, t0, t1)
    gamma, _ = _decay(gc)
    scores = (qc @ kc.transpose(-1, -2)).mul_(gamma)
    del gamma
    out = (qc * gc.exp().unsqueeze(-1)) @ h[:, c].float()
    out += scores @ _bhl(v_new, t0, t1)
    _store(o, t0, t1, out.mul_(scale))


def forward(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float) -> tuple[Any, Any, Any]:
    """The gated delta rule's output and what its backward keeps: (``o``, the cumulative gates, ``A``)."""
    gcs = _chunk_cumsum(g)
    A = torch.zeros(*k.shape[:3], CHUNK, dtype=k.dtype)
    for _, t0, t1 in _chunks(k.shape[1]):
        _solve_a(A, k, beta, gcs, t0, t1)
    w, u = _w_u(k, v, beta, A, gcs)
    h, v_new = _states(k, w, u, gcs)
    o = torch.empty_like(v)
    for c, t0, t1 in _chunks(k.shape[1]):
        _output(o, q, k, gcs, h, v_new, scale, c, t0, t1)
    return o, gcs, A


def _dv_local(dv: Any, q: Any, k: Any, g: Any, do: Any, scale: float, t0: int, t1: int) -> None:
    """One chunk of FLA's ``chunk_bwd_dv_local``: ``tril(scale q k^T e^(g_i - g_j))^T do``."""
    gamma, _ = _decay(_bhl(g, t0, t1))
    p = (_bhl(q, t0, t1) @ _bhl(k, t0, t1).transpose(-1, -2)).mul_(gamma)
    del gamma
    _store(dv, t0, t1, (p.transpose(-1, -2) @ _bhl(do, t0, t1)).mul_(scale))


def _dqkwg(
    grads: tuple[Any, Any, Any, Any], inputs: tuple[Any, ...], scale: float, c: int, t0: int, t1: int
) -> None:
    """One chunk of FLA's ``chunk_bwd_dqkwg``: the queries', keys', ``w``'s and the cumulative gates' gradients."""
    dq, dk, dw, dg = grads
    q, k, g, do, h, dh, v_new, dv = inputs
    qc, kc, gc, doc = _bhl(q, t0, t1), _bhl(k, t0, t1), _bhl(g, t0, t1), _bhl(do, t0, t1)
    hc, dhc, vn, dvc = h[:, c].float(), dh[:, c].float(), _bhl(v_new, t0, t1), _bhl(dv, t0, t1)
    gamma, causal = _decay(gc)
    last = gc[..., -1:]
    dp = (doc @ vn.transpose(-1, -2)).masked_fill_(~causal, 0.0).mul_(gamma)  # the scores' gradient, decayed
    pd = (qc @ kc.transpose(-1, -2)).mul_(dp).mul_(scale)  # scores x their gradient: the decays' gradient
    del gamma
    dgc = pd.sum(-1) - pd.sum(-2)
    del pd
    dq_inter = (doc @ hc.transpose(-1, -2)).mul_(gc.exp().unsqueeze(-1)).mul_(scale)
    dgc += (dq_inter * qc).sum(-1)
    _store(dq, t0, t1, dq_inter.add_(dp @ kc, alpha=scale))
    del dq_inter
    decay_k = (last - gc).exp().unsqueeze(-1)
    dkk = (vn @ dhc.transpose(-1, -2)).mul_(decay_k)  # the gradient of k e^(g_last - g) in the state update, decayed
    term = (dkk * kc).sum(-1)
    dgc -= term
    dgc[..., -1] += term.sum(-1) + (dhc * hc).sum((-1, -2)) * last.exp()[..., 0]
    _store(dk, t0, t1, dkk.add_(dp.transpose(-1, -2) @ qc, alpha=scale))
    del dkk, dp
    _store(dw, t0, t1, (dvc @ hc.transpose(-1, -2)).neg_())
    dg[:, t0:t1] = dgc.transpose(1, 2)


def _wy_backward(grads: tuple[Any, Any, Any, Any], inputs: tuple[Any, ...], t0: int, t1: int) -> None:
    """One chunk of FLA's ``prepare_wy_repr_bwd``: back through ``w = A (beta e^g k)``, ``u = A (beta v)`` and
    ``A``'s inverse, to the keys, values, betas and cumulative gates."""
    dk2, dv3, db, dg2 = grads
    k, v, beta, g, A, dw, dv = inputs
    n = t1 - t0
    a = _bhl(A, t0, t1)[..., :n]
    kc, vc, bc, gc = _bhl(k, t0, t1), _bhl(v, t0, t1), _bhl(beta, t0, t1), _bhl(g, t0, t1)
    scale_k = (bc * gc.exp()).unsqueeze(-1)
    dwc, duc = _bhl(dw, t0, t1), _bhl(dv, t0, t1)
    da = (dwc @ (kc * scale_k).transpose(-1, -2)).add_(duc @ (vc * bc.unsqueeze(-1)).transpose(-1, -2))
    dm = a.transpose(-1, -2) @ da @ a.transpose(-1, -2)  # minus the gradient of (I + M)
    del da
    gamma, causal = _decay(gc)
    upper = causal.logical_not().logical_or(torch.eye(n, dtype=torch.bool))  # M is strictly lower
    dm.masked_fill_(upper, 0.0).neg_()
    kkg = (kc @ kc.transpose(-1, -2)).mul_(gamma)
    del gamma
    dbc = (dm * kkg).sum(-1)
    dmm = kkg.mul_(dm).mul_(bc.unsqueeze(-1))  # dM * M
    dg2c = dmm.sum(-1) - dmm.sum(-2)
    del dmm, kkg
    gb = dm.mul_(bc.unsqueeze(-1)).mul_(_decay(gc)[0])
    dx = a.transpose(-1, -2) @ dwc
    dk2c = (gb @ kc).add_(gb.transpose(-1, -2) @ kc)
    del gb, dm
    dbc += (dx * kc * gc.exp().unsqueeze(-1)).sum(-1)
    dg2c += (dx * kc * scale_k).sum(-1)
    _store(dk2, t0, t1, dk2c.add_(dx * scale_k))
    del dk2c, dx
    dy = a.transpose(-1, -2) @ duc
    dbc += (dy * vc).sum(-1)
    _store(dv3, t0, t1, dy.mul_(bc.unsqueeze(-1)))
    db[:, t0:t1] = dbc.transpose(1, 2).to(db.dtype)
    dg2[:, t0:t1] = dg2c.transpose(1, 2)


def backward(q: Any, k: Any, v: Any, g: Any, beta: Any, A: Any, scale: float, do: Any) -> tuple[Any, ...]:
    """FLA's ``chunk_gated_delta_rule_bwd`` (no initial state, no final-state gradient): ``dq, dk, dv, dg`` (the
    raw gate's, fp32) and ``dbeta``. Each chunk's arithmetic runs in a function of its own, so a chunk's scratch is
    gone before the next chunk's is made."""
    w, u = _w_u(k, v, beta, A, g)
    h, v_new = _states(k, w, u, g)
    chunks = _chunks(k.shape[1])
    dv = torch.empty_like(do)  # chunk_bwd_dv_local: the intra-chunk part of the new values' gradient
    for _, t0, t1 in chunks:
        _dv_local(dv, q, k, g, do, scale, t0, t1)
    # chunk_gated_delta_rule_bwd_dhu: the state gradients, from the last chunk back, and the values' whole gradient
    dh, dv2 = q.new_empty(h.shape), torch.empty_like(dv)
    d_state = torch.zeros(h.shape[0], h.shape[2], h.shape[3], h.shape[4], dtype=torch.float32)
    for c, t0, t1 in reversed(chunks):
        d_state = _state_grad(d_state, dh, dv2, (q, k, g, do, w, dv), scale, c, t0, t1)
    dv = dv2
    # chunk_bwd_dqkwg: the queries', keys' and w's gradients and the gates' (fp32), chunk by chunk
    dq, dk, dw = q.new_empty(q.shape), k.new_empty(k.shape), w.new_empty(w.shape)
    dg = torch.empty_like(g, dtype=torch.float32)
    for c, t0, t1 in chunks:
        _dqkwg((dq, dk, dw, dg), (q, k, g, do, h, dh, v_new, dv), scale, c, t0, t1)
    # prepare_wy_repr_bwd: through w = A (beta e^g k) and u = A (beta v), and A's inverse
    dk2, dv3, db = k.new_empty(k.shape), torch.empty_like(v), torch.empty_like(beta)
    dg2 = torch.empty_like(g, dtype=torch.float32)
    for _, t0, t1 in chunks:
        _wy_backward((dk2, dv3, db, dg2), (k, v, beta, g, A, dw, dv), t0, t1)
    dv = dv3
    dk.add_(dk2)
    dg.add_(dg2)
    dg_raw = torch.empty_like(dg)  # chunk_local_cumsum(reverse=True): back through the forward's cumulative sum
    for _, t0, t1 in chunks:
        dg_raw[:, t0:t1] = dg[:, t0:t1].flip(1).cumsum(1).flip(1)
    return dq, dk, dv, dg_raw, db


def _state_grad(d_state: Any, dh: Any, dv2: Any, inputs: tuple[Any, ...], scale: float, c: int, t0: int, t1: int) -> Any:
    """One chunk of FLA's ``chunk_gated_delta_rule_bwd_dhu``, from the last chunk back: the gradient of the state
    leaving chunk ``c`` into ``dh``, the values' whole gradient into ``dv2``; returns the gradient of the state
    entering it."""
    q, k, g, do, w, dv = inputs
    gc = _bhl(g, t0, t1)
    last = gc[..., -1:]
    dh[:, c] = d_state.to(dh.dtype)
    dvc = (_bhl(k, t0, t1) * (last - gc).exp().unsqueeze(-1)) @ d_state
    dvc += _bhl(dv, t0, t1)
    _store(dv2, t0, t1, dvc)
    qg = _bhl(q, t0, t1) * gc.exp().unsqueeze(-1)
    d_state = d_state * last.exp().unsqueeze(-1)
    d_state.add_(qg.transpose(-1, -2) @ _bhl(do, t0, t1), alpha=scale)
    return d_state.sub_(_bhl(w, t0, t1).transpose(-1, -2) @ dvc)


class ChunkGatedDeltaRule(torch.autograd.Function):
    """``fla.ops.gated_delta_rule.ChunkGatedDeltaRuleFunction`` on the CPU: keeps ``q, k, v``, the cumulative gates
    and ``A``; the backward recomputes the rest."""

    @staticmethod
    def forward(ctx: Any, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: float) -> Any:
        o, gcs, A = forward(q, k, v, g, beta, scale)
        ctx.save_for_backward(q, k, v, gcs, beta, A)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx: Any, do: Any) -> tuple[Any, ...]:
        q, k, v, g, beta, A = ctx.saved_tensors
        dq, dk, dv, dg, db = backward(q, k, v, g, beta, A, ctx.scale, do)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), None


def chunk_gated_delta_rule(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Any, None]:
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` as megatron-core calls it (no initial or final state, no
    in-kernel l2 norm); returns the output and no final state."""
    if initial_state is not None or output_final_state or use_qk_l2norm_in_kernel or kwargs:
        raise NotImplementedError("the CPU gated delta rule runs megatron-core's training call only")
    return ChunkGatedDeltaRule.apply(q, k, v, g, beta, scale if scale is not None else k.shape[-1] ** -0.5), None


def _wide(x: Any) -> Any:
    """``x`` in fp32 at least (16-bit inputs are computed in fp32, as the kernels do)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class L2Norm(torch.autograd.Function):
    """``fla.modules.l2norm.L2NormFunction``: ``y = x / ||x||`` over the last dimension; keeps ``y`` and the fp32
    reciprocal norm."""

    @staticmethod
    def forward(ctx: Any, x: Any, eps: float = 1e-6) -> Any:
        rstd = torch.rsqrt(_wide(x).square().sum(-1) + eps)
        y = (_wide(x) * rstd.unsqueeze(-1)).to(x.dtype)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Any) -> tuple[Any, None]:
        y, rstd = ctx.saved_tensors
        yf, dyf = _wide(y), _wide(dy)
        dx = (dyf - yf * (dyf * yf).sum(-1, keepdim=True)) * rstd.unsqueeze(-1)
        return dx.to(y.dtype), None


def l2norm(x: Any, eps: float = 1e-6, output_dtype: Any = None) -> Any:
    return L2Norm.apply(x, eps)


class GatedNorm(torch.autograd.Function):
    """megatron-core's ``GatedDeltaNet._apply_gated_norm`` as one fused kernel: ``rmsnorm(x) * w * silu(gate)`` in
    fp32, cast back; keeps its two inputs, like the ``torch.compile``d kernel it replaces on a GPU (whose partitioner
    recomputes pointwise ops from the inputs). Its backward holds three ``x``-sized fp32 temporaries beside the two
    gradients it returns (the normalised input, the gate's sigmoid, one product)."""

    @staticmethod
    def forward(ctx: Any, x: Any, gate: Any, weight: Any, eps: float) -> Any:
        ctx.save_for_backward(x, gate)
        ctx.weight, ctx.eps = weight, eps
        xf = _wide(x)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * _wide(weight)
        return y.mul_(torch.nn.functional.silu(_wide(gate))).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Any) -> tuple[Any, Any, None, None]:
        x, gate = ctx.saved_tensors
        xf, gf = _wide(x), _wide(gate)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + ctx.eps)
        n = xf * rstd
        sig = torch.sigmoid(gf)
        t = _wide(dy) * _wide(ctx.weight)
        dgate = t * n  # d/dgate of silu(gate): sig * (1 + gate * (1 - sig))
        slope = torch.sub(1.0, sig).mul_(gf).add_(1.0).mul_(sig)
        dgate.mul_(slope)
        del slope
        dn = t.mul_(sig).mul_(gf)  # the normalised input's gradient: dy * w * silu(gate)
        del sig
        dot = (dn * n).mean(-1, keepdim=True)
        dx = dn.sub_(n.mul_(dot)).mul_(rstd)
        return dx.to(x.dtype), dgate.to(gate.dtype), None, None


def gated_norm(module: Any, x: Any, gate: Any) -> Any:
    """``_apply_gated_norm``'s replacement, bound to a ``GatedDeltaNet``: its ``out_norm`` (an RMSNorm over the value
    head) with the output gate."""
    x2, g2 = x.reshape(-1, x.shape[-1]), gate.reshape(-1, gate.shape[-1])
    norm = module.out_norm
    return GatedNorm.apply(x2, g2, norm.weight, float(getattr(norm, "eps", 1e-6)))


def install() -> None:
    """Put the CPU kernels into megatron-core's ``gated_delta_net`` module (FLA is absent: megatron-core refuses to
    build the layer then) and its gated norm in place of the ``torch.compile``d one."""
    from megatron.core.ssm import gated_delta_net

    gated_delta_net.HAVE_FLA = True
    gated_delta_net.chunk_gated_delta_rule = chunk_gated_delta_rule
    gated_delta_net.l2norm = l2norm
    gated_delta_net.GatedDeltaNet._apply_gated_norm = gated_norm

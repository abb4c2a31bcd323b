"""The CPU gated delta rule (``megatron_vllm.gated_delta_rule``, FLA's algorithm in torch) against megatron-core's
own torch reference (``torch_chunk_gated_delta_rule``, what its deterministic mode runs) and against autograd
through it: the same outputs and the same gradients, over lengths that are not a multiple of the chunk."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
gdn = pytest.importorskip("megatron.core.ssm.gated_delta_net")

from skyrl_sim_plugins.megatron_vllm import gated_delta_rule  # noqa: E402


def inputs(seed: int, t: int, heads: int = 3, kd: int = 8, vd: int = 6, batch: int = 2) -> list:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, t, heads, kd, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, t, heads, kd, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, t, heads, vd, generator=gen, dtype=torch.float64)
    g = -torch.nn.functional.softplus(torch.randn(batch, t, heads, generator=gen, dtype=torch.float64))
    beta = torch.rand(batch, t, heads, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize(("seed", "t"), [(0, 5), (1, 64), (2, 150), (3, 129)])
def test_outputs_and_gradients_match_megatrons_reference(seed: int, t: int) -> None:
    ours_in = inputs(seed, t)
    ref_in = [x.detach().clone().requires_grad_() for x in ours_in]
    out, _ = gated_delta_rule.chunk_gated_delta_rule(*ours_in)
    ref, _ = gdn.torch_chunk_gated_delta_rule(*ref_in)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-6)  # both compute in fp32
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    ours = torch.autograd.grad(out, ours_in, grad)
    theirs = torch.autograd.grad(ref, ref_in, grad)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_the_forward_keeps_what_flas_keeps() -> None:
    """q, k, v, beta (the inputs), the fp32 cumulative gates and A [B, T, H, 64]: nothing chunk-state-sized."""
    q, k, v, g, beta = (x.detach().float().requires_grad_() for x in inputs(0, 130))
    out, _ = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta)
    saved = out.grad_fn.saved_tensors
    shapes = sorted(tuple(x.shape) for x in saved)
    assert shapes == sorted([(2, 130, 3, 8), (2, 130, 3, 8), (2, 130, 3, 6), (2, 130, 3), (2, 130, 3), (2, 130, 3, 64)])


def test_l2norm_and_gated_norm_gradients() -> None:
    x = torch.randn(4, 5, 8, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: gated_delta_rule.l2norm(t), (x,))
    gate = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64)
    torch.autograd.gradcheck(lambda a, b: gated_delta_rule.GatedNorm.apply(a, b, w, 1e-6), (y, gate))

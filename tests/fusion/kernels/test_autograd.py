"""`fusion.kernels.autograd`: the operators' derivatives are the reference's (gradcheck in
float64; autograd of the reference in float32 and bfloat16, where `upcast` rounds)."""

from __future__ import annotations

import pytest
import torch

from fusion.kernels import ops
from fusion.kernels import reference as torch_ref
from fusion.kernels.norm_variant import NormVariant

VARIANTS = [
    NormVariant(upcast=False),
    NormVariant(offset=1.0, upcast=False),
    NormVariant(upcast=False, weight_after_cast=False),
    NormVariant(offset=1.0, upcast=False, weight_after_cast=False),
    NormVariant(upcast=False, cast_to_weight=True),
]
"""Variants in the input's dtype (float64 here: what gradcheck needs)."""


def _leaf(*shape: int, dtype=torch.float64, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_gradcheck(variant, weighted) -> None:
    x = _leaf(2, 3, 5).requires_grad_(True)
    w = (1 + _leaf(5, scale=0.1, seed=1)).requires_grad_(True) if weighted else None
    args = (1e-6, *ops._operator_args(variant), "torch")
    assert torch.autograd.gradcheck(lambda x, w: torch.ops.fusion.rms_norm(x, w, *args), (x, w))


@pytest.mark.parametrize("variant", VARIANTS[:4])
def test_add_rms_norm_gradcheck(variant) -> None:
    a, b = _leaf(3, 4).requires_grad_(True), _leaf(3, 4, seed=2).requires_grad_(True)
    w = (1 + _leaf(4, scale=0.1, seed=1)).requires_grad_(True)

    def both(a, b, w):
        return torch.ops.fusion.add_rms_norm(a, b, w, 1e-6, *ops._operator_args(variant), "torch")

    assert torch.autograd.gradcheck(both, (a, b, w))
    # only the normalised output used: the sum's gradient arrives as None or zeros
    assert torch.autograd.gradcheck(lambda a, b, w: both(a, b, w)[1], (a, b, w))


@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
def test_act_and_mul_gradcheck(activation) -> None:
    x = _leaf(3, 8).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: torch.ops.fusion.act_and_mul(x, activation, "torch"), (x,)
    )


def test_moe_experts_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = _leaf(5, 6).requires_grad_(True)
    gate_up = _leaf(3, 8, 6, scale=0.5, seed=1).requires_grad_(True)
    down = _leaf(3, 6, 4, scale=0.5, seed=2).requires_grad_(True)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=g, dtype=torch.float64).requires_grad_(True)

    def fn(h, gu, d, w):
        return torch.ops.fusion.moe_experts(h, gu, d, ids, w, "silu", "torch")

    assert torch.autograd.gradcheck(fn, (hidden, gate_up, down, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "variant",
    [
        NormVariant(),
        NormVariant(offset=1.0, weight_after_cast=False),
        NormVariant(cast_to_weight=True),
    ],
)
def test_rms_norm_backward_matches_reference_autograd(dtype, variant) -> None:
    """In low precision (statistics upcast to float32) the formula's gradients agree with
    autograd through the reference's own ops up to that dtype's rounding."""
    x = _leaf(4, 16, dtype=dtype).requires_grad_(True)
    w = (1 + _leaf(16, scale=0.1, seed=1)).to(dtype).requires_grad_(True)
    grad = _leaf(4, 16, seed=3).to(dtype)
    want = torch.autograd.grad(torch_ref.rms_norm(x, w, 1e-6, variant=variant), (x, w), grad)
    got = torch.autograd.grad(
        torch.ops.fusion.rms_norm(x, w, 1e-6, *ops._operator_args(variant), "torch"), (x, w), grad
    )
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(
            g.float(), e.float(), rtol=2e-2, atol=2e-2 * e.abs().max().item()
        )


def test_moe_backward_operator_has_a_fake() -> None:
    """The backward operator traces on fake tensors (so a compiled training step can hold
    it as one node) and its fake outputs match the real ones' shapes and dtypes."""
    args = (
        torch.randn(5, 6),
        torch.randn(5, 6),
        torch.randn(3, 8, 6),
        torch.randn(3, 6, 4),
        torch.randint(0, 3, (5, 2)),
        torch.rand(5, 2),
        "silu",
    )
    torch.library.opcheck(torch.ops.fusion.moe_experts_backward, args)

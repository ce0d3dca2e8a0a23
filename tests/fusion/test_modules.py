"""`fusion.modules`: the fused modules hold exactly the state they replace and compute the
function of the originals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion.modules import ActAndMul, FusedRMSNorm, MergedLinear


def _linears(bias: tuple[bool, ...] = (False, False, False)) -> dict[str, nn.Linear]:
    torch.manual_seed(0)
    sizes = (8, 4, 4)
    return {name: nn.Linear(6, n, bias=b) for name, n, b in zip("qkv", sizes, bias)}


def test_merged_linear_is_the_concatenated_projections() -> None:
    linears = _linears((True, False, True))
    merged = MergedLinear.from_linears(linears)
    x = torch.randn(3, 6)
    want = torch.cat([lin(x) for lin in linears.values()], dim=-1)
    torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)
    assert merged.output_sizes == [8, 4, 4] and merged.shard_bias == (True, False, True)
    assert not merged.bias.detach()[8:12].any()  # the bias-less shard's exact zeros


def test_merged_linear_carries_the_shards_state() -> None:
    linears = _linears()
    for lin in linears.values():
        lin.weight.requires_grad_(False)
        lin.weight.tag = "frozen-by-user"
    merged = MergedLinear.from_linears(linears)
    assert not merged.weight.requires_grad and merged.weight.tag == "frozen-by-user"


def test_mixed_bias_zero_slices_take_no_gradient() -> None:
    """The zero slices stand in for absent biases: no gradient reaches them (a step would
    otherwise give a bias-less projection a bias); the others' gradients are untouched."""
    merged = MergedLinear.from_linears(_linears((True, False, True)))
    merged(torch.randn(5, 6)).square().sum().backward()
    grad = merged.bias.grad
    assert not grad[8:12].any() and grad[:8].abs().sum() > 0 and grad[12:].abs().sum() > 0


def test_merged_linear_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        MergedLinear(4, [2, 2], ["a"], [False, False])


def test_act_and_mul() -> None:
    x = torch.randn(2, 8)
    got = ActAndMul("silu", backend="torch")(x)
    assert torch.equal(got, nn.functional.silu(x[:, :4]) * x[:, 4:])


def test_fused_rms_norm_refuses_unproven_dtypes() -> None:
    weight = nn.Parameter(torch.ones(8))
    norm = FusedRMSNorm(weight, 1e-6, verified=frozenset({(torch.float32, torch.float32)}))
    assert norm.weight is weight  # the replaced module's own Parameter, never a copy
    assert norm(torch.randn(2, 8)).shape == (2, 8)
    with pytest.raises(TypeError, match="proven equal"):
        norm(torch.randn(2, 8, dtype=torch.float64))

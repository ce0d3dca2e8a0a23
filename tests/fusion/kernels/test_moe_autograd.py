"""The reference MoE experts kernel under autograd (found by tests/fuzz).

`moe_experts` wrote each expert's GEMM into a slice of one buffer with `torch.mm(..., out=)`,
which autograd rejects ("mm(): functions with out=... arguments don't support automatic
differentiation"), so every fused MoE block crashed when called outside `torch.no_grad()`
while the original ran. Shrunk fuzzer example: any MoE block the MoE fuser accepts, e.g. a
ModuleList of three `down(act(gate(x)) * up(x))` experts with top-2 softmax routing, called
on a `[2, 3, 8]` input with autograd on.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.kernels.reference import moe_experts
from tests.fusion.fusers.moe_helpers import HIDDEN, qwen3_block


def _reference(hidden, gate_up, down, ids, weights):
    """Transformers' eager expert loop, written plainly."""
    out = torch.zeros_like(hidden)
    inter = gate_up.shape[1] // 2
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            projected = gate_up[e] @ hidden[t]
            act = F.silu(projected[:inter]) * projected[inter:]
            out[t] = out[t] + weights[t, k] * (down[e] @ act)
    return out


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(5, 8, generator=g)
    gate_up = torch.randn(3, 2 * 6, 8, generator=g) * 0.3
    down = torch.randn(3, 8, 6, generator=g) * 0.3
    ids = torch.topk(torch.randn(5, 3, generator=g), 2, dim=-1).indices
    weights = torch.rand(5, 2, generator=g)
    return hidden, gate_up, down, ids, weights


def test_moe_experts_is_differentiable() -> None:
    hidden, gate_up, down, ids, weights = _inputs()
    with torch.no_grad():
        expected = moe_experts(hidden, gate_up, down, ids, weights, "silu")
    leaves = [t.clone().requires_grad_() for t in (hidden, gate_up, down, weights)]
    got = moe_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3], "silu")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, gate_up, down, weights)]
    ref = _reference(ref_leaves[0], ref_leaves[1], ref_leaves[2], ids, ref_leaves[3])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    ref.square().sum().backward()
    for mine, theirs in zip(leaves, ref_leaves):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
def test_fused_moe_block_runs_where_the_original_does(grad: bool) -> None:
    """The shrunk fuzzer example was a Transformers 4 block (now refused as a whole); a
    Transformers 5 Qwen3-MoE block reaches the same kernel under autograd."""
    torch.manual_seed(0)
    model = nn.Sequential(qwen3_block())
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert [r.fuser for r in report.applied] == ["moe"], report.skipped
    x = torch.randn(2, 3, HIDDEN)
    with torch.set_grad_enabled(grad):
        expected, got = model(x), fused(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

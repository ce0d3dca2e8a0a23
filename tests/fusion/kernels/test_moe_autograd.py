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
from fusion.kernels.torch_ref import moe_experts


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


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(8, 16, bias=False)
        self.up_proj = nn.Linear(8, 16, bias=False)
        self.down_proj = nn.Linear(16, 8, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """The shrunk fuzzer example (Transformers 4 layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.gate = nn.Linear(8, 3, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(3)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros_like(hidden_states)
        for expert_idx in range(len(self.experts)):
            top_x, idx = torch.where(selected_experts == expert_idx)
            current = self.experts[expert_idx](hidden_states[top_x])
            current = current * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])
def test_fused_moe_block_runs_where_the_original_does(grad: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(SparseMoE())
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert [r.fuser for r in report.applied] == ["moe"], report.skipped
    x = torch.randn(2, 3, 8)
    with torch.set_grad_enabled(grad):
        expected, got = model(x), fused(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

"""QKV fuser on an attention forward whose plain trace stops before its first projection.

Transformers 4's SDPA attention classes start with `if output_attentions: return
super().forward(...)`: control flow on an argument, which fx cannot trace. The projection
fusers then retrace deciding such branches (the flag's default here), reach the projections,
and refuse on the source: `super()` makes the forward a closure that cannot be recompiled.
Where even the deciding trace stops before any projection, nothing can be fused (fail-closed)
and the plan says so with a reason; a container without a forward stays without one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fusion
from tests.fusion.fusers.helpers import fuse_copy, outputs_match, reasons

HIDDEN, HEADS = 32, 4


def eager_attention_forward(module, q, k, v):
    """Module-level `*attention_forward`: the tracer keeps it one opaque leaf (as in HF)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True), None


class EagerAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, output_attentions: bool = False):
        q = self._heads(self.q_proj(hidden_states))
        k = self._heads(self.k_proj(hidden_states))
        v = self._heads(self.v_proj(hidden_states))
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(hidden_states.shape))


class SdpaAttention(EagerAttention):
    """The Transformers 4 pattern: a branch on an argument before any projection."""

    def forward(self, hidden_states: torch.Tensor, output_attentions: bool = False):
        if output_attentions:
            return super().forward(hidden_states, output_attentions=output_attentions)
        q = self._heads(self.q_proj(hidden_states))
        k = self._heads(self.k_proj(hidden_states))
        v = self._heads(self.v_proj(hidden_states))
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(hidden_states.shape))


class FlagBranch(EagerAttention):
    """A branch on a flag argument before the projections, without `super()`."""

    def forward(self, hidden_states: torch.Tensor, output_attentions: bool = False):
        if output_attentions:
            hidden_states = hidden_states * 1.0
        q = self._heads(self.q_proj(hidden_states))
        k = self._heads(self.k_proj(hidden_states))
        v = self._heads(self.v_proj(hidden_states))
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(hidden_states.shape))


class UnknownSplat(EagerAttention):
    """A `*`-splat of a shape no meta value answers, before any projection."""

    def forward(self, hidden_states: torch.Tensor, other: torch.Tensor):
        shape = (*other.shape[:-1], HEADS, -1)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(hidden_states.shape))


def test_the_super_branch_is_traced_past_and_refused_on_the_source() -> None:
    module = SdpaAttention().eval()
    report = fusion.plan(module)
    assert not report.applied
    assert "the forward is a closure (super() or an enclosing scope)" in reasons(report)
    fused, _ = fuse_copy(module)
    assert outputs_match(module, fused, 2, 5, HIDDEN)
    assert set(dict(fused.named_children())) == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_a_flag_branch_is_traced_past_and_fused_on_both_paths() -> None:
    module = FlagBranch().eval()
    fused, report = fuse_copy(module)
    assert report.counts() == {"qkv": 1}, str(report)
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        for flag in (False, True):
            assert torch.allclose(module(x, flag), fused(x, flag), atol=1e-6)


def test_a_trace_that_stops_before_the_projections_is_refused_with_a_reason() -> None:
    module = UnknownSplat().eval()
    report = fusion.plan(module)
    assert not report.applied
    assert "the forward does not trace as far as its projections" in reasons(report)


def test_the_traceable_parent_still_fuses() -> None:
    assert fusion.plan(EagerAttention().eval()).counts() == {"qkv": 1}


def test_a_container_without_forward_gets_no_verdict() -> None:
    layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
    report = fusion.plan(layers)
    assert not report.applied and not report.skipped

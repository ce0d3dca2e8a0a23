"""fusion.fusers.matches: a fuser finding no pattern on a trace that stopped early is a recorded
refusal (where the trace stopped, which children it never reached), never silence."""

from __future__ import annotations

import torch
from torch import nn

import fusion
from fusion.fusers import registry
from fusion.fusers.matches import unreached_projections
from fusion.trace.tracer import trace

SHIFT = nn.Identity()
"""A module object called as a global, not a submodule: fx can give it no name, so the
trace stops at its call (Transformers 5.25's kernels function layers did this to every
Llama-family attention before the tracer learnt to see through them)."""


class StopsAfterProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.k_proj = nn.Linear(16, 16, bias=False)
        self.v_proj = nn.Linear(16, 16, bias=False)
        self.o_proj = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = SHIFT(q)
        weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return self.o_proj(weights @ v)


class StopsAfterEveryChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.a(x))
        return SHIFT(h)


def test_a_stopped_trace_is_a_refusal_naming_where_and_what_was_never_reached() -> None:
    registry.clear_cache()
    module = StopsAfterProjections()
    assert unreached_projections(module, trace(module)) == ("o_proj",)
    found = {c.fuser_name: c for c in registry.candidates(module)}
    qkv = found["qkv"]
    assert qkv.fuser is None
    assert qkv.reason is not None
    assert qkv.reason.startswith("the trace stops at `q = SHIFT(q)` in StopsAfterProjections")
    assert qkv.reason.endswith("(never reached: o_proj)")
    # ...and it is in the report `fusion.plan` gives, beside what another fuser took.
    report = fusion.plan(nn.Sequential(StopsAfterProjections()))
    assert any(r.fuser == "qkv" and "the trace stops at" in r.reason for r in report.skipped)


def test_a_trace_that_reached_every_child_adds_no_refusal() -> None:
    registry.clear_cache()
    module = StopsAfterEveryChild()
    assert unreached_projections(module, trace(module)) == ()
    assert not any(c.reason and "the trace stops" in c.reason for c in registry.candidates(module))


def test_no_graph_reaches_no_projection() -> None:
    assert unreached_projections(StopsAfterEveryChild(), None) == ("a", "b")
    assert unreached_projections(nn.Sequential(nn.LayerNorm(4)), None) == ()
    experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))  # no forward: not a finding
    assert unreached_projections(experts, None) == ()

"""`fusion.fusers.stacked`: the checks every projection-stacking fuser relies on refuse
exactly what a merged call would bypass or change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion.errors import RewriteRefused
from fusion.fusers.stacked import (
    check_plain_linear,
    check_stackable,
    projection_graph,
    unique_targets,
)
from fusion.trace.graph import output_value
from fusion.trace.tracer import trace
from tests.fusion.fusers import hazards
from tests.fusion.fusers.helpers import fuse_copy


class LoggingLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) + 0.0


def test_check_plain_linear_refuses_what_a_merged_call_would_bypass() -> None:
    module = hazards.Attention()
    assert check_plain_linear(module, "q_proj") is module.q_proj
    module.k_proj = LoggingLinear(32, 16, bias=False)
    with pytest.raises(RewriteRefused, match=r"an nn\.Linear with its own forward"):
        check_plain_linear(module, "k_proj")
    module.v_proj.forward = lambda x: x
    with pytest.raises(RewriteRefused, match="instance-level forward"):
        check_plain_linear(module, "v_proj")
    module.o_proj = nn.Identity()
    with pytest.raises(RewriteRefused, match=r"Identity, not nn\.Linear"):
        check_plain_linear(module, "o_proj")


def test_check_stackable_needs_one_input_width_dtype_and_a_free_name() -> None:
    module = hazards.Attention()
    assert list(check_stackable(module, ("q_proj", "k_proj", "v_proj"), "qkv_proj")) == [
        "q_proj",
        "k_proj",
        "v_proj",
    ]
    module.qkv_proj = nn.Identity()
    with pytest.raises(RewriteRefused, match="already has an attribute qkv_proj"):
        check_stackable(module, ("q_proj", "k_proj"), "qkv_proj")
    module = hazards.Attention()
    module.v_proj = nn.Linear(32, 16, bias=False).to(torch.float64)
    with pytest.raises(RewriteRefused, match="mixed dtypes"):
        check_stackable(module, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
    module = hazards.Attention()
    module.k_proj = nn.Linear(16, 16, bias=False)
    with pytest.raises(RewriteRefused, match="reads 16 features, not 32"):
        check_stackable(module, ("q_proj", "k_proj"), "qkv_proj")


def test_unique_targets() -> None:
    class Node:
        def __init__(self, target):
            self.target = target

    assert unique_targets([Node("q"), Node("k")]) == ("q", "k")
    assert unique_targets([Node("q"), Node("q")]) is None


class MaskedProjections(nn.Module):
    """An optional mask scales the input before a `*`-splat of its shape: left a proxy, the
    mask has no meta value, so only a trace with optional arguments None gets past it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 4, bias=False)
        self.out = nn.Linear(12, 8, bias=False)

    def forward(self, x, mask=None):
        if mask is not None:
            x = x * mask
        shape = (*x.shape[:-1], 2, -1)
        first = self.a(x).view(shape)
        second = self.b(x).view(shape)
        return self.out(torch.cat([first, second], dim=-1).flatten(-2))


class ShapeAssert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        assert list(x.size())[-1] == 8
        return self.a(x) * self.b(x)


def test_projection_graph_keeps_a_complete_trace() -> None:
    module = hazards.Attention()
    graph = trace(module)
    assert projection_graph(graph, module) == (graph, False)


@pytest.mark.parametrize("cls", [MaskedProjections, ShapeAssert])
def test_projection_graph_decides_branches_until_the_projections(cls: type[nn.Module]) -> None:
    module = cls()
    plain = trace(module)
    assert plain is not None and output_value(plain) is None
    graph, decided = projection_graph(plain, module)
    assert decided and graph is not None and output_value(graph) is not None
    called = [str(n.target) for n in graph.nodes if n.op == "call_module"]
    assert called[:2] == ["a", "b"]


def test_a_decided_graph_merges_on_every_path_with_contiguous_pieces() -> None:
    module = MaskedProjections()
    fused, report = fuse_copy(module)
    assert report.counts() == {"sibling": 1}, str(report)
    assert "self.a_b_merged(x, ('contiguous', 'contiguous'))" in report.applied[0].rewritten_source
    x, mask = torch.randn(2, 5, 8), torch.rand(2, 5, 1)
    with torch.no_grad():
        assert torch.allclose(module(x), fused(x), atol=1e-6)
        assert torch.allclose(module(x, mask), fused(x, mask), atol=1e-6)

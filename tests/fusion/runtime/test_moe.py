"""`fusion.runtime.moe`: the routing program reproduces a router op by op; PackedExperts
packs Transformers 4 experts as Transformers 5 does."""

from __future__ import annotations

import torch
from torch import nn

from fusion.runtime.moe import GroupLimit, PackedExperts, RouteSpec, RouteStep, route


def test_softmax_topk_renormalise_is_mixtrals_router() -> None:
    spec = RouteSpec(
        None,
        None,
        (RouteStep("softmax", torch.float), RouteStep("topk", value=2), RouteStep("renorm")),
    )
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    logits, weights, ids = route(spec, x, w)
    torch.testing.assert_close(logits, x @ w.t())
    probs = torch.softmax(x @ w.t(), dim=-1, dtype=torch.float)
    want_weights, want_ids = torch.topk(probs, 2, dim=-1)
    want_weights = want_weights / want_weights.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights)
    assert "top-2" in spec.describe() and spec.top_k == 2


def test_group_limited_selection_only_picks_kept_groups() -> None:
    limit = GroupLimit(groups=2, kept=1, per_group_k=1, sorted=True)
    spec = RouteSpec(None, None, (RouteStep("sigmoid"), RouteStep("select", value=2, groups=limit)))
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 0.0, 3.0, 2.0]])
    _, weights, ids = route(spec, torch.zeros(2, 1), None, logits=logits)
    assert ids[0].tolist() == [0, 1] and ids[1].tolist() == [2, 3]
    assert torch.equal(weights, torch.sigmoid(logits).gather(1, ids))
    assert "in the best 1 of 2 groups" in spec.describe()


def test_packed_experts_stack_gate_then_up() -> None:
    experts = nn.ModuleList(
        nn.ModuleDict(
            {
                "w1": nn.Linear(6, 4, bias=False),
                "w3": nn.Linear(6, 4, bias=False),
                "w2": nn.Linear(4, 6, bias=False),
            }
        )
        for _ in range(3)
    )
    packed = PackedExperts.from_mlps(experts, ("w1", "w3", "w2"))
    assert packed.gate_up_proj.shape == (3, 8, 6) and packed.down_proj.shape == (3, 6, 4)
    assert torch.equal(packed.gate_up_proj[1, :4], experts[1]["w1"].weight)
    assert torch.equal(packed.gate_up_proj[1, 4:], experts[1]["w3"].weight)
    assert torch.equal(packed.down_proj[2], experts[2]["w2"].weight)
    assert packed.num_experts == 3

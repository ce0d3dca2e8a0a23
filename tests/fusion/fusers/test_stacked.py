"""`fusion.fusers.stacked`: the checks every projection-stacking fuser relies on refuse
exactly what a merged call would bypass or change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion.errors import RewriteRefused
from fusion.fusers.stacked import check_plain_linear, check_stackable, unique_targets
from tests.fusion.fusers import hazards


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

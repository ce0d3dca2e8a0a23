"""`fusion.fusers.base`: the checks every fuser relies on refuse exactly what they must."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion.errors import RewriteRefused
from fusion.fusers.base import (
    check_plain_linear,
    check_stackable,
    has_hooks,
    per_signature,
    unique_targets,
)
from tests.fusion.fusers import hazards


class LoggingLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) + 0.0


def test_per_signature_derives_once_and_caches_refusals() -> None:
    cache: dict = {}
    calls = []
    found = object()  # a fuser's match (refusals are cached as their reason strings)

    def derive():
        calls.append(1)
        return found

    assert per_signature(cache, "a", derive, "absent") is found
    assert per_signature(cache, "a", derive, "absent") is found
    assert len(calls) == 1

    def refuse():
        raise RewriteRefused("no")

    for _ in range(2):
        with pytest.raises(RewriteRefused, match="differs from its class's match: no"):
            per_signature(cache, "b", refuse, "absent")
    with pytest.raises(RewriteRefused, match="not there"):
        per_signature(cache, "c", lambda: None, "not there")


def test_has_hooks_names_each_kind() -> None:
    linear = nn.Linear(2, 2)
    assert has_hooks(linear) is None
    handle = linear.register_forward_pre_hook(lambda *a: None)
    assert has_hooks(linear) == "forward pre hooks"
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert has_hooks(linear) == "global forward hooks"
    finally:
        handle.remove()


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

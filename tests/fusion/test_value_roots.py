"""`fusion.value_roots`: which names an expression's value may hold. Every form not known
to make new storage must keep its roots (a miss would let a written view go unseen)."""

from __future__ import annotations

import ast
from typing import Any

import pytest
import torch
from torch import nn

from fusion.value_roots import OPAQUE, PURE, Scope, Summary, roots


def _scope(
    body: str, module: nn.Module | None = None, summary: Summary = OPAQUE, **namespace: Any
) -> Scope:
    funcdef = ast.parse(f"def forward(self, q, k, x):\n    {body}\n").body[0]
    assert isinstance(funcdef, ast.FunctionDef)
    return Scope(funcdef, module, {"torch": torch, **namespace}, 0, {}, lambda *_: summary)


def _roots_of(expr: str, scope: Scope) -> set[str]:
    return roots(ast.parse(expr, mode="eval").body, scope)


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("q", {"q"}),
        ("q.view(2, -1)", {"q"}),
        ("q.transpose(1, 2).contiguous()", {"q"}),  # contiguous() may hand back q itself
        ("q[0]", {"q"}),
        ("(q, k)", {"q", "k"}),
        ("q if x is None else k", {"q", "k"}),
        ("q.shape", set()),
        ("q.size(0)", set()),
        ("torch.cat([q, k])", set()),  # new storage
        ("q + k", {"q", "k"}),  # `+` may concatenate containers that hold q and k
        ("torch.Tensor.view(q, -1)", {"q"}),
        ("q.T", {"q"}),
    ],
)
def test_roots_of_common_forms(expr: str, expected: set[str]) -> None:
    assert _roots_of(expr, _scope("pass")) == expected


def test_an_unreadable_callee_may_return_any_argument() -> None:
    scope = _scope("pass", helper=None)
    assert {"q", "k"} <= _roots_of("helper(q, k)", scope)


def test_a_read_callee_returns_only_what_its_summary_says() -> None:
    def helper(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a

    returns_a = Summary(returns=frozenset({"a"}))
    scope = _scope("pass", summary=returns_a, helper=helper)
    assert _roots_of("helper(q, k)", scope) == {"q"}
    scope = _scope("pass", summary=PURE, helper=helper)
    assert _roots_of("helper(q, k)", scope) == set()


def test_a_shadowed_namespace_is_not_trusted() -> None:
    scope = _scope("torch = k")  # `torch` rebound locally: torch.cat is not torch.cat
    assert _roots_of("torch.cat([q])", scope) != set()


def test_a_plain_linear_child_returns_new_storage_but_a_hooked_one_does_not() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 2)

    module = Holder()
    assert _roots_of("self.proj(q)", _scope("pass", module)) == set()
    handle = module.proj.register_forward_hook(lambda mod, args, out: args[0])
    try:
        assert "q" in _roots_of("self.proj(q)", _scope("pass", module))
    finally:
        handle.remove()

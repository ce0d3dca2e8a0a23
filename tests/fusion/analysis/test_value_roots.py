"""`fusion.analysis.value_roots`: which names an expression's value may hold. Every form not known
to make new storage must keep its roots (a miss would let a written view go unseen)."""

from __future__ import annotations

import ast
import functools
from typing import Any

import pytest
import torch
from torch import nn

from fusion.analysis.value_roots import (
    OPAQUE,
    PURE,
    Scope,
    Summary,
    is_tensor_method,
    resolve_callee,
    roots,
)


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


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("q.numpy()", {"q"}),  # a numpy view of q's memory
        ("q.detach().numpy()[0]", {"q"}),
        ("q.untyped_storage()", {"q"}),
        ("torch.from_numpy(k)", {"k"}),
        ("torch.asarray(q)", {"q"}),
        ("torch.from_dlpack(q)", {"q"}),
    ],
)
def test_memory_seen_as_something_else_keeps_its_roots(expr: str, expected: set[str]) -> None:
    assert _roots_of(expr, _scope("pass")) == expected


def _writes_first(fn):
    @functools.wraps(fn)
    def wrapper(a, *args):
        a.mul_(2.0)
        return fn(a, *args)

    return wrapper


def test_a_decorated_callee_is_not_read_through_its_wrapper() -> None:
    """`inspect.unwrap` shows the wrapped function; Python runs the wrapper, which may write
    or return anything: the callee is unknown."""

    @_writes_first
    def helper(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    scope = _scope("pass", summary=PURE, helper=helper)
    assert resolve_callee(ast.parse("helper(q, k)", mode="eval").body, scope) is None
    assert {"q", "k"} <= _roots_of("helper(q, k)", scope)


class MethodBesideLinear(nn.Module):
    """`self.proj` is the class method (Python's lookup), not the linear in `_modules`."""

    def __init__(self) -> None:
        super().__init__()
        self._modules["proj"] = nn.Linear(2, 2)

    def proj(self, t):
        return t


def test_a_method_beside_a_child_of_the_same_name_is_unknown() -> None:
    scope = _scope("pass", MethodBesideLinear(), summary=PURE)
    assert resolve_callee(ast.parse("self.proj(q)", mode="eval").body, scope) is None
    assert "q" in _roots_of("self.proj(q)", scope)  # not a linear's new tensor


def test_a_rebound_self_is_not_the_module() -> None:
    module = nn.Module()
    module.proj = nn.Linear(2, 2)
    assert _roots_of("self.proj(q)", _scope("pass", module)) == set()
    rebound = _scope("self = k", module)
    assert rebound.module is None
    assert "q" in _roots_of("self.proj(q)", rebound)


def test_a_numpy_view_has_no_tensor_methods() -> None:
    scope = _scope("a = q.numpy()")
    assert "a" in scope.foreign
    assert not is_tensor_method(ast.parse("a.put", mode="eval").body, scope)
    assert is_tensor_method(ast.parse("q.put", mode="eval").body, scope)

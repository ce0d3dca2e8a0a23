"""`fusion.analysis.piece_paths`: a split piece that may meet a layout-sensitive use (`.view` across
the split dimension, `as_strided`, a registered kernel, a callee that cannot be read) on a
path the trace did not replay must be a copy of its own; one whose every such use the
replay saw, or that meets none, stays a view.

Each forward below names its pieces as parameters (`q`, `k`): the analysis asks which names
may hold them, as it asks of the split temporaries in a rewritten forward."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

import pytest
import torch

from fusion.analysis import piece_paths
from fusion.analysis.piece_paths import straight_statements, unreplayed_layout_pieces


def flatten_tokens(t):
    if len(t.shape) == 2:
        return t.view(-1).view(t.shape)
    return t


def split_heads(t):
    return t.view(*t.shape[:-1], 2, -1)


def scale(t):
    return t * 0.5


def straight_view(self, q, k):
    q = q.view(*q.shape[:-1], 2, -1)
    return q, k


def view_under_flag(self, q, k):
    if self.flatten:
        q = q.view(-1).view(q.shape)
    return q, k


def view_under_input_test(self, q, k, mask=None):
    if mask is None:
        q = q.view(-1).view(q.shape)
    return q, k


def view_in_ternary(self, q, k):
    q = q.view(-1).view(q.shape) if self.flatten else q
    return q, k


def view_in_loop(self, q, k):
    for _ in range(self.times):
        q = q.view(-1).view(q.shape)
    return q, k


def view_in_with(self, q, k):
    with torch.no_grad():
        q = q.view(-1).view(q.shape)
    return q, k


def view_after_early_return(self, q, k):
    if self.early:
        return q, k
    q = q.view(-1).view(q.shape)
    return q, k


def shape_bound_on_a_branch(self, q, k):
    shape = (-1,) if self.flatten else q.shape
    q = q.view(shape).view(q.shape)
    return q, k


def holder_bound_on_a_branch(self, q, k):
    t = k
    if self.swap:
        t = q
    t = t.view(-1)
    return q, k, t


def arithmetic_under_flag(self, q, k):
    if self.flatten:
        q = q * 2.0
        k = torch.softmax(k, -1)
    return q, k


def kernel_under_flag(self, q, k):
    if self.flatten:
        q = torch.ops.mylib.kernel(q)
    return q, k


def as_strided_under_flag(self, q, k):
    if self.flatten:
        q = torch.as_strided(q, (2,), (1,))
    return q, k


def unknown_callee_under_flag(self, q, k):
    reshape = self.reshape_fn
    if self.flatten:
        q = reshape(q)
    return q, k


def helper_branch_called_straight(self, q, k):
    q = flatten_tokens(q)
    return q, k


def helper_view_called_straight(self, q, k):
    q = split_heads(q)
    return q, k


def helper_view_called_under_flag(self, q, k):
    if self.flatten:
        q = split_heads(q)
    return q, k


def pure_helper_called_under_flag(self, q, k):
    if self.flatten:
        q = scale(q)
    return q, k


def _verdict(fn: Callable) -> tuple[bool, ...]:
    funcdef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(funcdef, ast.FunctionDef)
    return unreplayed_layout_pieces(funcdef, ("q", "k"), None, fn.__globals__)


@pytest.mark.parametrize(
    "fn",
    [
        view_under_flag,
        view_under_input_test,
        view_in_ternary,
        view_in_loop,
        view_in_with,
        view_after_early_return,
        shape_bound_on_a_branch,
        kernel_under_flag,
        as_strided_under_flag,
        unknown_callee_under_flag,
        helper_branch_called_straight,
        helper_view_called_under_flag,
    ],
)
def test_a_layout_sensitive_use_the_trace_may_not_have_replayed_needs_a_copy(fn) -> None:
    assert _verdict(fn) == (True, False)


def test_a_holder_bound_on_a_branch_is_not_replayed_at_a_straight_use() -> None:
    assert _verdict(holder_bound_on_a_branch) == (True, True)


@pytest.mark.parametrize(
    "fn",
    [
        straight_view,
        arithmetic_under_flag,
        helper_view_called_straight,
        pure_helper_called_under_flag,
    ],
)
def test_uses_the_replay_saw_or_that_take_any_strides_keep_the_view(fn) -> None:
    assert _verdict(fn) == (False, False)


def test_straight_statements_stop_at_a_possible_return() -> None:
    funcdef = ast.parse(textwrap.dedent(inspect.getsource(view_after_early_return))).body[0]
    assert isinstance(funcdef, ast.FunctionDef)
    straight = straight_statements(funcdef)
    assert [id(stmt) in straight for stmt in funcdef.body] == [False, False, False]
    funcdef = ast.parse(textwrap.dedent(inspect.getsource(view_in_ternary))).body[0]
    assert isinstance(funcdef, ast.FunctionDef)
    straight = straight_statements(funcdef)
    assert [id(stmt) in straight for stmt in funcdef.body] == [False, True]


def test_source_it_cannot_take_apart_makes_every_piece_a_copy(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise RecursionError

    monkeypatch.setattr(piece_paths, "_sensitive_names", fail)
    assert _verdict(straight_view) == (True, True)

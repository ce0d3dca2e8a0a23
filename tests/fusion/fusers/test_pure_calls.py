"""Calls between sibling projections whose callees provably write nothing
(fusion.fusers.pure_calls): read from source, shown to the alias analysis as pure calls, and
every way a callee could still write refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusion
from fusion.fusers import pure_calls
from tests.fusion.fusers.hazards import eager_attention_forward
from tests.fusion.fusers.helpers import fuse_copy, outputs_match, reasons

STASH: list[torch.Tensor] = []
F = copy  # not torch.nn.functional: `F.relu` here proves nothing


def foreign(x):
    return F.relu(x)


def rotate(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def stack_halves(x):
    return torch.stack((x, x), dim=0).sum(0) / 2


def scale_in_place(x):
    x.mul_(1.0)
    return x


def stash(x):
    STASH.append(x)
    return x


class Norm(nn.Module):
    """An RMSNorm of the model's own class: reads its input, writes nothing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1)
        self.eps = 1e-6

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._scale(x).to(dtype)

    def _scale(self, x):
        return self.weight.float() * stack_halves(x)


class InplaceNorm(Norm):
    def forward(self, x):
        return x.mul_(self.weight)


class StoringNorm(Norm):
    def forward(self, x):
        self.last = x
        return x * self.weight


class AugmentingNorm(Norm):
    def forward(self, x):
        y = x
        y *= self.weight
        return y


class HelperWritingNorm(Norm):
    def forward(self, x):
        return scale_in_place(x) * self.weight


class StashingNorm(Norm):
    def forward(self, x):
        return stash(x) * self.weight


class IdentityNorm(Norm):
    """Writes nothing, but returns its input itself: a write to the result is one to it."""

    def forward(self, x):
        return x


class ForeignManagerNorm(Norm):
    def forward(self, x):
        with open(__file__):
            return x * self.weight


class DistributedNorm(Norm):
    def forward(self, x):
        torch.distributed.all_reduce(x)
        return x


class NestedNorm(Norm):
    def __init__(self, width: int, inner: nn.Module) -> None:
        super().__init__(width)
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * self.weight


class NormedAttention(nn.Module):
    """q/k/v with a norm of its own class between the calls, and a method that receives the
    input (so, read flow-insensitively, `self` may hold it) before them."""

    def __init__(self, norm: type[nn.Module] = Norm) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 16, bias=False)
        self.v_proj = nn.Linear(32, 16, bias=False)
        self.o_proj = nn.Linear(16, 32, bias=False)
        self.q_norm = norm(32)

    def describe(self, hidden_states):
        return hidden_states.shape[-1] + 0

    def forward(self, hidden_states):
        width = self.describe(hidden_states=hidden_states)
        q = self.q_norm(self.q_proj(hidden_states)) * (width / width)
        q = rotate(q)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class NormOfInput(NormedAttention):
    """The norm reads the input itself between the calls and its result is written."""

    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        normed = self.q_norm(hidden_states)
        normed.add_(1.0)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q + normed, k, v)
        return self.o_proj(out)


class NormedInputWritten(NormedAttention):
    def forward(self, hidden_states):
        q = self.q_proj(hidden_states)
        self.q_norm(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


def test_a_norm_and_a_method_that_write_nothing_do_not_block_the_merge() -> None:
    module = NormedAttention()
    fused, report = fuse_copy(module)
    assert report.counts() == {"qkv": 1}, str(report)
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize(
    "norm",
    [
        InplaceNorm,
        StoringNorm,
        AugmentingNorm,
        HelperWritingNorm,
        StashingNorm,
        ForeignManagerNorm,
        DistributedNorm,
    ],
)
def test_a_child_that_may_write_is_presumed_to(norm: type[nn.Module]) -> None:
    assert not pure_calls.module_writes_nothing(norm(32))
    module = NormedInputWritten(norm)
    report = fusion.plan(module)
    assert not report.applied, str(report)
    assert "may change between the projection calls" in reasons(report)


@pytest.mark.parametrize("norm", [Norm, IdentityNorm])
def test_what_a_proven_call_returns_still_aliases_its_arguments(norm: type[nn.Module]) -> None:
    assert pure_calls.module_writes_nothing(norm(32))
    module = NormOfInput(norm)
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert "may change between the projection calls" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_hooks_and_call_paths_make_a_child_unreadable() -> None:
    hooked = Norm(32)
    hooked.register_forward_pre_hook(lambda *args: None)
    own_forward = Norm(32)
    own_forward.forward = lambda x: x  # type: ignore[method-assign]

    class Called(Norm):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    for child in (hooked, own_forward, Called(32)):
        assert not pure_calls.module_writes_nothing(child)


def test_grandchildren_are_read_and_depth_is_bounded() -> None:
    assert pure_calls.module_writes_nothing(NestedNorm(32, Norm(32)))
    assert not pure_calls.module_writes_nothing(NestedNorm(32, InplaceNorm(32)))
    deep: nn.Module = Norm(32)
    for _ in range(pure_calls.MAX_DEPTH + 1):
        deep = NestedNorm(32, deep)
    assert not pure_calls.module_writes_nothing(deep)


def test_a_shadowed_namespace_proves_nothing() -> None:
    def shadowed(x):
        torch = STASH  # a local `torch` is not the torch module
        torch.append(x)  # ...and `append` is no tensor method
        return x

    assert pure_calls.function_writes_nothing(rotate, None)
    assert not pure_calls.function_writes_nothing(shadowed, None)
    assert not pure_calls.function_writes_nothing(foreign, None)
    assert foreign.__code__.co_freevars == ()  # refused for its `F`, not as a closure


def test_every_instance_is_proven_again() -> None:
    safe = NormedAttention(lambda w: NestedNorm(w, Norm(w)))
    unsafe = NormedAttention(lambda w: NestedNorm(w, InplaceNorm(w)))
    model = nn.ModuleList([safe, unsafe])
    reference = copy.deepcopy(model)
    report = fusion.fuse(model)
    # One class, one child type: the cached match was proven on the first instance only;
    # the second's grandchild writes, and `validate` says so.
    assert [r.qualname for r in report.applied] == ["0"], str(report)
    assert any("may write the projection input" in r.reason for r in report.skipped)
    for original, fused in zip(reference, model):
        assert outputs_match(original, fused, 2, 5, 32)


def _writes_first(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        x.mul_(1.0)
        return fn(x, *args, **kwargs)

    return wrapper


@_writes_first
def wrapped_rotate(x):
    return rotate(x)


def test_a_decorated_callee_is_presumed_to_write() -> None:
    assert pure_calls.function_writes_nothing(rotate, None)
    assert not pure_calls.function_writes_nothing(wrapped_rotate, None)

"""Split pieces of a merged GEMM that are written in place must be fresh tensors (found by
tests/fuzz).

A projection returns a fresh tensor, which a forward may write in place (OLMo clamps q/k/v
with `clamp_`). A piece of `merged.split(...)` is a view of a multi-output op, and autograd
forbids writing those in place ("Output 0 of SplitWithSizes is a view and is being modified
inplace"), so the fused forward crashed where the original ran. Shrunk fuzzer example:

    query_states = self.q_proj(x)         # q/k/v merged by the QKV fuser
    key_states = self.k_proj(x)
    value_states = self.v_proj(x)
    query_states *= 0.5                   # RuntimeError in the fused forward (autograd on)

Such pieces are handed out as copies of their own (layout `fresh` of `MergedLinear.pieces`;
alias analysis is flow-insensitive, so a sibling piece passed to the same call may be copied
too); in a forward that writes no piece, every piece stays a view (no copy). Every write
spelling, in every split: test_piece_write_spellings.py.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fusion
from fusion.fusers import registry
from fusion.runtime.merged import MergedLinear
from tests.fusion.fusers.hazards import eager_attention_forward
from tests.fusion.merged_paths import stacked_products


class Attention(nn.Module):
    def __init__(self, hidden: int = 8, q: int = 8, kv: int = 4, clip: float | None = None):
        super().__init__()
        self.q_proj = nn.Linear(hidden, q, bias=False)
        self.k_proj = nn.Linear(hidden, kv, bias=False)
        self.v_proj = nn.Linear(hidden, kv, bias=False)
        self.o_proj = nn.Linear(kv, hidden, bias=False)
        self.clip = clip

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class AugAssign(Attention):
    """The shrunk fuzzer example (fx traces `q *= s` as `q = q * s`: only the source shows it)."""

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        q *= 0.5
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class InplaceMethod(Attention):
    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        k.mul_(0.5)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ItemAssign(Attention):
    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        v[..., 0] = 0.0
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ThroughView(Attention):
    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        heads = q.view(*q.shape[:-1], 2, -1)
        heads.mul_(0.5)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class AsStridedRead(Attention):
    """`as_strided` reads the storage from the piece's offset with the strides given: on a
    strided piece, other values (the replay saw it, yet called the piece a plain view)."""

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        q = q.as_strided(q.shape, (q.shape[-2] * q.shape[-1], q.shape[-1], 1))
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ClipBranch(Attention):
    """OLMo's spelling: the in-place clamp sits in a branch the trace need not take."""

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if self.clip is not None:
            q.clamp_(min=-self.clip, max=self.clip)
            k.clamp_(min=-self.clip, max=self.clip)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class InplaceActivationMLP(nn.Module):
    """Separate statements, so the sibling fuser merges gate/up; the activation child
    writes the gate piece in place (only the traced replay sees that)."""

    def __init__(self, hidden: int = 8, inter: int = 16) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU(inplace=True)

    def forward(self, x):
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


def _check_same(
    module: nn.Module, shape: tuple[int, ...], after_fuse: Callable[[nn.Module], None] | None = None
) -> str:
    """Fuse a copy (then apply `after_fuse` to both, an edit a user makes after fusing);
    with autograd on (shards computed apart), the forward, the input and the input's
    gradient must agree with the original's; without, the forward must, both where the
    policy computes each shard apart (the reference) and where it takes the stacked product,
    split into pieces. Returns the rewritten source."""
    fused = copy.deepcopy(module)
    report = fusion.fuse(fused)
    assert report.applied, report.skipped
    if after_fuse is not None:
        after_fuse(module)
        after_fuse(fused)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    a_in, b_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = module(a_in), fused(b_in)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(a_in.grad, b_in.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(module(x), fused(x), rtol=1e-5, atol=1e-6)
    merged = [m for m in fused.modules() if isinstance(m, MergedLinear)]
    before = sum(m.stacked_calls for m in merged)
    with torch.no_grad(), stacked_products():
        torch.testing.assert_close(module(x), fused(x), rtol=1e-5, atol=1e-6)
    assert sum(m.stacked_calls for m in merged) > before  # the split path really ran
    return report.applied[0].rewritten_source or ""


def _layouts(rewritten: str) -> list[str]:
    """The layouts the rewritten forward asks its merged projection for
    (`MergedLinear.pieces`)."""
    found = re.search(r"self\.\w+\([^,()]+, (\((?:'\w+', ?)+'?\w*'?\))\)", rewritten)
    assert found, rewritten
    return list(ast.literal_eval(found[1]))


@pytest.mark.parametrize("cls", [AugAssign, InplaceMethod, ItemAssign, ThroughView, AsStridedRead])
@pytest.mark.parametrize("shape", [(2, 3, 8), (1, 1, 8)], ids=["prefill", "decode"])
def test_written_piece_is_cloned(cls: type[nn.Module], shape: tuple[int, ...]) -> None:
    registry.clear_cache()
    rewritten = _check_same(cls(), shape)
    assert "fresh" in _layouts(rewritten), rewritten


def test_branch_the_trace_did_not_take() -> None:
    """The class is matched on an instance without clipping; another instance clips."""
    registry.clear_cache()
    unclipped = ClipBranch()
    assert fusion.fuse(copy.deepcopy(unclipped)).applied
    rewritten = _check_same(ClipBranch(clip=0.1), (2, 3, 8))
    assert "fresh" in _layouts(rewritten), rewritten


def test_inplace_child_activation_on_piece() -> None:
    registry.clear_cache()
    rewritten = _check_same(InplaceActivationMLP(), (2, 3, 8))
    assert _layouts(rewritten)[0] == "fresh", rewritten


def test_unwritten_pieces_stay_views() -> None:
    registry.clear_cache()
    rewritten = _check_same(Attention(), (2, 3, 8))
    assert "fresh" not in _layouts(rewritten), rewritten


class Scaler(nn.Module):
    def scale(self, t):
        return t.mul_(0.5)


class ReboundSelfScale(Attention):
    """`rescale` rebinds `self`: its `self.scale` is the Scaler's (which writes the piece in
    place), not this module's own (which does not). On a branch the trace does not take, so
    only the source analysis can see it (issue 24)."""

    def __init__(self, clip: float | None = None) -> None:
        super().__init__(clip=clip)
        self.other = Scaler()

    def scale(self, t):
        return t * 0.5

    def rescale(self, t):
        self = self.other
        return self.scale(t)

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if self.clip is not None:
            q = self.rescale(q)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class MethodBesideChildScale(ReboundSelfScale):
    """`self.scale` is the class method (it writes the piece), not the pure child that
    `_modules` holds under the same name: ambiguous, so presumed to write."""

    def __init__(self, clip: float | None = None) -> None:
        super().__init__(clip=clip)
        self._modules["scale"] = nn.Identity()

    def scale(self, t):
        return t.mul_(0.5)

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if self.clip is not None:
            q = self.scale(q)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


@pytest.mark.parametrize("cls", [ReboundSelfScale, MethodBesideChildScale])
def test_a_piece_written_through_another_object_than_self(cls: type[Attention]) -> None:
    registry.clear_cache()
    assert fusion.fuse(copy.deepcopy(cls())).applied  # matched where the branch is not taken
    rewritten = _check_same(cls(clip=1.0), (2, 3, 8))
    assert "fresh" in _layouts(rewritten), rewritten


def flatten_tokens(t):
    """A helper whose own branch the trace decides, on its own input."""
    if len(t.shape) == 2:
        return t.view(-1).view(t.shape)
    return t


class FlattenBranch(Attention):
    """`q.view(-1)` merges the split dimension: right on the projection's contiguous output,
    an error on a strided piece. It sits under a flag the trace read as False (issue 43)."""

    def __init__(self, flatten: bool = False) -> None:
        super().__init__()
        self.flatten = flatten

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if self.flatten:
            q = q.view(-1).view(q.shape)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class FlattenInMethod(FlattenBranch):
    """The flag is read by a method the forward calls on every path."""

    def maybe_flatten(self, t):
        if self.flatten:
            return t.view(-1).view(t.shape)
        return t

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        q = self.maybe_flatten(q)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class FlattenShapeFromBranch(FlattenBranch):
    """The view runs on every path; its shape is what the branch decides."""

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        shape = (-1,) if self.flatten else q.shape
        q = q.view(shape).view(q.shape)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class FlattenWithoutMask(Attention):
    """The trace passes a proxy for `mask`, so it takes the other side of `mask is None`."""

    def forward(self, x, mask=None):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if mask is None:
            q = q.view(-1).view(q.shape)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class FlattenTokensOnly(Attention):
    """The trace's input has three dimensions; a serving engine's has two."""

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if len(x.shape) == 2:
            q = q.view(-1).view(q.shape)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class FlattenTokensInHelper(Attention):
    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        q = flatten_tokens(q)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


class ScaleBranch(FlattenBranch):
    """A flag around uses any strides serve: the pieces stay views."""

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if self.flatten:
            q = torch.softmax(q * 2.0, -1)
        out, _ = eager_attention_forward(self, q, k, v)
        return self.o_proj(out)


def _flatten(module: nn.Module) -> None:
    module.flatten = True


@pytest.mark.parametrize("cls", [FlattenBranch, FlattenInMethod, FlattenShapeFromBranch])
@pytest.mark.parametrize("shape", [(2, 3, 8), (1, 1, 8)], ids=["prefill", "decode"])
def test_a_layout_sensitive_branch_flipped_after_fusing(cls: type[nn.Module], shape) -> None:
    registry.clear_cache()
    rewritten = _check_same(cls(), shape, after_fuse=_flatten)
    assert _layouts(rewritten) == ["fresh", "view", "view"], rewritten


def test_a_layout_sensitive_branch_another_instance_takes() -> None:
    registry.clear_cache()
    assert fusion.fuse(copy.deepcopy(FlattenBranch())).applied  # matched with the flag off
    rewritten = _check_same(FlattenBranch(flatten=True), (2, 3, 8))
    assert _layouts(rewritten) == ["fresh", "view", "view"], rewritten


@pytest.mark.parametrize(
    ("cls", "shape"),
    [
        (FlattenWithoutMask, (2, 3, 8)),
        (FlattenTokensOnly, (5, 8)),
        (FlattenTokensInHelper, (5, 8)),
    ],
)
def test_a_layout_sensitive_branch_taken_by_input(cls: type[nn.Module], shape) -> None:
    registry.clear_cache()
    rewritten = _check_same(cls(), shape)
    assert _layouts(rewritten) == ["fresh", "view", "view"], rewritten


def test_a_branch_any_strides_serve_keeps_the_views() -> None:
    registry.clear_cache()
    rewritten = _check_same(ScaleBranch(), (2, 3, 8), after_fuse=_flatten)
    assert "fresh" not in _layouts(rewritten), rewritten

"""RMSNorm forwards that write a tensor in place must not be fused (found by tests/fuzz).

Shrunk fuzzer example: a Llama norm whose normalising step is `hidden_states *= ...`. With a
float32 input, `hidden_states.to(torch.float32)` is the input itself, so the original writes
the caller's tensor (in a decoder layer: the residual), while `FusedRMSNorm` is pure; fx
records `h *= s` as `h = h * s`, so the traced dataflow looked like a plain RMSNorm.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion


def bump(t: torch.Tensor) -> torch.Tensor:
    t.mul_(0.5)
    return t


class LlamaNorm(nn.Module):
    def __init__(self, hidden: int = 8, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden) * 0.1 + 1.0)
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class AugAssignNorm(LlamaNorm):
    """The shrunk fuzzer example."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states *= torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class InplaceKeywordNorm(LlamaNorm):
    def forward(self, hidden_states):
        F.relu(hidden_states, inplace=True)
        return super().forward(hidden_states)


class HelperWriteNorm(LlamaNorm):
    def forward(self, hidden_states):
        bump(hidden_states)
        input_dtype = hidden_states.dtype
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class ItemWriteNorm(LlamaNorm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states[...] = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HelperMethodNorm(nn.Module):
    """Gemma's spelling: a pure helper method on self. Must still fuse."""

    def __init__(self, hidden: int = 8, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden) * 0.1)
        self.eps = eps

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Block(nn.Module):
    """A parent, as in a model: a replaced norm is installed in its parent's slot."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x):
        residual = x
        return self.norm(x) + residual


@pytest.mark.parametrize(
    "norm_cls", [AugAssignNorm, InplaceKeywordNorm, HelperWriteNorm, ItemWriteNorm]
)
def test_writing_norm_is_refused_and_unchanged(norm_cls: type[nn.Module]) -> None:
    block = Block(norm_cls())
    fused = copy.deepcopy(block)
    report = fusion.fuse(fused)
    assert not report.applied, report.applied
    assert any(r.fuser == "rmsnorm" for r in report.skipped), report.skipped
    assert type(fused.norm) is norm_cls
    x = torch.randn(2, 3, 8)
    a_in, b_in = x.clone(), x.clone()
    assert torch.equal(block(a_in), fused(b_in))
    assert torch.equal(a_in, b_in)


@pytest.mark.parametrize("norm_cls", [LlamaNorm, HelperMethodNorm])
def test_write_free_norms_still_fuse(norm_cls: type[nn.Module]) -> None:
    block = Block(norm_cls())
    fused = copy.deepcopy(block)
    report = fusion.fuse(fused)
    assert [r.fuser for r in report.applied] == ["rmsnorm"], report.skipped
    x = torch.randn(2, 3, 8)
    a_in, b_in = x.clone(), x.clone()
    torch.testing.assert_close(block(a_in), fused(b_in), rtol=1e-5, atol=1e-6)
    assert torch.equal(a_in, b_in)

"""An nn.Linear subclass with its own call path is never merged (found by tests/fuzz).

Shrunk fuzzer example: a gated MLP whose `up_proj` is

    class FlagCallLinear(nn.Linear):
        scale = 1.0
        def __call__(self, input):
            output = super().__call__(input)
            return output * self.scale if self.scale != 1.0 else output

in a model holding two instances, the second with `up_proj.scale = 0.5`. The class is traced
once, on the first instance, where the call looks like a plain linear; the second instance
was merged too and silently lost its scaling. A call path of its own (`__call__`,
`_wrapped_call_impl`, `_call_impl`) now refuses, like a forward of its own.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import fusion

from .hazards import MLP, Attention


class FlagCallLinear(nn.Linear):
    scale = 1.0

    def __call__(self, input):
        output = super().__call__(input)
        return output * self.scale if self.scale != 1.0 else output


class CallImplLinear(nn.Linear):
    def _call_impl(self, *args, **kwargs):
        return super()._call_impl(*args, **kwargs)


class FlagMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = FlagCallLinear(32, 48, bias=False)


class FlagAttention(Attention):
    def __init__(self) -> None:
        super().__init__()
        self.k_proj = FlagCallLinear(32, 16, bias=False)


@pytest.mark.parametrize("cls", [FlagMLP, FlagAttention])
def test_per_instance_call_path_is_refused(cls: type[nn.Module]) -> None:
    model = nn.Sequential(cls(), cls())
    shard = "up_proj" if cls is FlagMLP else "k_proj"
    getattr(model[1], shard).scale = 0.5
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert not report.applied, report.applied
    assert any("own __call__" in r.reason for r in report.skipped), report.skipped
    x = torch.randn(2, 3, 32)
    for original, candidate in zip(model, fused):
        assert torch.equal(original(x), candidate(x))


def test_overridden_call_impl_and_instance_call_impl_are_refused() -> None:
    mlp = MLP()
    mlp.up_proj = CallImplLinear(32, 48, bias=False)
    report = fusion.plan(nn.Sequential(mlp))
    assert not report.applied and any("own _call_impl" in r.reason for r in report.skipped)
    mlp = MLP()
    mlp.up_proj._call_impl = types.MethodType(nn.Module._call_impl, mlp.up_proj)
    report = fusion.plan(nn.Sequential(mlp))
    assert not report.applied and any("own _call_impl" in r.reason for r in report.skipped)


def test_plain_subclass_still_fuses() -> None:
    class SubLinear(nn.Linear):
        pass

    mlp = MLP()
    mlp.up_proj = SubLinear(32, 48, bias=False)
    assert [r.fuser for r in fusion.plan(nn.Sequential(mlp)).applied] == ["glu"]

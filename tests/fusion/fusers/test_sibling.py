"""Sibling merge: the fallback for plainly assigned projections."""

from __future__ import annotations

from torch import nn

from tests.fusion.fusers import hazards
from tests.fusion.fusers.helpers import fuse_copy, outputs_match, reasons


class FourWay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 4, bias=False)
        self.c = nn.Linear(16, 8)
        self.out = nn.Linear(20, 16)

    def forward(self, x):
        a = self.a(x)
        b = self.b(x)
        c = self.c(x)
        return self.out(_cat(a, b, c))


def _cat(a, b, c):
    import torch

    return torch.cat([a, b, c], dim=-1)


class Interleaved(FourWay):
    def forward(self, x):
        a = self.a(x)
        a = a * 2
        b = self.b(x)
        c = self.c(x)
        return self.out(_cat(a, b, c))


def test_plain_assignments_merged() -> None:
    module = FourWay()
    fused, report = fuse_copy(module)
    assert report.counts() == {"sibling": 1}, str(report)
    assert fused.a_b_c_merged.output_sizes == [8, 4, 8]
    assert outputs_match(module, fused, 3, 16)


def test_other_statement_between_refused() -> None:
    module = Interleaved()
    fused, report = fuse_copy(module)
    assert not report.applied
    assert "not plain assignments" in reasons(report)
    assert outputs_match(module, fused, 3, 16)


def test_qkv_preferred_over_sibling() -> None:
    _, report = fuse_copy(hazards.Attention())
    assert report.counts() == {"qkv": 1}

"""Shared checks for the fuser tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fusion
from fusion.report import FusionReport


def fuse_copy(module: nn.Module) -> tuple[nn.Module, FusionReport]:
    fused = copy.deepcopy(module)
    return fused, fusion.fuse(fused)


def outputs_match(original: nn.Module, fused: nn.Module, *shape: int, seed: int = 0) -> bool:
    """Both modules on clones of one random input; True when outputs (and the inputs, which
    a forward may mutate) agree to float32 rounding."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    a_in, b_in = x.clone(), x.clone()
    with torch.no_grad():
        a, b = original(a_in), fused(b_in)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6) and torch.equal(a_in, b_in)


def reasons(report: FusionReport) -> str:
    return " | ".join(record.reason for record in report.skipped)

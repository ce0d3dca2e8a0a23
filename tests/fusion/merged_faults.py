"""Inject a fault into every merged projection's product (tests of the oracles).

A fault is `fault(merged, x) -> tensor`, the concatenated output it claims. Every path of
`MergedLinear.forward` (the concatenation, `pieces` that splits it, `outputs` that the GLU
rewrite takes) goes through `outputs`, so all of them then compute the fault."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fusion.modules import MergedLinear

Fault = Callable[[MergedLinear, torch.Tensor], torch.Tensor]


def inject(monkeypatch: pytest.MonkeyPatch, fault: Fault) -> None:
    """Make every `MergedLinear` compute `fault` (undone with `monkeypatch`)."""
    monkeypatch.setattr(MergedLinear, "outputs", lambda self, x: (fault(self, x),))

"""The reference kernel's expressions, per variant: `torch_ref.rms_norm` traced and read like a
norm, for each candidate set of its flags, so a module's expression can be compared with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion.fusers.rmsnorm.tracing import NormTrace, evaluate, trace_at
from fusion.kernels import torch_ref

GRID = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes every accepted variant must reproduce exactly, for the input and the weight."""


EXTRA = (torch.float64,)
"""Dtypes also checked; a variant equal there too is allowed to run there."""


MARKER = 0.000123456789
"""A value no real eps has, planted in one attribute at a time to find which carries eps."""


@dataclass(frozen=True)
class Variant:
    """The flags of `torch_ref.rms_norm` (see there) for one matched norm."""

    has_weight: bool
    offset: float = 0.0
    upcast: bool = True
    weight_after_cast: bool = True
    cast_to_weight: bool = False

    def describe(self) -> str:
        if not self.has_weight:
            order = "weightless"
        elif self.weight_after_cast:
            order = "weight after cast to " + (
                "weight dtype" if self.cast_to_weight else "input dtype"
            )
        else:
            order = "weight before cast"
        offset = f", scale {self.offset:g} + weight" if self.offset else ""
        stats = "float32 statistics" if self.upcast else "statistics in input dtype"
        return f"{stats}, {order}{offset}"


def candidate_variants(has_weight: bool, offsets: set[float]) -> list[Variant]:
    """Candidate variants, simplest first."""
    result = []
    for upcast in (True, False):
        if not has_weight:
            result.append(Variant(False, 0.0, upcast))
            continue
        for offset in sorted(offsets, key=lambda v: (v != 0.0, v)):
            result.append(Variant(True, offset, upcast, True, False))
            result.append(Variant(True, offset, upcast, False, False))
            result.append(Variant(True, offset, upcast, True, True))
    return result


class _KernelProbe(nn.Module):
    """`torch_ref.rms_norm` in one variant as a module, so it traces like a norm."""

    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.variant = variant
        if variant.has_weight:
            self.weight = nn.Parameter(torch.empty(8, device="meta"), requires_grad=False)
        else:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.variant
        return torch_ref.rms_norm(
            x,
            self.weight,
            MARKER,
            offset=v.offset,
            upcast=v.upcast,
            weight_after_cast=v.weight_after_cast,
            cast_to_weight=v.cast_to_weight,
        )


_KERNEL_TRACES: dict[Variant, NormTrace] = {}
"""Explicit cache: variant -> the kernel's trace (dtype-generic, so traced once)."""


def kernel_expr(variant: Variant, dtype: torch.dtype, wdtype: torch.dtype | None) -> Any:
    probe = _KernelProbe(variant)
    if variant not in _KERNEL_TRACES:
        trace = trace_at(probe, torch.float32, None, {}, None, 8)
        if trace.guarded:  # the kernel must be dtype-generic for a single trace to stand
            raise AssertionError("torch_ref.rms_norm branches on a dtype")
        _KERNEL_TRACES[variant] = trace
    weight_name = "weight" if variant.has_weight else None
    return evaluate(_KERNEL_TRACES[variant], probe, dtype, wdtype, weight_name)[0]

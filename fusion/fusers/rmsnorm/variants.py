"""The reference kernel's expressions, per variant: `reference.rms_norm` traced and read like a
norm, for each candidate `NormVariant`, so a module's expression can be compared with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion.fusers.rmsnorm.tracing import NormTrace, evaluate, trace_at
from fusion.kernels import reference
from fusion.kernels.norm_variant import DEFAULT_VARIANT, RSQRT, NormVariant

GRID = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes every accepted variant must reproduce exactly, for the input and the weight."""


EXTRA = (torch.float64,)
"""Dtypes also checked; a variant equal there too is allowed to run there."""


MARKER = 0.000123456789
"""A value no real eps has, planted in one attribute at a time to find which carries eps."""


@dataclass(frozen=True)
class Variant:
    """One matched norm: whether it has a weight, and `kernel`, the `NormVariant` it
    computes (handed unchanged to `FusedRMSNorm` and so to every norm kernel; a weightless
    norm keeps the default weight-order fields, which the kernels ignore without a weight).
    Frozen and hashable: the key of `_KERNEL_TRACES`."""

    has_weight: bool
    kernel: NormVariant = DEFAULT_VARIANT

    def describe(self) -> str:
        """One line for the fusion report (`NormVariant.describe`)."""
        return self.kernel.describe(self.has_weight)


def candidate_variants(
    has_weight: bool, offsets: set[float], roots: tuple[str, ...] = (RSQRT,)
) -> list[Variant]:
    """Candidate variants, simplest first: for each root spelling (`roots`, in order),
    statistics dtype (float32 first) and offset (none first), Llama's weight-after-cast
    order, Gemma's weight-before-cast, then T5's cast to the weight's dtype."""
    result = []
    for root in roots:
        for upcast in (True, False):
            if not has_weight:
                result.append(Variant(False, NormVariant(upcast=upcast, root=root)))
                continue
            for offset in sorted(offsets, key=lambda v: (v != 0.0, v)):
                for after, to_weight in ((True, False), (False, False), (True, True)):
                    kernel = NormVariant(offset, upcast, after, to_weight, root=root)
                    result.append(Variant(True, kernel))
    return result


class _KernelProbe(nn.Module):
    """`reference.rms_norm` in one variant as a module, so it traces like a norm."""

    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.variant = variant
        if variant.has_weight:
            self.weight = nn.Parameter(torch.empty(8, device="meta"), requires_grad=False)
        else:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference.rms_norm(x, self.weight, MARKER, variant=self.variant.kernel)


_KERNEL_TRACES: dict[Variant, NormTrace] = {}
"""Explicit cache: variant -> the kernel's trace (dtype-generic, so traced once)."""


def kernel_expr(variant: Variant, dtype: torch.dtype, wdtype: torch.dtype | None) -> Any:
    probe = _KernelProbe(variant)
    if variant not in _KERNEL_TRACES:
        trace = trace_at(probe, torch.float32, None, {}, None, 8)
        if trace.guarded:  # the kernel must be dtype-generic for a single trace to stand
            raise AssertionError("reference.rms_norm branches on a dtype")
        _KERNEL_TRACES[variant] = trace
    weight_name = "weight" if variant.has_weight else None
    return evaluate(_KERNEL_TRACES[variant], probe, dtype, wdtype, weight_name)[0]

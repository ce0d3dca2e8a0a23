"""Shared by the kernel contract tests: a `__torch_function__` mode that changes every linear,
float32 matmul precision settings, and linear / merged-linear pairs to compare.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fusion.runtime.merged import MergedLinear
from tests.fusion.kernels.native_helpers import (
    decode_linear,
)

SIZES = (64, 16, 16)  # a q/k/v-shaped merge
K = 64


def plus_one_on_linear(cls, func, types, args=(), kwargs=None):
    """`__torch_function__` of the `PlusOne*` subclasses: `F.linear` adds 1.0; every other op
    returns plain tensors (as weight-only quantisation subclasses do)."""
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
    return out + 1.0 if func is F.linear else out


class PlusOneMode(TorchFunctionMode):
    """A `__torch_function__` mode under which `F.linear` adds 1.0."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1.0 if func is F.linear else out


def mkldnn_matmul_bf16() -> None:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


def linear_pair(seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    """An `nn.Linear` and one with the forward the decode_linear fuser installs
    (`LinearForward`) on copies of the same parameters."""
    torch.manual_seed(seed)
    linear = nn.Linear(K, 48)
    row = decode_linear(K, 48)
    row.load_state_dict(linear.state_dict())
    return linear.eval(), row.eval()


def merged_pair(seed: int = 0) -> tuple[Callable[[torch.Tensor], torch.Tensor], MergedLinear]:
    """Unfused q/k/v projections (as one callable: their outputs concatenated) and the
    `MergedLinear` stacked from copies of them."""
    torch.manual_seed(seed)
    linears = {name: nn.Linear(K, n) for name, n in zip("qkv", SIZES)}
    merged = MergedLinear.from_linears(linears).eval()

    def unfused(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([lin(x) for lin in linears.values()], dim=-1)

    return unfused, merged

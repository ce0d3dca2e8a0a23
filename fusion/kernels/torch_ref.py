"""The torch reference backend: plain PyTorch ops, every device, always available.

These functions define what every other backend must compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
"""Activation name -> function, for the activations `ActAndMul` accepts."""


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(x[..., :d]) * x[..., d:]` with `d = x.shape[-1] // 2` (gate first, then up)."""
    d = x.shape[-1] // 2
    return ACTIVATIONS[activation](x[..., :d]) * x[..., d:]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    offset: float,
    upcast: bool,
    weight_after_cast: bool,
) -> torch.Tensor:
    """RMSNorm over the last dimension, in the exact variant given.

    `upcast`: statistics in float32 (else in `x.dtype`). The scale is `offset + weight`
    (`offset` 1.0 for Gemma's zero-centred weights). `weight_after_cast`: the normalised value
    is cast back to `x.dtype` *before* multiplying by the scale (Llama), else the scale is
    applied in the compute dtype and the product cast back (Gemma). These round differently
    in bf16, so both are kept exact.
    """
    dtype = x.dtype
    h = x.float() if upcast else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(dtype)
    if weight_after_cast:
        scale = weight + offset if offset else weight
        return scale * h.to(dtype)
    scale = weight.to(h.dtype) + offset if offset else weight.to(h.dtype)
    return (h * scale).to(dtype)


class TorchKernels:
    """Backend object for the reference kernels."""

    name = "torch"

    def supports(self, device: torch.device) -> bool:
        return True

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        return act_and_mul(x, activation)

    def rms_norm(self, x, weight, eps, *, offset, upcast, weight_after_cast):
        return rms_norm(
            x, weight, eps, offset=offset, upcast=upcast, weight_after_cast=weight_after_cast
        )

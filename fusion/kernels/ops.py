"""The fused kernels as PyTorch operators (`torch.ops.fusion.*`), for `torch.compile`.

Fused modules call their kernels through the functions here. In eager mode these call the
backend directly (`kernels.get(backend, device).<op>`): a registered operator costs ~7 us of
dispatch per call on CPU, a visible share of a decode step. While Dynamo traces, they call
the registered operator instead: Dynamo records one opaque node (its fake implementation
gives the output's shape and dtype), so nothing inside a kernel (backend choice, Python
state such as `torch.backends` settings, the MoE kernel's data-dependent per-expert row
counts) can break the graph. A compiled fused model therefore traces fullgraph wherever its
unfused twin does, and at run time the operator dispatches to the same backend eager mode
would use.

Autograd: the operators have no derivative formula. While autograd records (training), the
functions call the backend's Python implementation, which autograd differentiates (the
reference kernels are plain torch code), compiled or not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fusion import kernels
from fusion.kernels import torch_ref


def _use_operator(*tensors: Tensor | None) -> bool:
    """Trace through the operator: Dynamo is tracing and no input records a gradient."""
    return torch.compiler.is_compiling() and not torch_ref.records_grad(
        *(t for t in tensors if t is not None)
    )


def _rms(
    kernel: Callable[..., Tensor],
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float,
    upcast: bool,
    weight_after_cast: bool,
    cast_to_weight: bool,
) -> Tensor:
    """`kernel` (a `Kernels.rms_norm`) called with the variant flags as keywords."""
    return kernel(
        x,
        weight,
        eps,
        offset=offset,
        upcast=upcast,
        weight_after_cast=weight_after_cast,
        cast_to_weight=cast_to_weight,
    )


@torch.library.custom_op("fusion::rms_norm", mutates_args=())
def _rms_norm_op(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float,
    upcast: bool,
    weight_after_cast: bool,
    cast_to_weight: bool,
    backend: str,
) -> Tensor:
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    return _rms(kernels.get(backend, x.device).rms_norm, x, weight, eps, *flags)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, offset, upcast, weight_after_cast, cast_to_weight, backend):
    # The reference traces on fake tensors: its output dtype is the variant's, by definition.
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    return _rms(torch_ref.rms_norm, x, weight, eps, *flags)


def rms_norm(
    backend: str,
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    upcast: bool = True,
    weight_after_cast: bool = True,
    cast_to_weight: bool = False,
) -> Tensor:
    """`Kernels.rms_norm` on `backend` (see `fusion.kernels.Kernels`)."""
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    if _use_operator(x, weight):
        return torch.ops.fusion.rms_norm(x, weight, eps, *flags, backend)
    return _rms(kernels.get(backend, x.device).rms_norm, x, weight, eps, *flags)


@torch.library.custom_op("fusion::act_and_mul", mutates_args=())
def _act_and_mul_op(x: Tensor, activation: str, backend: str) -> Tensor:
    return kernels.get(backend, x.device).act_and_mul(x, activation)


@_act_and_mul_op.register_fake
def _act_and_mul_fake(x, activation, backend):
    return torch_ref.act_and_mul(x, activation)


def act_and_mul(backend: str, x: Tensor, activation: str) -> Tensor:
    """`Kernels.act_and_mul` on `backend`."""
    if _use_operator(x):
        return torch.ops.fusion.act_and_mul(x, activation, backend)
    return kernels.get(backend, x.device).act_and_mul(x, activation)


@torch.library.custom_op("fusion::moe_experts", mutates_args=())
def _moe_experts_op(
    hidden: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    activation: str,
    backend: str,
) -> Tensor:
    return kernels.get(backend, hidden.device).moe_experts(
        hidden, gate_up, down, topk_ids, topk_weights, activation
    )


@_moe_experts_op.register_fake
def _moe_experts_fake(hidden, gate_up, down, topk_ids, topk_weights, activation, backend):
    return hidden.new_empty(hidden.shape)


def moe_experts(
    backend: str,
    hidden: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    activation: str,
) -> Tensor:
    """`Kernels.moe_experts` on `backend`."""
    if _use_operator(hidden, gate_up, down, topk_weights):
        return torch.ops.fusion.moe_experts(
            hidden, gate_up, down, topk_ids, topk_weights, activation, backend
        )
    return kernels.get(backend, hidden.device).moe_experts(
        hidden, gate_up, down, topk_ids, topk_weights, activation
    )

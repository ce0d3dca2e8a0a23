"""Backward formulas of the fused operators (`torch.ops.fusion.*`, `fusion.kernels.ops`).

`ops` registers these with `torch.library.register_autograd`, so a compiled fused model
that trains (`torch.compile` with gradients) keeps each kernel one opaque operator instead
of tracing the reference's ops. Eager training does not come here: eager fused modules call
the backend's Python code, which autograd differentiates directly.

Why they are correct: each formula is the derivative of the function `reference` defines
(not of any backend's rounding), written with the same dtypes and casts, and checked by
`torch.autograd.gradcheck` in float64 and against autograd of the reference in float32 and
bfloat16 (`tests/fusion/kernels/test_autograd.py`). The MoE backward recomputes the
backward is one opaque operator (`fusion::moe_experts_backward`, recomputing each expert's
forward) because its per-expert row counts are data-dependent: a compiled graph never sees
its data-dependent loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusion.kernels import reference
from fusion.kernels.norm_variant import NormVariant

GELU_APPROXIMATION = {"gelu": "none", "gelu_tanh": "tanh"}
"""`act_and_mul` activation name -> `approximate` of `aten.gelu_backward`."""


def _sum_to(grad: Tensor, like: Tensor) -> Tensor:
    """`grad` summed over broadcast dimensions to `like`'s shape, in `like`'s dtype (the
    gradient of an input that was broadcast and promoted)."""
    return grad.sum_to_size(like.shape).to(like.dtype)


def _normalised(x: Tensor, eps: float, upcast: bool) -> tuple[Tensor, Tensor]:
    """`(n, r)` of `reference.rms_norm`: `r = rsqrt(mean(xc^2) + eps)`, `n = xc * r`, in the
    compute dtype (float32 when `upcast`, else `x.dtype`)."""
    xc = x.float() if upcast else x
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return xc * r, r


def rms_norm_backward(
    grad: Tensor,
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    variant: NormVariant,
) -> tuple[Tensor, Tensor | None]:
    """`(d x, d weight)` of `reference.rms_norm` in `variant` for the output gradient `grad`
    (d weight None for a weightless norm).

    With `n = xc * r` and `g` the gradient reaching `n` (in the compute dtype), the
    normalisation's derivative is `r * (g - n * mean(g * n))`; `g` is `grad` times the scale
    the variant multiplies `n` by, and the weight's gradient is `grad * n` (in the variant's
    product dtype) summed over every leading dimension."""
    offset = variant.offset
    n, r = _normalised(x, eps, variant.upcast)
    d_weight = None
    if weight is None:
        g = grad.to(n.dtype)
    elif variant.weight_after_cast:
        # y = (weight + offset) * n.to(T), in promote(W, T)
        cast = n.to(weight.dtype if variant.cast_to_weight else x.dtype)
        scale = weight + offset if offset else weight
        g = (grad * scale).to(n.dtype)
        d_weight = _sum_to(grad * cast, weight)
    else:
        # y = (n * (weight.to(P) + offset)).to(D), P = promote(W, compute dtype)
        scale = weight.to(reference.promoted(n, weight))
        if offset:
            scale = scale + offset
        grad_p = grad.to(scale.dtype)
        g = (grad_p * scale).to(n.dtype)
        d_weight = _sum_to(grad_p * n, weight)
    d_x = r * (g - n * (g * n).mean(-1, keepdim=True))
    return d_x.to(x.dtype), d_weight


def add_rms_norm_backward(
    grad_sum: Tensor | None,
    grad_norm: Tensor | None,
    a: Tensor,
    b: Tensor,
    weight: Tensor | None,
    eps: float,
    variant: NormVariant,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`(d a, d b, d weight)` of `reference.add_rms_norm` (`s = a + b`, then the norm of
    `s` in `variant`): the sum's gradient is its own output's gradient plus the norm's input gradient;
    `a` and `b` each get it summed back to their shapes and dtypes. A None output gradient
    (an output nobody used) counts as zeros."""
    total = a + b
    d_total = torch.zeros_like(total) if grad_sum is None else grad_sum.to(total.dtype)
    d_weight = None
    if grad_norm is not None:
        d_s, d_weight = rms_norm_backward(grad_norm, total, weight, eps, variant)
        d_total = d_total + d_s
    elif weight is not None:
        d_weight = torch.zeros_like(weight)
    return _sum_to(d_total, a), _sum_to(d_total, b), d_weight


def act_and_mul_backward(grad: Tensor, x: Tensor, activation: str) -> Tensor:
    """d x of `reference.act_and_mul` (`act(g) * u` with `x = [g, u]`): `[act'(g) * grad *
    u, grad * act(g)]`, the activation's derivative from ATen's own backward kernels."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    d_act = grad * up
    if activation == "silu":
        d_gate = torch.ops.aten.silu_backward(d_act, gate)
    else:
        approximate = GELU_APPROXIMATION[activation]
        d_gate = torch.ops.aten.gelu_backward(d_act, gate, approximate=approximate)
    d_up = grad * reference.ACTIVATIONS[activation](gate)
    return torch.cat([d_gate, d_up], dim=-1)


@torch.library.custom_op("fusion::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad: Tensor,
    hidden: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(d hidden, d gate_up, d down, d topk_weights)` of `reference.moe_experts` for the
    output gradient `grad`, recomputing each expert's forward (one extra forward's GEMMs).

    Per routed row (token t, choice k, expert e): `y = (w * (down[e] @ a)).to(D)` with
    `a = act_and_mul(p)`, `p = gate_up[e] @ hidden[t]`; so `d y = grad[t]`, `d w = d y . y'`
    (`y'` the unweighted expert output, in the product dtype), and the chain runs back
    through both GEMMs and the activation; rows of one token sum into `d hidden[t]`."""
    routed = reference.sort_by_expert(hidden, topk_ids, gate_up.shape[0])
    prod = torch.promote_types(hidden.dtype, topk_weights.dtype)
    w_row = topk_weights.reshape(-1).index_select(0, routed.order).to(prod).unsqueeze(-1)
    d_y = grad.index_select(0, routed.token_of_row).to(prod)
    d_rows = torch.zeros_like(routed.rows)
    d_w_row = torch.zeros(routed.rows.shape[0], dtype=prod, device=hidden.device)
    d_gate_up, d_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    start = 0
    for expert, count in enumerate(routed.counts):
        if not count:
            continue
        end = start + count
        rows = routed.rows[start:end]
        projected = rows @ gate_up[expert].t()
        activated = reference.act_and_mul(projected, activation)
        expert_out = activated @ down[expert].t()
        d_w_row[start:end] = (d_y[start:end] * expert_out.to(prod)).sum(-1)
        d_out = (d_y[start:end] * w_row[start:end]).to(hidden.dtype)
        d_down[expert] = d_out.t() @ activated
        d_projected = act_and_mul_backward(d_out @ down[expert], projected, activation)
        d_gate_up[expert] = d_projected.t() @ rows
        d_rows[start:end] = d_projected @ gate_up[expert]
        start = end
    d_hidden = torch.zeros_like(hidden).index_add_(0, routed.token_of_row, d_rows)
    d_weights = torch.zeros(topk_ids.numel(), dtype=prod, device=hidden.device)
    d_weights[routed.order] = d_w_row
    return d_hidden, d_gate_up, d_down, d_weights.view(topk_weights.shape).to(topk_weights.dtype)


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad, hidden, gate_up, down, topk_ids, topk_weights, activation):
    return (
        torch.empty_like(hidden),
        torch.empty_like(gate_up),
        torch.empty_like(down),
        torch.empty_like(topk_weights),
    )

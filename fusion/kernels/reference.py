"""The torch reference backend: plain PyTorch ops, every device, always available.

These functions define what every other backend must compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant

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


def act_and_mul_pair(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up`: `act_and_mul` of `cat((gate, up), -1)`, elementwise the same ops
    on the same values (so the same bits), without the concatenation."""
    return ACTIVATIONS[activation](gate) * up


def promoted(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """`torch.result_type(a, b)`, also while Dynamo traces (it cannot trace `result_type`,
    which returns a dtype): there both tensors' dims are static, and for two dimensioned
    tensors the result is `promote_types` of their dtypes. Outside Dynamo (eager, and the
    torch.fx traces the RMSNorm fuser compares variants with, where `dim()` is symbolic) it
    is `result_type` itself."""
    if torch.compiler.is_compiling() and a.dim() > 0 and b.dim() > 0:
        return torch.promote_types(a.dtype, b.dtype)
    return torch.result_type(a, b)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    variant: NormVariant = DEFAULT_VARIANT,
) -> torch.Tensor:
    """RMSNorm over the last dimension, in the exact `variant` given; returns a new tensor.

    With `C` the compute dtype (float32 when `variant.upcast`, else `x.dtype`), `D = x.dtype`
    and `W = weight.dtype` (the flags below are `variant`'s fields):

    - statistics and normalisation: `n = xc * rsqrt(mean(xc * xc, -1) + eps)` with
      `xc = x.to(C)`, all in `C` (`eps` is added inside the root); spelled as `variant.root`
      says (`xc / sqrt(...)`, `xc * reciprocal(sqrt(...))`), each op rounding as the
      module's own did;
    - no weight: `n.to(D)`;
    - `weight_after_cast` (Llama, T5): `(weight + offset) * n.to(T)` with `T = D`, or
      `T = W` when `cast_to_weight` (T5 casts to the weight's dtype); the product is in
      `promote(W, T)`, which is also the returned dtype;
    - otherwise (Gemma, OLMo2, `F.rms_norm`): `(n * (weight.to(P) + offset)).to(D)` with
      `P = promote(W, C)`: the scale, its offset and the product are all in `P`.

    Llama's and Gemma's orders round differently in bfloat16, and Gemma's `1 + weight` is
    exact only when the offset is added after the upcast; every combination is kept exact.
    `fusion.fusers.rmsnorm` proves a module computes one of these functions by comparing the
    traced dataflow of this function with the module's, so edits here must stay traceable by
    `torch.fx` (no Python branching on tensor values or dtypes).
    """
    dtype = x.dtype
    offset = variant.offset
    h = x.float() if variant.upcast else x
    v = h.pow(2).mean(-1, keepdim=True) + eps
    if variant.root == "div_sqrt":
        h = h / torch.sqrt(v)
    elif variant.root == "recip_sqrt":
        h = h * torch.reciprocal(torch.sqrt(v))
    else:
        h = h * torch.rsqrt(v)
    if weight is None:
        return h.to(dtype)
    if variant.weight_after_cast:
        scale = weight + offset if offset else weight
        return scale * h.to(weight.dtype if variant.cast_to_weight else dtype)
    scale = weight.to(promoted(h, weight))
    if offset:
        scale = scale + offset
    return (h * scale).to(dtype)


def add_rms_norm(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    variant: NormVariant = DEFAULT_VARIANT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(s, rms_norm(s, ...))` with `s = a + b`: a decoder layer's residual add and the norm
    that reads the sum, as one call. Returns two new tensors (neither aliases `a` or `b`).

    `s` is PyTorch's own `a + b` (its dtype promotion, broadcasting and rounding), and the
    norm reads that rounded `s`, never a wider intermediate: so the pair is bit for bit what
    `s = a + b; n = FusedRMSNorm(...)(s)` gives, in every variant `rms_norm` defines.
    """
    total = a + b
    return total, rms_norm(total, weight, eps, variant=variant)


def moe_experts(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Routed gated experts, grouped by expert; returns a new `[T, H]` tensor of `hidden`'s dtype.

    Shapes: `hidden [T, H]`; `gate_up [E, 2I, H]` (each expert's gate rows, then its up rows,
    as Transformers 5 packs them); `down [E, H, I]`; `topk_ids [T, K]` integer expert ids in
    `[0, E)`; `topk_weights [T, K]` of any floating dtype. `hidden`, `gate_up` and `down`
    share one dtype `D`.

    Function: `out[t] = sum_k (w[t, k] * down[e] @ act_and_mul(gate_up[e] @ hidden[t])).to(D)`
    with `e = ids[t, k]`: each routed product is formed in `promote(D, weights dtype)` and
    rounded to `D` before the sum, exactly as Transformers' eager expert loop does; only the
    order of the K-term sum may differ (rounding, never the function). Under autocast the
    loop's GEMMs run in the autocast dtype `A` and its products in `promote(A, weights
    dtype)`, still rounded to `D` and summed in `D`: so do these (the GEMMs are plain `mm`
    calls, which autocast casts as it casts the loop's `F.linear`).

    Computation: the T*K (token, choice) pairs are sorted by expert (stable), so each expert's
    rows form one contiguous slice that takes one GEMM per projection; the activation and
    product run once over all rows (`act_and_mul`), and the weighted rows go back with one
    `index_add_`. No Python loop over tokens, no one-hot over the experts.
    """
    num_tokens, hidden_size = hidden.shape
    two_inter = gate_up.shape[1]
    if num_tokens == 0 or topk_ids.shape[-1] == 0:
        return hidden.new_zeros(num_tokens, hidden_size)
    routed = sort_by_expert(hidden, topk_ids, gate_up.shape[0])
    slices = []  # (expert, first row, end row) of every expert with tokens
    start = 0
    for expert, count in enumerate(routed.counts):
        if count:
            slices.append((expert, start, start + count))
            start += count
    # `out=` writes into preallocated slices, which autograd cannot differentiate and
    # autocast does not cast (an `out=` overload computes in its operands' dtype): while
    # autograd records (a model called outside no_grad) or autocast is on, the same GEMMs
    # are concatenated instead.
    device_type = hidden.device.type
    autocast = (
        torch._C._is_any_autocast_enabled()
        and torch.amp.is_autocast_available(device_type)  # `is_autocast_enabled` raises if not
        and torch.is_autocast_enabled(device_type)
    )
    plain = not records_grad(hidden, gate_up, down, topk_weights) and not autocast
    grouped = _grouped_mm_out if plain else _grouped_mm
    projected = grouped(routed.rows, gate_up, slices, two_inter)
    # act(gate) * up over all rows at once: the activation is rounded to the input dtype
    # and multiplied in it, as `act_and_mul` does, but into the activation's own buffer.
    inter = two_inter // 2
    activated = ACTIVATIONS[activation](projected[:, :inter])
    activated.mul_(projected[:, inter:])
    expert_out = grouped(activated, down, slices, hidden_size)
    return combine(routed, expert_out, topk_weights, num_tokens, hidden.dtype)


@dataclass(frozen=True)
class ExpertRows:
    """The T*K routed (token, choice) pairs of a `moe_experts` call, sorted by expert."""

    rows: torch.Tensor
    """`[T*K, H]` hidden rows, each expert's rows contiguous, experts in id order."""
    order: torch.Tensor
    """Flat (token * K + choice) index of each row (a stable sort, so ties keep token order)."""
    token_of_row: torch.Tensor
    """The token each row came from (where `combine` adds it back)."""
    counts: list[int]
    """Rows per expert, for every expert id (zeros included)."""


def sort_by_expert(hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> ExpertRows:
    """`hidden [T, H]`'s rows gathered once per routed choice and sorted by expert id, so each
    expert's rows form one contiguous slice (the grouping every backend's experts use)."""
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // topk_ids.shape[-1]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    return ExpertRows(hidden.index_select(0, token_of_row), order, token_of_row, counts)


def expert_chain(
    routed: ExpertRows,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    gemm: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """Every routed row's expert output, as a new `[T*K, H]` tensor in `routed`'s row order:
    expert by expert, `gemm(rows, gate_up, e)` -> `act_and_mul` -> `gemm(that, down, e)`, so
    each expert's intermediate is still in cache when its down projection reads it. `gemm(x,
    weights, e)` must return `x @ weights[e].t()` (backends pass their own GEMM choice)."""
    pieces = []
    start = 0
    for expert, count in enumerate(routed.counts):
        if not count:
            continue
        rows = routed.rows[start : start + count]
        activated = act_and_mul(gemm(rows, gate_up, expert), activation)
        pieces.append(gemm(activated, down, expert))
        start += count
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def combine(
    routed: ExpertRows,
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    num_tokens: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`out[t] = sum over t's rows of (weight * expert_out row)` as a new `[T, H]` tensor of
    `dtype` (default `expert_out`'s; the input's, where autocast ran the GEMMs narrower):
    each product formed in `promote(expert_out dtype, weights dtype)` and rounded to `dtype`
    before the sum (as the eager loop does), added back with one `index_add_`.
    `expert_out` is consumed (scaled in place when the dtypes agree)."""
    dtype = expert_out.dtype if dtype is None else dtype
    out = expert_out.new_zeros(num_tokens, expert_out.shape[-1], dtype=dtype)
    weights = topk_weights.reshape(-1).index_select(0, routed.order).unsqueeze(-1)
    if weights.dtype == expert_out.dtype == dtype:
        weighted = expert_out.mul_(weights)
    else:  # the product in the promoted dtype, then rounded (as the eager loop does)
        weighted = torch.mul(expert_out, weights).to(out.dtype)
    return out.index_add_(0, routed.token_of_row, weighted)


def records_grad(*tensors: torch.Tensor) -> bool:
    """Will autograd record an op on these tensors (so `out=` writes and ops without a
    derivative must be avoided)?"""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _grouped_mm_out(
    rows: torch.Tensor, weights: torch.Tensor, slices: list[tuple[int, int, int]], width: int
) -> torch.Tensor:
    """`rows[first:end] @ weights[expert].t()` for every slice, written into one buffer."""
    result = rows.new_empty(rows.shape[0], width)
    for expert, first, end in slices:
        torch.mm(rows[first:end], weights[expert].t(), out=result[first:end])
    return result


def _grouped_mm(
    rows: torch.Tensor, weights: torch.Tensor, slices: list[tuple[int, int, int]], width: int
) -> torch.Tensor:
    """The same products as `_grouped_mm_out`, differentiable (slices cover every row)."""
    return torch.cat(
        [torch.mm(rows[first:end], weights[expert].t()) for expert, first, end in slices]
    )


_ATEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _has_cpu_kernel(op: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
    except RuntimeError:  # no such operator in this build: nothing registered for it
        return False


ATEN_RMS_NORM_IS_COMPOSITE = not (
    _has_cpu_kernel("aten::rms_norm") or _has_cpu_kernel("aten::_fused_rms_norm")
)
"""Does `torch.rms_norm` on CPU run ATen's composite (no CPU kernel registered for
`aten::rms_norm` or `aten::_fused_rms_norm`)? That composite is, in order: the input
upcast to float32 (`to`), `pow(2)`, `mean(-1, keepdim)`, `+ eps`, `rsqrt`, `mul`, and the
cast back (`type_as(input)`), the weight, when given, multiplied in float32 before that
cast: the very ops `rms_norm` below runs, so the same bits. Every shortcut to
`torch.rms_norm` asks this first (a build that registers a fused CPU kernel, with its own
reduction order, takes the plain ops instead: fail closed)."""


@dataclass(frozen=True)
class AtenNorm:
    """How `torch.rms_norm` computes `rms_norm` bit for bit: `torch.rms_norm(x, (d,),
    weight, eps)`, then, when `after` is set, `after * that` (Llama's order: the scale
    applied to the normalised value already cast back, `scale * n.to(x.dtype)`)."""

    weight: torch.Tensor | None
    after: torch.Tensor | None = None


def aten_norm(
    x: torch.Tensor, weight: torch.Tensor | None, variant: NormVariant
) -> AtenNorm | None:
    """The `torch.rms_norm` call that computes `rms_norm(x, weight, eps, variant=variant)`
    bit for bit, or None. On CPU, under ATen's composite (`ATEN_RMS_NORM_IS_COMPOSITE`),
    `torch.rms_norm` upcasts to float32, normalises, multiplies by `weight.to(float32)`
    and casts back: our weight-before-cast variant. Weightless it is `n.to(x.dtype)`, so
    the weight-after-cast order is `scale * torch.rms_norm(x, None)` whenever the cast
    target is `x.dtype` (not `cast_to_weight`, or the weight has `x`'s dtype); `scale` is
    `weight + offset` in the weight's dtype, as `rms_norm` forms it. None (the plain ops)
    off CPU, without the float32 statistics, for another dtype, a weight that is not
    one value per feature, or a root spelled other than `rsqrt` (`NormVariant.fast`:
    `torch.rms_norm` multiplies by `rsqrt`)."""
    if (
        not variant.fast
        or not ATEN_RMS_NORM_IS_COMPOSITE
        or x.device.type != "cpu"
        or not variant.upcast
        or x.dtype not in _ATEN_DTYPES
        or x.dim() == 0
    ):
        return None
    if weight is None:
        return AtenNorm(None)
    if weight.dtype not in _ATEN_DTYPES or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return None
    if variant.weight_after_cast:
        if variant.cast_to_weight and weight.dtype != x.dtype:
            return None  # the normalised value is cast to the weight's dtype: not aten's cast
        if x.dtype == weight.dtype == torch.float32 and not variant.offset:
            return AtenNorm(weight)  # every cast the identity: one call
        return AtenNorm(None, weight + variant.offset if variant.offset else weight)
    if not variant.offset:
        return AtenNorm(weight)
    return AtenNorm(weight.float() + variant.offset)


def aten_rms_norm(x: torch.Tensor, norm: AtenNorm, eps: float) -> torch.Tensor:
    """`rms_norm` through `torch.rms_norm` as `norm` (`aten_norm`) says."""
    out = torch.rms_norm(x, (x.shape[-1],), norm.weight, eps)
    return out if norm.after is None else norm.after * out


class TorchKernels:
    """Backend object for the reference kernels; its `interpreted`, `delegated` and
    `auto_pick` are the defaults a backend built on it inherits."""

    name = "torch"
    interpreted = False
    delegated: frozenset[str] = frozenset()
    auto_pick = True

    def supports(self, device: torch.device) -> bool:
        return True

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        return act_and_mul(x, activation)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> torch.Tensor:
        """`rms_norm`, through PyTorch's own `torch.rms_norm` where that computes the same
        ops in the same order (`aten_norm`: so the same bits; checked over the dtype grid
        by the tests): fewer dispatches of the same ATen ops."""
        norm = aten_norm(x, weight, variant)
        if norm is not None:
            return aten_rms_norm(x, norm, eps)
        return rms_norm(x, weight, eps, variant=variant)

    def add_rms_norm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm`: PyTorch's `a + b`, then this backend's own `rms_norm` of the sum
        (so the norm is bit for bit what `FusedRMSNorm` computes on the same backend)."""
        total = a + b
        return total, self.rms_norm(total, weight, eps, variant=variant)

    def moe_experts(
        self,
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        return moe_experts(hidden, gate_up, down, topk_ids, topk_weights, activation)

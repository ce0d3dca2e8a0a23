"""How far apart two tensors are, and how far is too far: the one error measure and the one
tolerance rule that the harness's parity oracle, the fusers' numeric self-checks and the tests
all use.

Error measure: the largest absolute difference over the compared elements divided by the
largest reference magnitude over the same elements (a max-normalised error). A single wrong
element is enough to show, yet elements near zero do not blow the ratio up the way an
element-wise relative error would. Computed in float64, so the measure adds no rounding of its
own.

NaN rule (one for every caller): a NaN anywhere in the compared output, or an infinity where the
reference is finite, makes the error NaN, and NaN never passes (`judge` checks for it before it
compares, and a plain `error <= limit` is False for NaN). Where the reference itself is infinite
(modules may return additive -inf masks) the output must hold the same infinity, else the error
is inf; a NaN in the reference can never be matched, so it is inf too.

Tolerance rule (docs/design.md, oracle 1): rounding is allowed, a changed function is not. The fused
error against a float64 reference may not exceed a small multiple of the unfused error against
the same reference, plus a dtype floor for the case where the unfused output is almost exact::

    tolerance = max(ERROR_MULTIPLE * unfused_error, dtype_floor(dtype))
    pass  <=>  fused_error <= tolerance      (and the fused output is finite)

Floors, tuned on the corpus (193 architectures, seed 0, batch 2 x 6 tokens, one padded row; the
unfused model's logits error against float64, max-normalised):

    dtype      unit roundoff   unfused error: min / median / max    floor
    float32    6.0e-8          1.3e-7 / 3.1e-7 / 6.7e-6             1e-6
    bfloat16   3.9e-3          2.2e-3 / 5.9e-3 / 1.4e-1             2e-3
    float16    4.9e-4          2.8e-4 / 7.5e-4 / 1.7e-2             5e-4

In half precision each floor sits at or below the smallest unfused error seen, so the rule is
effectively "at most twice the unfused error"; the floor only matters where the unfused output is
(nearly) exact, such as a module returning a mask (error 0), where a kernel that merely reorders a
sum must still pass. In float32 the floor is ~3x the median unfused error: rounding differences
of a reordered reduction stay below it, while any changed function (a wrong weight slice, a
dropped bias, a swapped activation) errs by orders of magnitude more; scaling one MLP's output
by 1.01 gives ~1e-3. With the torch-backend kernels (glu, mla, moe, qkv, rmsnorm, sibling;
1575 fusions) the largest fused/unfused error ratio was 1.10 in float32, 1.27 in bfloat16 and
1.59 in float16 (per module; on the logits 1.07 / 1.17 / 1.03): inside the 2x multiple.

A non-finite fused output where the unfused output is finite is a failure; when the unfused
output is non-finite too, the dtype cannot run that computation at all and the verdict is
`inconclusive` (neither passed nor blamed on fusion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ERROR_MULTIPLE = 2.0
"""How much worse than the unfused model the fused model may round."""

DTYPE_FLOORS: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.bfloat16: 2e-3,
    torch.float16: 5e-4,
}

Status = Literal["pass", "fail", "inconclusive"]


@dataclass(frozen=True)
class Verdict:
    """One parity judgement.

    `fused_error`/`unfused_error` are max-normalised errors against the float64 reference
    (NaN when that output is not finite); `tolerance` is what the fused error was held to.
    `reason` is empty on a pass and says why otherwise.
    """

    status: Status
    fused_error: float
    unfused_error: float
    tolerance: float
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"


def dtype_floor(dtype: torch.dtype) -> float:
    """The smallest tolerance for outputs computed in `dtype` (see the module docstring)."""
    try:
        return DTYPE_FLOORS[dtype]
    except KeyError:
        raise ValueError(
            f"no parity floor for dtype {dtype}; known: {list(DTYPE_FLOORS)}"
        ) from None


SELF_CHECK_TOLERANCE = {
    torch.float32: 1e-4,
    torch.float64: 1e-9,
    torch.bfloat16: 3e-2,
    torch.float16: 1e-2,
}
"""Max-normalised error a fuser's numeric self-check allows between a module and its fused
twin on the module's own weights (MoE blocks, experts): a reordered reduction rounds within
it, a changed function errs by far more. No unfused reference error exists there, so this
is a fixed table rather than `tolerance`."""


def self_check_passes(error: float, dtype: torch.dtype) -> bool:
    """Whether a self-check error in `dtype` is rounding (`SELF_CHECK_TOLERANCE`, 3e-2 for a
    dtype not listed); NaN (a non-finite output) never passes."""
    return error <= SELF_CHECK_TOLERANCE.get(dtype, 3e-2)


def tolerance(unfused_error: float, dtype: torch.dtype) -> float:
    """max(ERROR_MULTIPLE x unfused error, dtype floor); infinite when the unfused error is NaN.

    An infinite tolerance never passes a NaN output: `judge` checks for NaN before it compares
    against the tolerance.
    """
    if math.isnan(unfused_error):
        return math.inf
    return max(ERROR_MULTIPLE * unfused_error, dtype_floor(dtype))


def judge(fused_error: float, unfused_error: float, dtype: torch.dtype) -> Verdict:
    """Apply the tolerance rule to two measured errors (NaN meaning "output not finite")."""
    tol = tolerance(unfused_error, dtype)
    if math.isnan(fused_error):
        if math.isnan(unfused_error):
            return Verdict(
                "inconclusive",
                fused_error,
                unfused_error,
                tol,
                "neither fused nor unfused output is finite in this dtype",
            )
        return Verdict(
            "fail", fused_error, unfused_error, tol, "fused output is not finite (NaN or inf)"
        )
    if math.isnan(unfused_error):
        return Verdict(
            "inconclusive",
            fused_error,
            unfused_error,
            tol,
            "unfused output is not finite in this dtype; nothing to hold the fused output to",
        )
    if fused_error <= tol:
        return Verdict("pass", fused_error, unfused_error, tol)
    return Verdict(
        "fail",
        fused_error,
        unfused_error,
        tol,
        f"fused error {fused_error:.3g} exceeds tolerance {tol:.3g} "
        f"(unfused error {unfused_error:.3g})",
    )


def defined_elements(tensor: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The elements of `tensor` that `mask` (boolean, (batch, seq)) selects, as a 2-D view.

    Leading dims (batch, seq) select with the mask; a leading batch*seq dim (tokens flattened,
    as MoE blocks do) selects with the flattened mask; any other shape, or no mask, is returned
    whole.
    """
    if mask is not None:
        if tensor.dim() >= 2 and tuple(tensor.shape[:2]) == tuple(mask.shape):
            return tensor[mask.to(tensor.device)]
        if tensor.dim() >= 1 and tensor.shape[0] == mask.numel() != 1:
            return tensor[mask.reshape(-1).to(tensor.device)]
    return tensor.reshape(1, -1)


def relative_error(
    actual: torch.Tensor,
    reference: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    matching_nans: bool = False,
) -> float:
    """Max-normalised error of `actual` against `reference` over the defined elements.

    Returns NaN when `actual` is NaN anywhere, or infinite where the reference is finite (so a
    NaN can never hide behind a large tolerance). Where the reference itself is infinite (an
    additive -inf mask is a legitimate output), `actual` must hold the same infinity, else the
    error is inf. Otherwise: largest |actual - reference| over the finite reference elements
    divided by their largest |reference| (the absolute error when those are all zero); 0.0 when
    nothing is compared. Computed in float64 so the measure adds no rounding of its own.
    Raises ValueError on a shape mismatch: that is a structural difference, not an error size.

    With `matching_nans` (comparing fused against unfused, whose output may itself hold NaN,
    as the fuzzer does), NaN is a value like any other: positions NaN on both sides compare
    equal and are left out, and a NaN on one side only is an infinite error.
    """
    if actual.shape != reference.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    a = defined_elements(actual, mask).to(torch.float64)
    r = defined_elements(reference, mask).to(device=a.device, dtype=torch.float64)
    if matching_nans:
        nan = torch.isnan(r)
        if not torch.equal(torch.isnan(a), nan):
            return math.inf
        a, r = a[~nan], r[~nan]
    finite = torch.isfinite(r)
    if bool(torch.isnan(a).any()) or bool((torch.isinf(a) & finite).any()):
        return math.nan
    if not bool((a[~finite] == r[~finite]).all()):
        return math.inf
    a, r = a[finite], r[finite]
    if a.numel() == 0:
        return 0.0
    diff = float((a - r).abs().max())
    scale = float(r.abs().max())
    return diff / scale if scale > 0 else diff


def reference_is_defined(reference: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether the float64 reference has no NaN among its defined elements (inf is allowed)."""
    return not bool(torch.isnan(defined_elements(reference, mask)).any())


def compare(
    fused: torch.Tensor,
    unfused: torch.Tensor,
    reference: torch.Tensor,
    *,
    dtype: torch.dtype,
    mask: torch.Tensor | None = None,
) -> Verdict:
    """Judge one fused output against the unfused one, both measured against the reference.

    A reference with NaN makes the comparison `inconclusive` (the function itself is undefined
    there); a shape mismatch fails.
    """
    if not reference_is_defined(reference, mask):
        return Verdict("inconclusive", math.nan, math.nan, math.nan, "float64 reference is NaN")
    try:
        unfused_error = relative_error(unfused, reference, mask)
        fused_error = relative_error(fused, reference, mask)
    except ValueError as exc:
        return Verdict("fail", math.nan, math.nan, math.nan, f"output shape differs: {exc}")
    return judge(fused_error, unfused_error, dtype)

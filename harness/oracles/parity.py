"""The parity oracle: is a fused output as close to the float64 reference as the unfused one?

Pure functions on tensors and numbers; nothing here runs a model.

The error measure, its NaN rule and the tolerance rule (`relative_error`, `judge`, `compare`,
`Verdict`, the dtype floors) belong to `fusion.numerics`, which the fusers' self-checks and the
tests use too; they are re-exported here under their usual names. This module adds what the
harness compares and how verdicts combine.

What is compared: tokens whose attention-mask entry is 1 (`token_mask`). The harness pads one row
of its inputs; the outputs at padded positions are queries over no real key, which different
kernels may legitimately fill with different (even non-finite) values, so they are undefined and
excluded. Tensors whose leading dimensions are not (batch, seq) or (batch * seq) are compared
whole. Where the reference is infinite (modules may return additive -inf masks) the output must
hold the same infinity; a reference NaN makes the comparison inconclusive.

Module outputs are compared tensor by tensor (`compare_outputs`, floating tensors only), and the
worst verdict wins (`worst`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fusion.numerics import (
    DTYPE_FLOORS,
    ERROR_MULTIPLE,
    Status,
    Verdict,
    compare,
    defined_elements,
    dtype_floor,
    judge,
    reference_is_defined,
    relative_error,
    tolerance,
)

__all__ = [
    "DTYPE_FLOORS",
    "ERROR_MULTIPLE",
    "Status",
    "Verdict",
    "compare",
    "compare_outputs",
    "defined_elements",
    "dtype_floor",
    "flatten_tensors",
    "judge",
    "reference_is_defined",
    "relative_error",
    "token_mask",
    "tolerance",
    "worst",
    "worst_status",
]

_SEVERITY: dict[str, int] = {"pass": 0, "inconclusive": 1, "fail": 2}


def token_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The boolean (batch, seq) mask of real tokens, or None when there is no 2-D mask."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask != 0


def flatten_tensors(output: object) -> list[torch.Tensor]:
    """Every floating-point tensor in a module output, in a stable order.

    Walks tensors, tuples/lists and mappings (HF ModelOutput is a mapping); None and
    non-floating values (indices, masks) are dropped: integer outputs such as top-k expert ids
    may legitimately flip on a near-tie and are judged through the float outputs they select.
    """
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        items: Iterable[object] = output.values()
    elif isinstance(output, (tuple, list)):
        items = output
    else:
        return []
    return [t for item in items for t in flatten_tensors(item)]


def compare_outputs(
    fused: object,
    unfused: object,
    reference: object,
    *,
    dtype: torch.dtype,
    mask: torch.Tensor | None = None,
) -> Verdict:
    """Judge whole module outputs: every floating tensor pairwise, worst verdict wins."""
    f, u, r = flatten_tensors(fused), flatten_tensors(unfused), flatten_tensors(reference)
    if not len(f) == len(u) == len(r):
        return Verdict(
            "fail",
            math.nan,
            math.nan,
            math.nan,
            f"output structure differs: fused has {len(f)} float tensors, unfused {len(u)}, "
            f"reference {len(r)}",
        )
    return worst(compare(a, b, c, dtype=dtype, mask=mask) for a, b, c in zip(f, u, r))


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most severe verdict (fail > inconclusive > pass); among passes the largest error.

    An empty sequence passes with zero error (nothing to disagree about).
    """
    chosen: Verdict | None = None
    for verdict in verdicts:
        if chosen is None or _rank(verdict) > _rank(chosen):
            chosen = verdict
    return chosen or Verdict("pass", 0.0, 0.0, 0.0)


def _rank(verdict: Verdict) -> tuple[int, float]:
    error = verdict.fused_error
    return (_SEVERITY[verdict.status], math.inf if math.isnan(error) else error)


def worst_status(statuses: Sequence[Status]) -> Status:
    """The most severe of several statuses ("pass" for none)."""
    return max(statuses, key=_SEVERITY.__getitem__, default="pass")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a causal-LM output (`.logits`, or the first element of a tuple)."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"forward returned no logits ({type(output).__name__})")

"""Matching one norm instance: find the attribute carrying eps, evaluate the forward at every
dtype point, and accept the first kernel variant whose expression is equal at each of them.

eps is found per class: each float attribute of an instance is set to a marker value in a
shallow copy and the forward retraced; the attribute whose marker appears is the eps, read per
instance at fuse time. Anything else an instance carries goes into its instance signature."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion.analysis.alias import check_write_free
from fusion.errors import RewriteRefused
from fusion.fusers.rmsnorm.diagnose import diagnose
from fusion.fusers.rmsnorm.expr import Expr, const, walk
from fusion.fusers.rmsnorm.tracing import NormTrace, evaluate, trace_at
from fusion.fusers.rmsnorm.variants import (
    EXTRA,
    GRID,
    MARKER,
    Variant,
    candidate_variants,
    kernel_expr,
)
from fusion.kernels.norm_variant import ROOTS, RSQRT
from fusion.trace.signature import MODULE_INTERNALS, plain_attributes
from fusion.trace.tracer import forward_parameters


@dataclass(frozen=True)
class NormMatch:
    """What one kind of instance computes, and where its eps lives."""

    variant: Variant
    eps_attr: str
    eps_default_rule: bool
    """True when eps flows into `F.rms_norm`, whose `eps=None` means machine epsilon."""
    verified: frozenset
    weight_name: str | None
    carried_buffers: tuple[str, ...]
    """Non-persistent buffers the computation never reads, carried over unchanged."""


def instance_signature(module: nn.Module, eps_attr: str | None) -> tuple:
    """Everything about an instance that could change its traced computation, except eps
    (read per instance) and the weight's values/dtype (the match covers every dtype)."""
    items = plain_attributes(module, skip=(eps_attr,) if eps_attr else ())
    params = tuple((n, p.ndim) for n, p in module.named_parameters(recurse=False))
    buffers = tuple(sorted(n for n, _ in module.named_buffers(recurse=False)))
    return (items, params, buffers)


def root_spellings(exprs: Iterable[Any]) -> tuple[str, ...]:
    """The `NormVariant.root` spellings whose ops appear in `exprs`, in `ROOTS` order:
    `rsqrt` for an `rsqrt` node, `div_sqrt` for a `div` by a `sqrt`, `recip_sqrt` for a
    `recip` of a `sqrt`; `(rsqrt,)` where none does (the refusal then says why). Only the
    spellings present are tried, each a variant whose kernel expression must still equal
    the module's at every point."""
    found = set()
    for e in walk(list(exprs)):
        if e.op == "rsqrt":
            found.add("rsqrt")
        elif e.op == "div" and e.args[1].op == "sqrt":
            found.add("div_sqrt")
        elif e.op == "recip" and e.args[0].op == "sqrt":
            found.add("recip_sqrt")
    return tuple(root for root in ROOTS if root in found) or (RSQRT,)


def _inexact_pow(expr: Any) -> str | None:
    """Why `expr` (a norm at one dtype point) is one no kernel variant computes because its
    inverse root is `pow(v, -0.5)` in a reduced dtype (`expr.power`: there ATen's `pow`
    rounds otherwise than `rsqrt`), or None."""
    for e in walk(expr):
        if e.op == "pow" and e.args[1] == const(-0.5):
            dtype = "a reduced dtype" if e.dtype is None else str(e.dtype).removeprefix("torch.")
            return f"pow(v, -0.5) in {dtype} rounds otherwise than rsqrt(v); no kernel computes it"
    return None


def _best_variant(
    candidates: Iterable[Variant], exprs: dict[tuple, Any], must: list[tuple], points: tuple
) -> tuple[Variant, frozenset] | None:
    """`(variant, the points where it computes the norm's expression)` for the candidate equal
    at every `must` point and at the most of `points` (the first of equals), or None.

    Safe because only equality is trusted: a point outside the returned set runs the
    original forward (`NormForward.failure`), so a variant that agrees at some float32 points
    and not at float64 (one that upcasts, where the norm does not) is never run there."""
    best: tuple[Variant, frozenset] | None = None
    for variant in candidates:
        if not all(kernel_expr(variant, *point) == exprs[point] for point in must):
            continue
        verified = frozenset(p for p in points if kernel_expr(variant, *p) == exprs[p])
        if best is None or len(verified) > len(best[1]):
            best = (variant, verified)
    return best


def _eps_candidates(module: nn.Module) -> list[str]:
    """Instance attributes that could hold eps: numbers (not flags) and Nones."""
    return [
        key
        for key, value in sorted(module.__dict__.items())
        if key not in MODULE_INTERNALS
        and not key.startswith("__")
        and (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)))
    ]


def _eps_in_place(expr: Any) -> bool:
    """Is the marker added to a mean (where an RMSNorm's eps goes)?"""
    marker = const(MARKER)
    return any(
        e.op == "add" and marker in e.args and any(a.op == "mean" for a in e.args)
        for e in walk(expr)
    )


def _weight_name(module: nn.Module) -> str | None:
    params = list(module.named_parameters(recurse=False))
    if len(params) > 1:
        raise RewriteRefused(f"{len(params)} parameters; an RMSNorm has at most one")
    if not params:
        return None
    name, param = params[0]
    if name != "weight":
        raise RewriteRefused(f"parameter is named {name}; FusedRMSNorm keeps `weight`")
    if param.ndim != 1:
        raise RewriteRefused(f"parameter {name} is {param.ndim}-D, not a per-channel weight")
    return name


def _points(has_weight: bool) -> tuple[list[tuple], list[tuple]]:
    """(required, extra) (input dtype, weight dtype) pairs."""
    wdtypes = GRID if has_weight else (None,)
    required = [(d, w) for d in GRID for w in wdtypes]
    extra_w = (*GRID, *EXTRA) if has_weight else (None,)
    extra = [(d, w) for d in (*GRID, *EXTRA) for w in extra_w if (d, w) not in required]
    return required, extra


def prove_variant(module: nn.Module) -> NormMatch:
    """Prove which `FusedRMSNorm` variant `module` computes; RewriteRefused says why not.

    The dataflow is judged first (so a LayerNorm or a gated norm is refused as such), then
    the source is checked free of in-place writes, which the dataflow cannot show."""
    extra = [
        p.name
        for p in list(forward_parameters(module).values())[2:]
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if extra:
        # FusedRMSNorm takes one tensor; a caller passing `gate` (or a residual) must not
        # meet a module that silently ignores it.
        raise RewriteRefused(f"gated norm: forward takes a second input ({', '.join(extra)})")
    weight_name = _weight_name(module)
    weight = module._parameters[weight_name] if weight_name else None
    width = int(weight.shape[0]) if weight is not None else 8
    native = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
    native_w = native if weight is not None else None

    def trace(dtype, wdtype, overrides):
        return trace_at(module, dtype, wdtype, overrides, weight_name, width)

    eps_attr, marked = _find_eps(
        module,
        lambda overrides: trace(native, native_w, overrides),
        lambda t: evaluate(t, module, native, native_w, weight_name)[0],
    )
    overrides = {eps_attr: MARKER}
    required, extra = _points(weight is not None)
    exprs: dict[tuple, Any] = {}
    eps_rule = False
    for point in (*required, *extra):
        trace_point = trace(*point, overrides) if marked.guarded else marked
        exprs[point], through = evaluate(trace_point, module, *point, weight_name)
        eps_rule = eps_rule or through
    native_expr = exprs[(native if native in GRID else torch.float32, native_w)]
    used = {e.op for point in required for e in walk(exprs[point])}
    if weight is not None and "w" not in used:
        raise RewriteRefused(f"parameter {weight_name} is not used by the norm's computation")
    offsets = {0.0} | {
        e.value
        for e in walk(native_expr)
        if e.op == "const" and e.value != MARKER and math.isfinite(e.value)
    }
    roots = root_spellings(exprs[point] for point in required)
    # A point whose own computation no kernel computes (a reduced-dtype `pow(v, -0.5)`) is
    # left unproven, so calls at it run the original (`NormForward` checks `verified` per
    # call); every other required point must match, so one variant covers the norm.
    inexact = {point: _inexact_pow(exprs[point]) for point in required}
    must = [point for point in required if inexact[point] is None]
    candidates = candidate_variants(weight is not None, offsets, roots)
    best = _best_variant(candidates, exprs, must, (*required, *extra)) if must else None
    if best is not None:
        check_write_free(module)
        return NormMatch(
            variant=best[0],
            eps_attr=eps_attr,
            eps_default_rule=eps_rule,
            verified=best[1],
            weight_name=weight_name,
            carried_buffers=_carried_buffers(module, used),
        )
    raise RewriteRefused(
        (None if must else next(iter(inexact.values())))
        or diagnose(native_expr, MARKER)
        or f"computes no FusedRMSNorm variant: {str(native_expr).replace(repr(MARKER), 'eps')}"
    )


def _find_eps(
    module: nn.Module,
    trace: Callable[[dict[str, Any]], NormTrace],
    evaluate_native: Callable[[NormTrace], Any],
) -> tuple[str, NormTrace]:
    """(eps attribute, the trace with the marker planted in it), at the module's native dtypes.

    Plants a marker in each candidate attribute until it shows up where eps goes (added to the
    mean square). An attribute whose marker lands elsewhere (an optional bias set to None,
    say) is not eps, but it may explain a refusal."""
    base_expr = evaluate_native(trace({}))
    _refuse_shape(base_expr)
    stray: Any = None
    for key in _eps_candidates(module):
        if getattr(module, key) == MARKER:
            continue
        candidate = trace({key: MARKER})
        expr = evaluate_native(candidate)
        if _eps_in_place(expr):
            return key, candidate
        if stray is None and any(e.op == "const" and e.value == MARKER for e in walk(expr)):
            stray = expr
    reason = diagnose(stray, MARKER) if stray is not None else None
    raise RewriteRefused(
        reason or diagnose(base_expr, None) or "eps is not read from an attribute of the module"
    )


def _carried_buffers(module: nn.Module, used: set[str]) -> tuple[str, ...]:
    """Buffers the computation never reads: non-persistent ones are carried over; a
    persistent one would vanish from checkpoints, so it refuses."""
    names = [name for name, _ in module.named_buffers(recurse=False)]
    if "buffer" in used:
        raise RewriteRefused("the computation reads a buffer")
    persistent = [n for n in names if n not in module._non_persistent_buffers_set]
    if persistent:
        raise RewriteRefused(f"persistent buffers {persistent} are not part of an RMSNorm")
    return tuple(names)


def _refuse_shape(expr: Any) -> None:
    if isinstance(expr, (tuple, list)):
        raise RewriteRefused("returns a tuple, not the normalised tensor")
    if not isinstance(expr, Expr):
        raise RewriteRefused("returns no tensor")

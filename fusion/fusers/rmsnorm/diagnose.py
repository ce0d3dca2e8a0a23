"""Why an expression is not an RMSNorm, in words a reader of a refusal understands."""

from __future__ import annotations

from typing import Any

from fusion.fusers.rmsnorm.expr import Expr, walk


def _contains(e: Expr, predicate) -> bool:
    return any(predicate(node) for node in walk(e))


def diagnose(expr: Any, marker: float | None) -> str | None:
    """Why `expr` is not an RMSNorm, in the words of the issue; None when nothing specific
    is recognised (the caller then prints the expression)."""
    if not isinstance(expr, Expr):
        return None
    nodes = list(walk(expr))
    ops = {node.op for node in nodes}
    if "input" in ops:
        return "gated norm: a second tensor input enters the computation"
    if ops & {"var", "std"} or any(
        n.op == "sub" and any(_contains(a, lambda m: m.op == "mean") for a in n.args) for n in nodes
    ):
        return "subtracts the mean (LayerNorm), not an RMSNorm"
    if "mean" not in ops and "sum" in ops:
        return "sums the squares instead of averaging them"
    for node in nodes:
        if node.op == "mean" and node.value[0] != (-1,):
            return f"normalises over dims {node.value[0]}, not the last dimension only"
        if node.op == "mean" and not node.value[1]:
            return "reduces without keepdim"
    roots = [n for n in nodes if n.op in ("rsqrt", "sqrt", "recip")]
    if not roots or "mean" not in ops:
        return "no inverse root of a mean square"
    if marker is not None:
        inside = any(
            _contains(r, lambda m: m.op == "const" and m.value == marker)
            for r in roots
            if r.op in ("rsqrt", "sqrt")
        )
        anywhere = any(n.op == "const" and n.value == marker for n in nodes)
        if anywhere and not inside:
            return "eps is added outside the root"
    top = expr
    while top.op == "cast":
        top = top.args[0]
    if top.op in ("rsqrt", "sqrt", "recip"):
        return "returns the inverse root itself, not the input scaled by it"
    if top.op not in ("mul", "div"):
        op = top.value if top.op == "opaque" else top.op
        return f"computation after the normalised output ({op})"
    if any(a.op == "const" for a in top.args):
        return "computation after the normalised output (scaled by a constant)"
    return None

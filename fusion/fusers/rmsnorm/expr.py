"""Expressions: a norm's dataflow with explicit dtypes, canonicalised while it is built.

Implicit type promotion becomes a cast node, a cast to the dtype a value already has
disappears, and two casts collapse when the first one is exact (bf16 -> fp32 -> D equals
bf16 -> D). Spellings become one node only where ATen runs the same op for them, so the same
bits: `rsqrt(v)` and `pow(v, -0.5)` / `v ** -0.5` in float32 or float64 give `rsqrt` (ATen's
`pow` calls `rsqrt` there; in bfloat16 and float16 it rounds otherwise, so it stays `pow`);
`1 / t`, `reciprocal(t)` and `pow(t, -1)` give `recip`; `pow(x, 2)`, `square(x)` and `x * x`
give `sq`. `x / sqrt(v)` stays a `div` and `x * (1 / sqrt(v))` a product with
`recip(sqrt(v))`: each rounds differently from `x * rsqrt(v)`, so each is its own
expression, matched by the kernel variant that spells it (`NormVariant.root`). Products and
sums of one dtype are flattened and sorted (they differ only in rounding order).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Expr:
    """One value of the norm's dataflow: an op over argument expressions, in one dtype.

    `op` is `x` (the input), `w` (the weight), `input`/`buffer` (other tensors, `value` names
    them), `const` (a Python number, `dtype` None), `cast`, `mul`, `add`, `sub`, `div`, `sq`,
    `mean` (`value` = (dims, keepdim)), `sum`, `rsqrt`, `sqrt`, `recip`, `pow`, or
    `opaque` (`value` names the op nothing here models).
    """

    op: str
    args: tuple[Expr, ...] = ()
    dtype: torch.dtype | None = None
    value: Any = None

    def __str__(self) -> str:
        dt = "" if self.dtype is None else ":" + str(self.dtype).removeprefix("torch.")
        if self.op == "const":
            return repr(self.value)
        if self.op in ("x", "w"):
            return self.op + dt
        inner = ", ".join(str(a) for a in self.args)
        extra = "" if self.value is None else f"|{self.value}"
        return f"{self.op}{dt}({inner}{extra})"


def const(value: float) -> Expr:
    return Expr("const", value=float(value))


def _exact(src: torch.dtype | None, dst: torch.dtype | None) -> bool:
    """Does casting `src` to `dst` keep every value (bf16/fp16 -> fp32, anything -> fp64)?"""
    if src is None or dst is None or src == dst:
        return True
    if dst == torch.float64:
        return src in (torch.float32, torch.bfloat16, torch.float16)
    return dst == torch.float32 and src in (torch.bfloat16, torch.float16)


def cast(e: Expr, dtype: torch.dtype) -> Expr:
    """`e` rounded to `dtype`: dropped when already there; cast chains collapse when exact."""
    if e.dtype is None or e.dtype == dtype:
        return e
    if e.op == "cast" and _exact(e.args[0].dtype, e.dtype):
        return cast(e.args[0], dtype)
    return Expr("cast", (e,), dtype)


def promote(*values: Expr) -> torch.dtype | None:
    dtypes = [v.dtype for v in values if v.dtype is not None]
    if not dtypes:
        return None
    result = dtypes[0]
    for dt in dtypes[1:]:
        result = torch.promote_types(result, dt)
    return result


def _flat(op: str, operands: list[Expr], dtype: torch.dtype | None) -> Expr:
    """A commutative, associative `op` over `operands` (flattened within one dtype, sorted)."""
    terms: list[Expr] = []
    for operand in operands:
        if operand.op == op and operand.dtype == dtype:
            terms.extend(operand.args)
        else:
            terms.append(operand)
    if op == "mul" and len(terms) == 2 and terms[0] == terms[1]:
        return Expr("sq", (terms[0],), dtype)
    return Expr(op, tuple(sorted(terms, key=str)), dtype)


def unary(op: str, e: Expr) -> Expr:
    """`op(e)`. No identities between roots (`1 / sqrt(v)` is not `rsqrt(v)` bit for bit,
    nor `1 / rsqrt(v)` `sqrt(v)`): each spelling keeps its own ops."""
    return Expr(op, (e,), e.dtype)


_EXACT_RSQRT_POW = (torch.float32, torch.float64)
"""Dtypes in which ATen's `pow(v, -0.5)` is its `rsqrt(v)` bit for bit (checked on CPU; in
bfloat16 and float16 it rounds otherwise on some values)."""


def power(e: Expr, exponent: float) -> Expr:
    """`e ** exponent`, as the op ATen runs for it: `square`, `sqrt`, `reciprocal` (and
    `rsqrt` in `_EXACT_RSQRT_POW`) for the exponents its `pow` hands to them."""
    special = {2.0: "sq", 0.5: "sqrt", -1.0: "recip"}
    if exponent == 1.0:
        return e
    if float(exponent) in special:
        return unary(special[float(exponent)], e)
    if float(exponent) == -0.5 and e.dtype in _EXACT_RSQRT_POW:
        return unary("rsqrt", e)
    return Expr("pow", (e, const(exponent)), e.dtype)


def binary(op: str, a: Any, b: Any) -> Any:
    """`a <op> b` with PyTorch's promotion made explicit; Python numbers fold."""
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        return _PY_BINARY[op](a, b)
    a = a if isinstance(a, Expr) else const(a)
    b = b if isinstance(b, Expr) else const(b)
    dtype = promote(a, b)
    a, b = cast(a, dtype) if dtype else a, cast(b, dtype) if dtype else b
    if op in ("mul", "add"):
        return _flat(op, [a, b], dtype)
    if op == "div" and a.op == "const" and a.value == 1.0 and b.op != "const":
        return unary("recip", b)  # `1 / t` is `t.reciprocal() * 1`: the same bits
    if op == "pow" and b.op == "const":
        return power(a, b.value)
    return Expr(op, (a, b), dtype)


_PY_BINARY = {
    "mul": operator.mul,
    "add": operator.add,
    "sub": operator.sub,
    "div": operator.truediv,
    "pow": operator.pow,
}


def walk(e: Any) -> Iterator[Expr]:
    if isinstance(e, Expr):
        yield e
        for arg in e.args:
            yield from walk(arg)
    elif isinstance(e, (tuple, list)):
        for item in e:
            yield from walk(item)

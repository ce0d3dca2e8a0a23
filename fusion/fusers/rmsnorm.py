"""RMSNorm: any module computing a root-mean-square norm -> one `FusedRMSNorm` kernel call.

The computation is matched, never the class name. A norm's forward is traced with fx and its
dataflow is read as an expression over the input `x`, the weight `w` and constants, with every
dtype explicit: implicit type promotion becomes a cast node, a cast to the dtype a value
already has disappears, and two casts collapse when the first one is exact (bf16 -> fp32 ->
D equals bf16 -> D). Spellings of one function become one node: `rsqrt(v)`, `pow(v, -0.5)`,
`v ** -0.5`, `1 / sqrt(v)` and `x / sqrt(v)` all give `rsqrt`; `pow(x, 2)`, `square(x)` and
`x * x` give `sq`; products and sums of one dtype are flattened and sorted (they differ only
in rounding order). `F.rms_norm` (and so `nn.RMSNorm`) is expanded into the ops PyTorch runs.

The reference kernel (`fusion.kernels.torch_ref.rms_norm`) is traced and read the same way
for each candidate variant, and a variant is accepted only if both expressions are equal at
every (input dtype, weight dtype) pair of float32, bfloat16 and float16. That grid is what
tells Llama's cast-then-weight from Gemma's weight-then-cast (equal in float32, different in
bfloat16) and T5's cast to the weight's dtype from Llama's cast to the input's. A forward
that branches on a dtype (`if self.weight.dtype in [...]`) is traced once per grid point, the
branch answered from the meta values, so each point is judged on its own path.

eps is found per class: each float attribute of an instance is set to a marker value in a
shallow copy and the forward retraced; the attribute whose marker appears is the eps, read per
instance at fuse time. Anything else an instance carries (flags such as Gemma 3n's
`with_scale`) goes into an instance signature; an instance whose signature differs from the
matched one is matched on its own, so a per-class cache can never hand one instance another
instance's variant.
"""

from __future__ import annotations

import ast
import copy
import inspect
import math
import operator
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn

from fusion import alias
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser, has_hooks, per_signature
from fusion.kernels import torch_ref
from fusion.modules import FusedRMSNorm
from fusion.trace import UNKNOWN, LeafTracer, forward_parameters

GRID = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes every accepted variant must reproduce exactly, for the input and the weight."""

EXTRA = (torch.float64,)
"""Dtypes also checked; a variant equal there too is allowed to run there."""

_MARKER = 0.000123456789
"""A value no real eps has, planted in one attribute at a time to find which carries eps."""

_NORM_NAME = re.compile(r"RMSNorm$")
"""Classes whose name says RMSNorm: if they do not match, the reason must be reported."""

_MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
)


# --------------------------------------------------------------------------------------------
# Expressions: the dataflow of a norm with explicit dtypes, canonicalised while it is built.


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


def _promote(*values: Expr) -> torch.dtype | None:
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
    if op == "recip" and e.op == "sqrt":
        return Expr("rsqrt", e.args, e.dtype)
    if op == "recip" and e.op == "rsqrt":
        return Expr("sqrt", e.args, e.dtype)
    return Expr(op, (e,), e.dtype)


def power(e: Expr, exponent: float) -> Expr:
    special = {2.0: "sq", -0.5: "rsqrt", 0.5: "sqrt", -1.0: "recip"}
    if exponent == 1.0:
        return e
    if float(exponent) in special:
        return unary(special[float(exponent)], e)
    return Expr("pow", (e, const(exponent)), e.dtype)


def binary(op: str, a: Any, b: Any) -> Any:
    """`a <op> b` with PyTorch's promotion made explicit; Python numbers fold."""
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        return _PY_BINARY[op](a, b)
    a = a if isinstance(a, Expr) else const(a)
    b = b if isinstance(b, Expr) else const(b)
    dtype = _promote(a, b)
    a, b = cast(a, dtype) if dtype else a, cast(b, dtype) if dtype else b
    if op in ("mul", "add"):
        return _flat(op, [a, b], dtype)
    if op == "div":
        if a.op == "const" and a.value == 1.0 and b.op != "const":
            return unary("recip", b)
        if b.op != "const":
            return _flat("mul", [a, unary("recip", b)], dtype)
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


# --------------------------------------------------------------------------------------------
# Abstract interpretation of a traced graph at one (input dtype, weight dtype) point.

_OPERATORS = {
    operator.mul: "mul",
    operator.add: "add",
    operator.sub: "sub",
    operator.truediv: "div",
    operator.pow: "pow",
    operator.neg: "neg",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.contains: "contains",
    operator.not_: "not_",
    operator.getitem: "getitem",
}
_TORCH_BINARY = {"mul": "mul", "add": "add", "sub": "sub", "div": "div", "true_divide": "div"}
_CAST_METHODS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}
_IDENTITY_METHODS = frozenset({"contiguous", "clone", "detach"})


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    target = node.target
    if target is getattr:
        return "getattr"
    if target in _OPERATORS:
        return _OPERATORS[target]
    if target is F.rms_norm or target is getattr(torch, "rms_norm", None):
        return "rms_norm"
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", "") or ""
    return name if module.startswith("torch") else f"function {name}"


def _dims(dim: Any) -> tuple | str:
    if dim is None:
        return "all"
    if isinstance(dim, (tuple, list)):
        return tuple(int(d) for d in dim)
    return (int(dim),)


class _Interpreter:
    """Evaluates a norm's graph to one `Expr` at given input and weight dtypes."""

    def __init__(self, input_name: str, weight_name: str | None, dtype: torch.dtype, wdtype):
        self.input_name = input_name
        self.weight_name = weight_name
        self.dtype = dtype
        self.wdtype = wdtype
        self.eps_through_rms_norm = False

    def run(self, graph: fx.Graph, root: nn.Module) -> Any:
        env: dict[fx.Node, Any] = {}

        def load(arg: Any) -> Any:
            return fx.node.map_aggregate(arg, lambda a: env[a] if isinstance(a, fx.Node) else a)

        for node in graph.nodes:
            if node.op == "placeholder":
                name = str(node.target).lstrip("*")
                if name == self.input_name:
                    env[node] = Expr("x", dtype=self.dtype)
                elif str(node.target).startswith("*"):
                    env[node] = UNKNOWN
                else:
                    env[node] = Expr("input", dtype=self.dtype, value=name)
            elif node.op == "get_attr":
                env[node] = self._attr(root, str(node.target))
            elif node.op == "output":
                return load(node.args[0])
            elif node.op in ("call_function", "call_method"):
                env[node] = self._call(_op_name(node), load(node.args), load(node.kwargs))
            else:
                env[node] = Expr("opaque", value=f"{node.op} {node.target}")
        return UNKNOWN

    def _attr(self, root: nn.Module, target: str) -> Expr:
        if target == self.weight_name:
            return Expr("w", dtype=self.wdtype)
        value = getattr(root, target, None)
        if torch.is_tensor(value):
            return Expr("buffer", dtype=value.dtype, value=target)
        return Expr("opaque", value=f"attribute {target}")

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Expr)]
        if any(a is UNKNOWN for a in (*args, *kwargs.values())):
            return Expr("opaque", tuple(tensors), value=name)
        try:
            result = self._dispatch(name, args, kwargs)
        except Exception:  # an unexpected argument form is an op we do not model
            result = None
        if result is None:
            return Expr("opaque", tuple(tensors), None, value=name)
        return result

    def _dispatch(self, name: str, args: tuple, kwargs: dict) -> Any:
        if name == "getattr":
            obj, attr = args
            if isinstance(obj, Expr):
                return obj.dtype if attr == "dtype" and obj.dtype is not None else None
            return getattr(obj, attr)
        if name in ("eq", "ne", "contains", "not_"):
            if any(isinstance(a, Expr) for a in args):
                return None
            return {"eq": operator.eq, "ne": operator.ne}.get(name, getattr(operator, name))(*args)
        if name == "result_type":
            a, b = args
            return _promote(a if isinstance(a, Expr) else const(a), b)
        first = args[0] if args else None
        if not isinstance(first, Expr):
            if name in _TORCH_BINARY or name == "pow":
                return binary(_TORCH_BINARY.get(name, name), *args)
            return None
        rest = args[1:]
        if name in _CAST_METHODS and not rest and not kwargs:
            return cast(first, _CAST_METHODS[name])
        if name in ("to", "type", "type_as"):
            return self._cast(name, first, rest, kwargs)
        if name in _IDENTITY_METHODS and not rest and not kwargs:
            return first
        if name in _TORCH_BINARY and len(rest) == 1 and not kwargs:
            return binary(_TORCH_BINARY[name], first, rest[0])
        if name == "pow" and len(rest) == 1 and not kwargs:
            return binary("pow", first, rest[0])
        if name in ("rsqrt", "sqrt", "reciprocal") and not rest and not kwargs:
            return unary({"reciprocal": "recip"}.get(name, name), first)
        if name == "square" and not rest and not kwargs:
            return unary("sq", first)
        if name == "neg" and not rest and not kwargs:
            return Expr("neg", (first,), first.dtype)
        if name in ("mean", "sum", "var", "std"):
            return self._reduce(name, first, rest, kwargs)
        if name == "rms_norm":
            return self._rms_norm(first, *rest, **kwargs)
        return None

    def _cast(self, name: str, x: Expr, rest: tuple, kwargs: dict) -> Expr | None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("copy", "non_blocking")}
        targets = [*rest, *kwargs.values()]
        if len(targets) != 1 or set(kwargs) - {"dtype"}:
            return None
        target = targets[0]
        if isinstance(target, Expr):  # `.to(other)` / `.type_as(other)`
            return cast(x, target.dtype) if target.dtype is not None else None
        if name != "type_as" and isinstance(target, torch.dtype):
            return cast(x, target)
        return None

    def _reduce(self, name: str, x: Expr, rest: tuple, kwargs: dict) -> Expr | None:
        params = dict(zip(("dim", "keepdim"), rest))
        params.update(kwargs)
        if "axis" in params:
            params["dim"] = params.pop("axis")
        if "dtype" in params:
            dtype = params.pop("dtype")
            if dtype is not None:
                x = cast(x, dtype)
        dims = _dims(params.pop("dim", None))
        keepdim = bool(params.pop("keepdim", False))
        extra = tuple(sorted(params.items()))
        return Expr(name, (x,), x.dtype, value=(dims, keepdim, extra) if extra else (dims, keepdim))

    def _rms_norm(self, x: Expr, normalized_shape: Any, weight: Any = None, eps: Any = None):
        """`F.rms_norm` as PyTorch computes it (checked bit for bit on CPU): statistics in
        `promote(x, float32)`, weight multiplied in that dtype, result cast to `x`'s dtype;
        eps None is that dtype's machine epsilon."""
        if (
            not isinstance(normalized_shape, (tuple, list, torch.Size))
            or len(normalized_shape) != 1
        ):
            return Expr("mean", (x,), x.dtype, value=(("rms_norm", tuple(normalized_shape)), True))
        compute = torch.promote_types(x.dtype, torch.float32)
        h = cast(x, compute)
        if eps is None:
            eps_value = const(torch.finfo(compute).eps)
        else:
            eps_value = const(eps)
            self.eps_through_rms_norm = True
        mean = Expr("mean", (unary("sq", h),), compute, value=((-1,), True))
        n = binary("mul", h, unary("rsqrt", binary("add", mean, eps_value)))
        if isinstance(weight, Expr):
            n = binary("mul", n, cast(weight, compute))
        elif weight is not None:
            return None
        return cast(n, x.dtype)


# --------------------------------------------------------------------------------------------
# Tracing a norm (or the kernel) at chosen dtypes.


class _NormTracer(LeafTracer):
    """`LeafTracer` with the input's meta dtype chosen, and Python branches on concrete meta
    values (dtype comparisons) answered instead of ending the trace; `guarded` records that
    the graph holds for this dtype point only."""

    def __init__(self, varkw: str | None, input_name: str, input_meta: torch.Tensor) -> None:
        super().__init__(varkw=varkw, input_name=input_name)
        self.input_meta = input_meta
        self.guarded = False

    def create_proxy(self, kind, target, args, kwargs, *rest, **rest_kwargs):
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **rest_kwargs)
        if kind == "placeholder" and str(target).lstrip("*") == self.input_name:
            proxy.meta = self.input_meta
        return proxy

    def to_bool(self, obj: fx.Proxy) -> bool:
        # Only a branch on dtypes is answered: the grid traces every dtype point, so each
        # path is judged. A branch on a shape or a value would be judged on the one meta
        # shape only, so it ends the trace (and the norm is refused).
        value = getattr(obj, "meta", UNKNOWN)
        if isinstance(value, bool) and _depends_on_dtypes_only(obj.node):
            self.guarded = True
            return value
        return super().to_bool(obj)


def _depends_on_dtypes_only(node: fx.Node) -> bool:
    """Does `node` read tensors only through `.dtype` (and otherwise constants)?"""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "call_function" and current.target is getattr:
            if current.args[1] == "dtype":
                continue
            return False
        if current.op in ("placeholder", "get_attr", "call_module", "call_method"):
            return False
        stack.extend(current.all_input_nodes)
    return True


def _input_name(module: nn.Module) -> tuple[str | None, str | None, int]:
    """(first positional input, `**kwargs` name, number of required tensor-like inputs)."""
    params = list(forward_parameters(module).values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varkw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    required = sum(1 for p in positional if p.default is inspect.Parameter.empty)
    return (positional[0].name if positional else None), varkw, required


@dataclass
class _Trace:
    graph: fx.Graph
    root: nn.Module
    guarded: bool


def _trace_at(
    module: nn.Module,
    dtype: torch.dtype,
    wdtype: torch.dtype | None,
    overrides: dict[str, Any],
    weight_name: str | None,
    width: int,
) -> _Trace:
    """Trace `module.forward` with an input of `dtype`, the weight (if any) as a meta tensor
    of `wdtype`, and instance attributes `overrides` set, on a shallow copy (the module
    itself is untouched). Raises RewriteRefused when the forward does not trace completely."""
    root = copy.copy(module)
    root._parameters = dict(module._parameters)
    if weight_name is not None and wdtype is not None:
        weight = module._parameters[weight_name]
        root._parameters[weight_name] = nn.Parameter(
            torch.empty(weight.shape, dtype=wdtype, device="meta"), requires_grad=False
        )
    root.__dict__.update(overrides)
    input_name, varkw, _ = _input_name(module)
    if input_name is None:
        raise RewriteRefused("forward takes no input")
    meta = torch.empty(2, 3, width, dtype=dtype, device="meta")
    tracer = _NormTracer(varkw, input_name, meta)
    try:
        graph = tracer.trace(root)
    except Exception as exc:
        raise RewriteRefused(
            f"forward does not trace completely: {type(exc).__name__}: {exc}"
        ) from exc
    return _Trace(graph, root, tracer.guarded)


def _evaluate(trace: _Trace, module, dtype, wdtype, weight_name) -> tuple[Any, bool]:
    input_name = _input_name(module)[0] or ""
    interpreter = _Interpreter(input_name, weight_name, dtype, wdtype)
    value = interpreter.run(trace.graph, trace.root)
    return value, interpreter.eps_through_rms_norm


# --------------------------------------------------------------------------------------------
# The kernel's expressions, per variant.


@dataclass(frozen=True)
class Variant:
    """The flags of `torch_ref.rms_norm` (see there) for one matched norm."""

    has_weight: bool
    offset: float = 0.0
    upcast: bool = True
    weight_after_cast: bool = True
    cast_to_weight: bool = False

    def describe(self) -> str:
        if not self.has_weight:
            order = "weightless"
        elif self.weight_after_cast:
            order = "weight after cast to " + (
                "weight dtype" if self.cast_to_weight else "input dtype"
            )
        else:
            order = "weight before cast"
        offset = f", scale {self.offset:g} + weight" if self.offset else ""
        stats = "float32 statistics" if self.upcast else "statistics in input dtype"
        return f"{stats}, {order}{offset}"


def _variants(has_weight: bool, offsets: set[float]) -> list[Variant]:
    """Candidate variants, simplest first."""
    result = []
    for upcast in (True, False):
        if not has_weight:
            result.append(Variant(False, 0.0, upcast))
            continue
        for offset in sorted(offsets, key=lambda v: (v != 0.0, v)):
            result.append(Variant(True, offset, upcast, True, False))
            result.append(Variant(True, offset, upcast, False, False))
            result.append(Variant(True, offset, upcast, True, True))
    return result


class _KernelProbe(nn.Module):
    """`torch_ref.rms_norm` in one variant as a module, so it traces like a norm."""

    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.variant = variant
        if variant.has_weight:
            self.weight = nn.Parameter(torch.empty(8, device="meta"), requires_grad=False)
        else:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.variant
        return torch_ref.rms_norm(
            x,
            self.weight,
            _MARKER,
            offset=v.offset,
            upcast=v.upcast,
            weight_after_cast=v.weight_after_cast,
            cast_to_weight=v.cast_to_weight,
        )


_KERNEL_TRACES: dict[Variant, _Trace] = {}
"""Explicit cache: variant -> the kernel's trace (dtype-generic, so traced once)."""


def _kernel_expr(variant: Variant, dtype: torch.dtype, wdtype: torch.dtype | None) -> Any:
    probe = _KernelProbe(variant)
    if variant not in _KERNEL_TRACES:
        trace = _trace_at(probe, torch.float32, None, {}, None, 8)
        if trace.guarded:  # the kernel must be dtype-generic for a single trace to stand
            raise AssertionError("torch_ref.rms_norm branches on a dtype")
        _KERNEL_TRACES[variant] = trace
    weight_name = "weight" if variant.has_weight else None
    return _evaluate(_KERNEL_TRACES[variant], probe, dtype, wdtype, weight_name)[0]


# --------------------------------------------------------------------------------------------
# Matching one instance.


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


def _signature(module: nn.Module, eps_attr: str | None) -> tuple:
    """Everything about an instance that could change its traced computation, except eps
    (read per instance) and the weight's values/dtype (the match covers every dtype)."""
    items = []
    for key, value in sorted(module.__dict__.items()):
        if key in _MODULE_INTERNALS or key == eps_attr or key.startswith("_"):
            continue
        plain = isinstance(value, (bool, int, float, str, type(None), torch.dtype)) or (
            isinstance(value, tuple) and all(isinstance(v, (int, float, str)) for v in value)
        )
        if plain:
            items.append((key, value))
        else:
            items.append((key, type(value).__name__, id(value)))
    params = tuple((n, p.ndim) for n, p in module.named_parameters(recurse=False))
    buffers = tuple(sorted(n for n, _ in module.named_buffers(recurse=False)))
    return (tuple(items), params, buffers)


def _eps_candidates(module: nn.Module) -> list[str]:
    """Instance attributes that could hold eps: numbers (not flags) and Nones."""
    return [
        key
        for key, value in sorted(module.__dict__.items())
        if key not in _MODULE_INTERNALS
        and not key.startswith("__")
        and (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)))
    ]


def _eps_in_place(expr: Any) -> bool:
    """Is the marker added to a mean (where an RMSNorm's eps goes)?"""
    marker = const(_MARKER)
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


def _funcdef(cls: type, name: str) -> ast.FunctionDef:
    fn = inspect.unwrap(getattr(cls, name))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise RewriteRefused(f"source of {cls.__name__}.{name} unavailable: {exc}") from exc
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise RewriteRefused(f"{cls.__name__}.{name} source is not a plain function definition")
    funcdef = tree.body[0]
    funcdef.decorator_list.clear()
    return funcdef


def check_write_free(module: nn.Module, name: str = "forward", depth: int = 0) -> None:
    """Refuse unless `module`'s `name` method (and the helper methods it calls on `self`)
    provably writes no tensor: no augmented assignment, no store through a subscript or
    attribute, and no call that may write its arguments (`fusion.alias` decides which calls
    are pure).

    The traced graph cannot show a write: fx records `h *= s` as `h = h * s`, and a
    discarded in-place call (`F.relu(x, inplace=True)`) has no user in the dataflow. Yet with
    a float32 input `x.to(torch.float32)` is `x` itself, so such a write changes the caller's
    tensor (a residual kept before the norm) and every later read of it, while FusedRMSNorm
    is a pure function of its input. No Transformers RMSNorm writes anything.
    """
    cls = type(module)
    if depth > 3:
        raise RewriteRefused(f"{cls.__name__}.{name}: helper calls nest too deeply to check")
    funcdef = _funcdef(cls, name)
    shadowed = alias.local_names(funcdef) & (alias.PURE_BUILTINS | alias.PURE_NAMESPACES)
    for node in ast.walk(funcdef):
        if isinstance(node, ast.AugAssign):
            raise RewriteRefused(
                f"{cls.__name__}.{name} has an augmented assignment (may write a tensor in place)"
            )
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            raise RewriteRefused(f"{cls.__name__}.{name} stores through a subscript or attribute")
        if not isinstance(node, ast.Call) or alias._known_pure(node, module, shadowed):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
            and inspect.isfunction(getattr(cls, func.attr, None))
            and not alias.writes_through_args(node)
        ):
            check_write_free(module, func.attr, depth + 1)  # a helper such as Gemma's _norm
            continue
        raise RewriteRefused(
            f"{cls.__name__}.{name} calls {ast.unparse(func)}, which may write its arguments"
        )


def derive(module: nn.Module) -> NormMatch:
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
        return _trace_at(module, dtype, wdtype, overrides, weight_name, width)

    base = trace(native, native_w, {})
    base_expr, _ = _evaluate(base, module, native, native_w, weight_name)
    _refuse_shape(base_expr)
    # Find the attribute carrying eps: plant a marker in each candidate until it shows up
    # where eps goes (added to the mean square). An attribute whose marker lands elsewhere
    # (an optional bias set to None, say) is not eps, but it may explain a refusal.
    eps_attr = None
    marked = None
    stray: Any = None
    for key in _eps_candidates(module):
        if getattr(module, key) == _MARKER:
            continue
        candidate = trace(native, native_w, {key: _MARKER})
        expr, _ = _evaluate(candidate, module, native, native_w, weight_name)
        if _eps_in_place(expr):
            eps_attr, marked = key, candidate
            break
        if stray is None and any(e.op == "const" and e.value == _MARKER for e in walk(expr)):
            stray = expr
    if eps_attr is None or marked is None:
        reason = _diagnose(stray, _MARKER) if stray is not None else None
        raise RewriteRefused(
            reason
            or _diagnose(base_expr, None)
            or "eps is not read from an attribute of the module"
        )
    overrides = {eps_attr: _MARKER}
    required, extra = _points(weight is not None)
    exprs: dict[tuple, Any] = {}
    eps_rule = False
    for point in (*required, *extra):
        trace_point = trace(*point, overrides) if marked.guarded else marked
        exprs[point], through = _evaluate(trace_point, module, *point, weight_name)
        eps_rule = eps_rule or through
    native_expr = exprs[(native if native in GRID else torch.float32, native_w)]
    used = {e.op for point in required for e in walk(exprs[point])}
    if weight is not None and "w" not in used:
        raise RewriteRefused(f"parameter {weight_name} is not used by the norm's computation")
    offsets = {0.0} | {
        e.value
        for e in walk(native_expr)
        if e.op == "const" and e.value != _MARKER and math.isfinite(e.value)
    }
    for variant in _variants(weight is not None, offsets):
        if all(_kernel_expr(variant, *point) == exprs[point] for point in required):
            verified = frozenset(
                point
                for point in (*required, *extra)
                if _kernel_expr(variant, *point) == exprs[point]
            )
            check_write_free(module)
            return NormMatch(
                variant=variant,
                eps_attr=eps_attr,
                eps_default_rule=eps_rule,
                verified=verified,
                weight_name=weight_name,
                carried_buffers=_carried_buffers(module, used),
            )
    raise RewriteRefused(
        _diagnose(native_expr, _MARKER)
        or f"computes no FusedRMSNorm variant: {str(native_expr).replace(repr(_MARKER), 'eps')}"
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


def _contains(e: Expr, predicate) -> bool:
    return any(predicate(node) for node in walk(e))


def _diagnose(expr: Any, marker: float | None) -> str | None:
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
    if top.op != "mul":
        op = top.value if top.op == "opaque" else top.op
        return f"computation after the normalised output ({op})"
    if any(a.op == "const" for a in top.args):
        return "computation after the normalised output (scaled by a constant)"
    return None


# --------------------------------------------------------------------------------------------
# The fuser.


def _looks_like_norm(graph: fx.Graph | None) -> bool:
    if graph is None:
        return False
    names = {_op_name(node) for node in graph.nodes if node.op.startswith("call")}
    return bool(names & {"rsqrt", "sqrt", "rms_norm", "pow", "reciprocal"}) and bool(
        names & {"mean", "rms_norm", "sum", "var"}
    )


@dataclass
class RMSNormFuser(Fuser):
    """Replace a norm module with a `FusedRMSNorm` computing its exact variant."""

    name: ClassVar[str] = "rmsnorm"
    redefines_forward: ClassVar[bool] = True
    replaces_module: ClassVar[bool] = True

    match_: NormMatch | None = None
    signature: tuple = ()
    by_signature: dict[tuple, NormMatch | str] = field(default_factory=dict, repr=False)

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        if next(module.children(), None) is not None:
            return False
        params = [p for _, p in module.named_parameters(recurse=False)]
        return len(params) <= 1 and all(p.ndim == 1 for p in params)

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> RMSNormFuser | None:
        named = bool(_NORM_NAME.search(type(module).__name__))
        if not named and not _looks_like_norm(graph):
            return None
        try:
            found = derive(module)
        except RewriteRefused:
            if named or _looks_like_norm(graph):
                raise
            return None
        fuser = cls(source_class=type(module).__name__, match_=found)
        fuser.signature = _signature(module, found.eps_attr)
        fuser.by_signature[fuser.signature] = found
        return fuser

    def _match_for(self, module: nn.Module) -> NormMatch:
        """The match for this instance: the class's, or (for an instance whose flags differ)
        its own, derived once per distinct signature."""
        assert self.match_ is not None
        signature = _signature(module, self.match_.eps_attr)
        return per_signature(self.by_signature, signature, lambda: derive(module), "not an RMSNorm")

    def validate(self, module: nn.Module) -> None:
        found = self._match_for(module)
        hooks = has_hooks(module)
        if hooks:
            raise RewriteRefused(f"norm has {hooks}")
        if "forward" in module.__dict__:
            raise RewriteRefused("norm has an instance-level forward")
        eps = getattr(module, found.eps_attr, None)
        if eps is None and not found.eps_default_rule:
            raise RewriteRefused(f"eps attribute {found.eps_attr} is None")
        if eps is not None and not isinstance(eps, (int, float)):
            raise RewriteRefused(f"eps attribute {found.eps_attr} is {type(eps).__name__}")

    def fuse(self, module: nn.Module, backend: str) -> nn.Module:
        self.validate(module)
        found = self._match_for(module)
        v = found.variant
        weight = module._parameters[found.weight_name] if found.weight_name else None
        eps = getattr(module, found.eps_attr)
        fused = FusedRMSNorm(
            weight if v.has_weight else None,
            None if eps is None else float(eps),
            offset=v.offset,
            upcast=v.upcast,
            weight_after_cast=v.weight_after_cast,
            cast_to_weight=v.cast_to_weight,
            verified=found.verified,
            backend=backend,
        )
        for name in found.carried_buffers:
            fused.register_buffer(name, module._buffers[name], persistent=False)
        fused.train(module.training)
        return fused

    def describe(self) -> str:
        assert self.match_ is not None
        return (
            f"-> FusedRMSNorm ({self.match_.variant.describe()}, eps from {self.match_.eps_attr})"
        )

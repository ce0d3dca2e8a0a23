"""Abstract interpretation of a traced norm graph at one (input dtype, weight dtype) point:
every node becomes an `Expr`; `F.rms_norm` (and so `nn.RMSNorm`) is expanded into the ops
PyTorch runs."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fusion.fusers.rmsnorm.expr import Expr, binary, cast, const, promote, unary
from fusion.trace.tracer import UNKNOWN

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


def op_name(node: fx.Node) -> str:
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


class Interpreter:
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
                env[node] = self._call(op_name(node), load(node.args), load(node.kwargs))
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
        if name == "pow" and kwargs:
            args, kwargs = _positional(args, kwargs, ("input", "exponent"))
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
            return promote(a if isinstance(a, Expr) else const(a), b)
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


def _positional(args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[tuple, dict]:
    """(args, kwargs) with keyword arguments named `names` moved to their positions
    (`torch.pow(v, exponent=-0.5)`, `torch.pow(input=v, exponent=-0.5)` and
    `v.pow(exponent=2)` are `pow(v, -0.5)` / `pow(v, 2)`: the same call, spelled with
    keywords). Unchanged when any keyword is not among the names still unfilled, so an
    unknown form stays unmodelled (opaque), never guessed."""
    free = names[len(args) :]
    if not set(kwargs) <= set(free) or set(free[: len(kwargs)]) != set(kwargs):
        return args, kwargs
    return (*args, *(kwargs[name] for name in free[: len(kwargs)])), {}

"""Tracing a norm (or the kernel) at chosen dtypes, and evaluating the trace to an `Expr`.

A forward that branches on a dtype (`if self.weight.dtype in [...]`) is traced once per dtype
point, the branch answered from the meta values, so each point is judged on its own path."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fusion.errors import RewriteRefused
from fusion.fusers.rmsnorm.interpret import Interpreter
from fusion.trace.tracer import UNKNOWN, LeafTracer, forward_parameters


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
class NormTrace:
    graph: fx.Graph
    root: nn.Module
    guarded: bool


def trace_at(
    module: nn.Module,
    dtype: torch.dtype,
    wdtype: torch.dtype | None,
    overrides: dict[str, Any],
    weight_name: str | None,
    width: int,
) -> NormTrace:
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
    return NormTrace(graph, root, tracer.guarded)


def evaluate(trace: NormTrace, module, dtype, wdtype, weight_name) -> tuple[Any, bool]:
    input_name = _input_name(module)[0] or ""
    interpreter = Interpreter(input_name, weight_name, dtype, wdtype)
    value = interpreter.run(trace.graph, trace.root)
    return value, interpreter.eps_through_rms_norm

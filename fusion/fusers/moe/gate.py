"""An experts module's gating (`_apply_gate`) read as a `GateProgram`, and proven equal.

The gating is traced at the ATen level (`make_fx` on meta tensors: nothing is computed),
so every submodule and function it calls (an activation module, `F.silu`, a soft-cap
helper) is seen as the ops it runs. The program is read from that trace (pure elementwise
ops of a small allow-list, splits and slices, casts to the input's dtype or a fixed one;
no parameter, buffer, in-place op or random op), then *proven*: the program's own trace
must equal the module's, op for op and constant for constant, at bfloat16, float16 and
float32 inputs (a cast that is a no-op at one dtype is visible at another). Two equal ATen
traces run the same kernels on the same values: the same bits. Anything else refuses.

A trace is one path through the gating's Python: the program is replayed for every call,
so it must be the same path at every row count and in both modes. The gating is traced at
one row (decode) and at many, in eval and in training mode, and accepted only when the four
traces are structurally equal (`canonical`); a gating that branches on `x.shape[0] == 1`
or on `self.training` is refused with the reason. What the traces read of the module
(`self.limit`, `self.act_fn` and what it reads) is recorded (`fusion.analysis.reads`) and
returned with the program, for `FusedExperts` to guard per call: a value changed after
fusing runs the original.

`GateProgram.activation` names the default gating `act(gate) * up` when the program is
proven equal to it for one of `reference.ACTIVATIONS` (the backend kernels then run it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from fusion.analysis.reads import guarded_reads, recording
from fusion.errors import RewriteRefused
from fusion.kernels.reference import ACTIVATIONS
from fusion.runtime.experts import GateProgram, GateStep, Ref, run_gate

_aten = torch.ops.aten
ALLOWED = frozenset(
    {
        _aten.split.Tensor,
        _aten.split_with_sizes.default,
        _aten.slice.Tensor,
        _aten.clamp.default,
        _aten.clamp_min.default,
        _aten.clamp_max.default,
        _aten.mul.Tensor,
        _aten.add.Tensor,
        _aten.sub.Tensor,
        _aten.div.Tensor,
        _aten.neg.default,
        _aten.tanh.default,
        _aten.sigmoid.default,
        _aten.silu.default,
        _aten.gelu.default,
        _aten.relu.default,
        _aten.exp.default,
        _aten.erf.default,
        _aten.pow.Tensor_Scalar,
        _aten._to_copy.default,
    }
)
"""The ATen ops a gating program may use: pure, deterministic, elementwise or splitting."""

COMMUTATIVE = frozenset({_aten.mul.Tensor, _aten.add.Tensor})
"""Ops whose two operands may be swapped without changing a bit (IEEE add and multiply)."""

TRACE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

TRACE_ROWS = (1, 16)
"""Row counts the gating is traced at: one row (a decode step of one token routed to one
expert) and many; the program must be the same at both."""


@dataclass(frozen=True)
class ProvenGate:
    """A gating's proven program and what its traces read: `reads` are `(module path in the
    experts, attribute name)` pairs (`fusion.analysis.reads.guarded_reads`)."""

    program: GateProgram
    reads: tuple[tuple[str, str], ...]


def trace_gate(
    fn: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype, rows: int = 4
) -> fx.Graph:
    """The ATen graph of `fn` on a `[rows, width]` meta tensor of `dtype`."""
    example = torch.empty(rows, width, dtype=dtype, device="meta")
    # make_fx reads the callable's signature: a bound method would count `self`.
    return make_fx(lambda x: fn(x))(example).graph


def _value_dtype(node: Any) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(value, "dtype", None)


def _is_identity_cast(node: fx.Node) -> bool:
    """A `_to_copy` to the dtype its input already has (a value no-op)."""
    return (
        node.target is _aten._to_copy.default
        and set(node.kwargs) <= {"dtype"}
        and _value_dtype(node.args[0]) == _value_dtype(node)
    )


def canonical(graph: fx.Graph) -> str:
    """The dataflow of `graph`'s output as one string: each op with its output dtype and its
    operands, constants as floats (an int and a float constant compute the same here),
    identity casts dropped, the operands of commutative ops in sorted order. Equal strings
    mean the same ops on the same values."""
    memo: dict[fx.Node, str] = {}

    def term(value: Any) -> str:
        if isinstance(value, fx.Node):
            return describe(value)
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(term(v) for v in value) + "]"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return repr(float(value))
        return repr(value)

    def describe(node: fx.Node) -> str:
        if node in memo:
            return memo[node]
        if node.op == "placeholder":
            text = "x"
        elif node.op == "call_function" and _is_identity_cast(node):
            text = describe(node.args[0])
        elif node.op == "call_function":
            args = [term(a) for a in node.args]
            if node.target in COMMUTATIVE:
                args = sorted(args)
            kwargs = [f"{k}={term(v)}" for k, v in sorted(node.kwargs.items())]
            text = f"{node.target}[{_value_dtype(node)}]({', '.join(args + kwargs)})"
        else:
            text = f"<{node.op} {node.target}>"
        memo[node] = text
        return text

    output = next(n for n in graph.nodes if n.op == "output")
    return term(output.args[0])


def read_program(graph: fx.Graph, input_dtype: torch.dtype) -> GateProgram:
    """The ops of `graph` (a gating traced at `input_dtype`) as a program; casts to
    `input_dtype` become casts to whatever the input's dtype is. RewriteRefused for any op
    outside `ALLOWED`, any state read (`get_attr`), or more than one input."""
    index: dict[fx.Node, int] = {}
    steps: list[GateStep] = []

    def arg(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return Ref(index[value])
        if isinstance(value, (list, tuple)):
            return tuple(arg(v) for v in value)
        if isinstance(value, torch.dtype):
            return "input" if value == input_dtype else str(value).removeprefix("torch.")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise RewriteRefused(f"gating constant of type {type(value).__name__}")

    result = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if index:
                raise RewriteRefused("gating reads more than its input")
            index[node] = 0
            continue
        if node.op == "output":
            result = node.args[0]
            continue
        if node.op != "call_function":
            raise RewriteRefused(f"gating reads module state ({node.op} {node.target})")
        if node.target is operator.getitem:
            op = "getitem"
        elif node.target in ALLOWED:
            op = "cast" if node.target is _aten._to_copy.default else str(node.target.name())
        else:
            raise RewriteRefused(f"gating op {node.target} is not one a fused kernel replays")
        if op == "cast" and set(node.kwargs) != {"dtype"}:
            raise RewriteRefused(f"gating cast with {sorted(node.kwargs)}")
        kwargs = tuple((k, arg(v)) for k, v in sorted(node.kwargs.items()))
        steps.append(GateStep(op, tuple(arg(a) for a in node.args), kwargs))
        index[node] = len(steps)
    if not isinstance(result, fx.Node) or index.get(result) != len(steps) or not steps:
        raise RewriteRefused("the gating's result is not its last op")
    return GateProgram(tuple(steps))


def _default_gate(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    act = ACTIVATIONS[activation]

    def gate(x: torch.Tensor) -> torch.Tensor:
        gate_part, up = x.chunk(2, dim=-1)
        return act(gate_part) * up

    return gate


def _traces(fn: Callable[[torch.Tensor], torch.Tensor], width: int, rows: int = 4) -> list[str]:
    return [canonical(trace_gate(fn, width, dtype, rows)) for dtype in TRACE_DTYPES]


def _set_training(experts: nn.Module, mode: bool) -> None:
    for module in experts.modules():
        module.training = mode


def _module_traces(
    apply_gate: Callable[[torch.Tensor], torch.Tensor], experts: nn.Module, width: int
) -> list[str]:
    """The gating's traces (one per dtype), after requiring them equal at every row count
    of `TRACE_ROWS` and in both modes; RewriteRefused naming what they depend on. Each
    module's mode is restored, whatever happens."""
    modes = {module: module.training for module in experts.modules()}
    by_mode: dict[bool, list[str]] = {}
    try:
        for mode in (False, True):
            _set_training(experts, mode)
            by_rows = [_traces(apply_gate, width, rows) for rows in TRACE_ROWS]
            if any(traces != by_rows[-1] for traces in by_rows):
                raise RewriteRefused(
                    f"gating depends on the row count (traced at {TRACE_ROWS} rows it runs "
                    "other ops): one replayed program cannot stand for it"
                )
            by_mode[mode] = by_rows[-1]
    finally:
        for module, mode in modes.items():
            module.training = mode
    if by_mode[False] != by_mode[True]:
        raise RewriteRefused("gating depends on training mode (eval and training trace apart)")
    return by_mode[False]


def proven_gate(experts: nn.Module, width: int) -> ProvenGate:
    """The proven program of `experts._apply_gate` on `[rows, width]` inputs and the
    attributes its traces read (see the module docstring); RewriteRefused naming what is
    not reproduced, what the gating depends on, or what it reads that cannot be guarded."""
    # The class's gating, bound to the instance: an instance-level override is a hazard
    # `validate` refuses per instance, never something a class-level match may read.
    gating = type(experts)._apply_gate

    def apply_gate(x: torch.Tensor) -> torch.Tensor:
        return gating(experts, x)

    before = {id(m): dict(m.__dict__) for m in experts.modules()}
    try:
        with recording(experts) as reads:
            module_traces = _module_traces(apply_gate, experts, width)
            graph = trace_gate(apply_gate, width, TRACE_DTYPES[0], TRACE_ROWS[-1])
    except RewriteRefused:
        raise
    except Exception as exc:
        raise RewriteRefused(f"gating does not trace: {type(exc).__name__}: {exc}") from exc
    after = {id(m): dict(m.__dict__) for m in experts.modules()}
    if before.keys() != after.keys() or any(
        before[k].keys() != after[k].keys()
        or any(before[k][name] is not after[k][name] for name in before[k])
        for k in before
    ):
        raise RewriteRefused("gating writes module state")
    program = read_program(graph, TRACE_DTYPES[0])
    if _traces(lambda x: run_gate(program, x), width, TRACE_ROWS[-1]) != module_traces:
        raise RewriteRefused("gating is not reproduced op for op by its program")
    guarded = guarded_reads(experts, reads)
    for name in ACTIVATIONS:
        if _traces(_default_gate(name), width, TRACE_ROWS[-1]) == module_traces:
            return ProvenGate(GateProgram(program.steps, activation=name), guarded)
    return ProvenGate(program, guarded)


def gate_program(experts: nn.Module, width: int) -> GateProgram:
    """The proven program of `experts._apply_gate` (`proven_gate` without its reads)."""
    return proven_gate(experts, width).program

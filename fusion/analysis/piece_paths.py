"""May a split piece of a merged GEMM meet a layout-sensitive use on a path the trace did
not replay, anywhere in the rewritten forward's source?

`fusion.trace.pieces` replays each piece through the traced graph: exact, but only on the path the
trace took. The trace evaluates `if self.flatten:`, `if mask is None:`, `len(x.shape) == 2`
and a helper's own branches once, for its own module and example input; a `q.view(-1)` on
the other side then meets a strided piece, and raises, where the original met the
projection's contiguous output (the flag flipped after fusing, or another input). This
module reads the source for such uses on every path: a piece that may reach a
layout-sensitive use (`LAYOUT_SENSITIVE`, a `torch.ops` kernel, a call whose callee cannot
be read) where the replay may not have seen it is handed out as a copy of its own
(`fresh`, `fusion.fusers.stacked.settle_layouts`), on which every use behaves as on the
projection's output, on every path.

Replayed means straight (`straight_statements`): a simple statement at the top level of the
function, with no conditional sub-expression (a ternary's arms, `and`/`or`, a comprehension,
a lambda, a chained comparison), after no top-level statement that may return, and whose
operands were bound only by such statements (so their values, the piece's holders and the
shapes asked for alike, cannot depend on a branch). Everything else is presumed not
replayed: a branch's body, a loop's, a `with` or `try` block's. Calls of plain Python
functions, of `self`'s methods and of `self`'s children are read (to MAX_CALL_DEPTH;
`Reach`): from a straight call site only the callee's own unreplayed uses count (the
replay ran the rest), from any other site all of them. Which names may hold a piece is
`fusion.analysis.piece_writes.holders_of` (flow-insensitive); writes, layout questions and returns
on every path are `fusion.analysis.piece_writes.written_pieces`. Both fail closed: a false hit costs
one copy per call on the stacked path, a miss a fused forward that raises, or computes
another value, where the original ran.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fusion.analysis.piece_writes import (
    binding_pairs,
    holders_of,
    is_box,
    read_function,
    summarise,
    trusted_call,
)
from fusion.analysis.value_roots import (
    CONTAINER_METHODS,
    MAX_CALL_DEPTH,
    NON_WRITING_BUILTINS,
    Scope,
    arguments_foreign,
    bind_arguments,
    call_arguments,
    is_builtin,
    is_self_call,
    is_tensor_method,
    names_read,
    namespace_of,
    no_writes,
    resolve_callee,
    roots,
    self_attr,
)

LAYOUT_SENSITIVE = frozenset({"view", "view_as", "view_as_complex", "as_strided"})
"""Ops whose outcome depends on the strides or storage offset of their input: a `view` that
merges the split dimension with another raises on a strided piece, `view(dtype)` and
`view_as_complex` check the offset and strides, `as_strided` reads the storage as told."""

_CONDITIONAL_PARTS = (
    ast.IfExp,
    ast.BoolOp,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.Await,
    ast.Yield,
    ast.YieldFrom,
)
"""Expressions some of whose parts run only on some paths (or later, or never)."""

_SIMPLE = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return, ast.Pass)
"""Statements that run their expressions once, in order, when reached."""


@dataclass(frozen=True)
class Reach:
    """Which parameters of a Python function may reach a layout-sensitive use."""

    anywhere: frozenset[str]
    """On some path through the function."""
    unreplayed: frozenset[str]
    """On a path a trace through a straight call of it may not have taken (not straight in
    the callee, or further down a call it makes)."""


def _walk_own(node: ast.AST) -> list[ast.AST]:
    """`node` and its descendants, nested function and class bodies left out."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        found.append(current)
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stack.append(child)
    return found


def _branches_inside(stmt: ast.stmt) -> bool:
    """Does `stmt` hold an expression that runs only on some paths?"""
    return any(
        isinstance(node, _CONDITIONAL_PARTS)
        or (isinstance(node, ast.Compare) and len(node.ops) > 1)
        or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for node in ast.walk(stmt)
    )


def straight_statements(funcdef: ast.FunctionDef | ast.AsyncFunctionDef) -> set[int]:
    """The ids of the top-level statements of `funcdef` that every call reaching its end by
    falling through or by a top-level `return` ran, wholly: simple statements
    (`_SIMPLE`) with no conditional part (`_branches_inside`) before which no top-level
    statement may return or yield. A trace that reached the output ran them, so the replay
    saw what they did."""
    straight: set[int] = set()
    for stmt in funcdef.body:
        if isinstance(stmt, _SIMPLE) and not _branches_inside(stmt):
            straight.add(id(stmt))
        if any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom)) for n in _walk_own(stmt)):
            break
    return straight


def _closure(names: set[str], pairs: list[tuple[set[str], set[str]]]) -> set[str]:
    """`names` and every name whose value may flow into one of them, to a fixed point."""
    found = set(names)
    changed = True
    while changed:
        changed = False
        for stores, reads in pairs:
            if stores & found and not reads <= found:
                found |= reads
                changed = True
    return found


def _is_custom_kernel(func: ast.expr) -> bool:
    """Is `func` spelled `torch.ops.<namespace>.<op>`: a registered kernel, which may
    require its inputs contiguous?"""
    chain = []
    node = func
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return "ops" in chain


def _site_names(
    call: ast.Call, scope: Scope, replayed: bool, memo: dict[Any, Reach | None]
) -> set[str]:
    """The names whose layout `call` may depend on where the replay did not check it:
    nothing at a `replayed` site except what the callee's own unreplayed paths do; at any
    other, the operands of a layout-sensitive op, of a `torch.ops` kernel, of a callee that
    cannot be read, and of a read callee's parameters that reach such a use (`Reach`)."""
    func = call.func
    every = set().union(*(roots(argument, scope) for argument in call_arguments(call)))
    unknown = every | roots(func, scope)  # receiver included: `q.view(...)`
    if trusted_call(call, scope):
        return set()  # attention interfaces and cache updates take strided inputs
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name in LAYOUT_SENSITIVE:
        return set() if replayed else unknown
    if namespace_of(func, scope) is not None:
        # `torch.*`/`F.*` functions take any strides (those that do not are named above);
        # a registered kernel may not, and its meta kernel may not say so.
        return unknown if _is_custom_kernel(func) and not replayed else set()
    if is_tensor_method(func, scope) or is_builtin(call, scope, NON_WRITING_BUILTINS):
        return set()
    resolution = self_attr(func, scope)
    if resolution is not None and resolution.raises_when_called:
        return set()
    if (
        isinstance(func, ast.Attribute)
        and func.attr in CONTAINER_METHODS
        and not is_self_call(func)
        and is_box(func.value, scope)
    ):
        return set()  # `kwargs.pop(...)`, `box.append(q)`: holds, never lays out
    resolved = resolve_callee(call, scope)
    if resolved is None:
        return unknown
    fn, module, bound = resolved
    if fn is no_writes:
        return set()  # an `nn.Linear`, a norm, a lookup: any strides
    reach = _reach(fn, module, scope, memo)
    binding = None
    if reach is not None and not arguments_foreign(call, scope):
        binding = bind_arguments(call, fn, bound, scope)
    if reach is None or binding is None:
        return unknown
    params = reach.unreplayed if replayed else reach.anywhere
    return set().union(*(binding.get(param, set()) for param in params))


def _sensitive_names(scope: Scope, memo: dict[Any, Reach | None]) -> tuple[set[str], set[str]]:
    """(names that may reach a layout-sensitive use on some path, names that may reach one
    the replay did not see): a call is replayed when its statement is straight
    (`straight_statements`) and no name its value depends on is bound anywhere else."""
    funcdef = scope.funcdef
    pairs = binding_pairs(scope)
    straight = straight_statements(funcdef)
    branch_bound: set[str] = set()
    for stmt in funcdef.body:
        if id(stmt) not in straight:
            for stores, _ in binding_pairs(scope, stmt):
                branch_bound |= stores
    anywhere: set[str] = set()
    unreplayed: set[str] = set()
    for stmt in funcdef.body:
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            anywhere |= _site_names(node, scope, False, memo)
            replayed = id(stmt) in straight and not (
                _closure(names_read(node), pairs) & branch_bound
            )
            unreplayed |= _site_names(node, scope, replayed, memo)
    return anywhere, unreplayed


def _reach(
    fn: Any, module: nn.Module | None, caller: Scope, memo: dict[Any, Reach | None]
) -> Reach | None:
    """The `Reach` of calling the Python function `fn` (with `self` = `module`); None
    (unknown: every argument reaches) when its write summary is opaque (no source, a
    closure, a generator, a frame or `exec`), the chain is deeper than MAX_CALL_DEPTH, or
    the call is recursive."""
    key = (fn, id(module))
    if key in memo:
        return memo[key]
    if caller.depth >= MAX_CALL_DEPTH or caller.summary(fn, module).opaque:
        return None
    funcdef = read_function(fn)
    if funcdef is None:
        return None
    memo[key] = None  # a recursive call is not read twice: unknown until done
    scope = Scope(funcdef, module, fn.__globals__, caller.depth + 1, caller.memo, summarise)
    anywhere, unreplayed = _sensitive_names(scope, memo)
    arguments = funcdef.args
    params = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    params += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    held = {param: holders_of(scope, param) for param in params}
    reach = Reach(
        anywhere=frozenset(p for p in params if held[p] & anywhere),
        unreplayed=frozenset(p for p in params if held[p] & unreplayed),
    )
    memo[key] = reach
    return reach


def unreplayed_layout_pieces(
    funcdef: ast.FunctionDef,
    temps: Sequence[str],
    module: nn.Module | None = None,
    namespace: dict[str, Any] | None = None,
) -> tuple[bool, ...]:
    """For each split temporary of a rewritten forward: may its piece, or anything holding
    or viewing it, meet a layout-sensitive use on a path the trace did not replay (see the
    module docstring)? Such a piece must be a copy of its own: then every use, on every
    path, sees what it saw on the projection's output. `module` and `namespace` (the
    forward's globals) let the calls it makes be read. All True where the source cannot be
    taken apart (fail closed)."""
    try:
        scope = Scope(funcdef, module, namespace or {}, 0, {}, summarise)
        _, unreplayed = _sensitive_names(scope, {})
        return tuple(bool(holders_of(scope, temp) & unreplayed) for temp in temps)
    except (RecursionError, ValueError, TypeError, AttributeError):
        return (True,) * len(temps)

"""Calls that provably write nothing, read from their source, for the input-stability proof.

`fusion.alias` presumes that a call it cannot read (a q/k norm of the model's own class, a
method, a module-level helper) writes every name its arguments and receiver may alias, and
everything reachable from `self`. Between two sibling projections that presumption alone
refuses most merges of DeepSeek-style and normed attention. Here the callee's source is
read instead: it writes nothing when no statement of it stores into anything (no attribute
or item store or `del`, no augmented assignment, no in-place spelling, no `global`, nothing
that reaches locals by name) and every call it makes is known pure or itself proven, to
`MAX_DEPTH`. Anything else (no source, a closure, hooks, a call path of its own, a nested
function, a callee that cannot be resolved) is presumed to write, as before.

A proven call is shown to the alias analysis as a pure stand-in, `torch.<STAND_IN>(callee,
*arguments)`, whose value may alias the callee and every argument: aliasing through its
return value (a view of its input, state it hands back) stays tracked; only the presumed
write is gone. The analysis runs on a copy; the forward that is compiled keeps its calls.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusion import alias, source
from fusion.callpath import has_hooks, own_call_path
from fusion.errors import RewriteRefused

MAX_DEPTH = 3
"""Deepest chain of callees read (a norm calling its `_norm` method calling a helper)."""

STAND_IN = "__fusion_pure_call__"
"""The attribute of `torch` a proven call is replaced by in the analysed copy (no such
function exists: the copy is never compiled)."""

NAMESPACES: dict[str, object] = {"torch": torch, "F": F, "nn": nn, "math": math}
"""Namespaces a callee may call through, and the module each name must be bound to in the
callee's globals (a callee whose `F` is something else proves nothing)."""

CONTAINER_MUTATORS = frozenset(
    {"add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove"}
    | {"reverse", "setdefault", "sort", "update"}
)
"""Methods that write a list, dict or set in place; some share a name with a pure tensor
method (`sort`, `add`), so they count as writes unless the receiver is a known tensor."""

_BARRED = (
    ast.Global,
    ast.Nonlocal,
    ast.Import,
    ast.ImportFrom,
    ast.AugAssign,
    ast.Delete,
    ast.Yield,
    ast.YieldFrom,
    ast.Await,
    ast.Lambda,
    ast.FunctionDef,
    ast.ClassDef,
    ast.AsyncFunctionDef,
    ast.AsyncWith,
    ast.AsyncFor,
)


def module_writes_nothing(child: object, depth: int = 0) -> bool:
    """True when calling `child` (an `nn.Module`) provably writes nothing: no hooks, the
    plain `nn.Module` call path, no instance-level forward, and a forward whose source
    writes nothing (`function_writes_nothing`, reading `self.<x>` on this instance)."""
    if not isinstance(child, nn.Module) or depth > MAX_DEPTH:
        return False
    if has_hooks(child) or own_call_path(child) or "forward" in child.__dict__:
        return False
    if type(child) in alias.SAFE_CHILD_TYPES and not getattr(child, "inplace", False):
        return True
    return function_writes_nothing(type(child).forward, child, depth)


def function_writes_nothing(fn: Callable, owner: nn.Module | None, depth: int = 0) -> bool:
    """True when running the plain Python function `fn` (with `self` = `owner`, if given)
    provably writes nothing reachable from its caller; False whenever that is not shown
    (a decorated function among them: its wrapper is code the source does not show)."""
    if inspect.unwrap(fn) is not fn:
        return False  # a wrapper runs code of its own around what the source shows
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars or depth > MAX_DEPTH:
        return False
    try:
        funcdef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(funcdef, ast.FunctionDef):
        return False
    local = alias.local_names(funcdef) - {"self"}
    scope = _Scope(owner, fn.__globals__, local, depth)
    body = [*funcdef.body, *funcdef.args.defaults, *filter(None, funcdef.args.kw_defaults)]
    return all(_node_writes_nothing(node, scope) for stmt in body for node in ast.walk(stmt))


@dataclass
class _Scope:
    """What a callee's names resolve to: its owner (`self`), globals and locals; its depth."""

    owner: nn.Module | None
    globals: dict[str, Any]
    local: set[str]
    depth: int

    def resolve(self, name: str) -> object:
        """The object `name` is bound to in the callee (None for its own locals)."""
        if name in self.local:
            return None
        if name in self.globals:
            return self.globals[name]
        return getattr(builtins, name, None)


def _node_writes_nothing(node: ast.AST, scope: _Scope) -> bool:
    if isinstance(node, _BARRED):
        return False
    if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(
        node.ctx, (ast.Store, ast.Del)
    ):
        return False
    if isinstance(node, ast.Name) and node.id in alias.OPAQUE_BUILTINS:
        return False
    if (
        isinstance(node, ast.Attribute)
        and (node.attr in alias.OPAQUE_BUILTINS or node.attr in alias.FRAME_ATTRS)
        and not _in_namespace(node, scope)  # `torch.stack` is not `inspect.stack`
    ):
        return False
    if isinstance(node, ast.With):
        # `__enter__`/`__exit__` run on the manager: only torch's own (autocast, no_grad).
        return all(_namespace_call(item.context_expr, scope) for item in node.items)
    if isinstance(node, ast.Call):
        return _call_writes_nothing(node, scope)
    return True


def _in_namespace(node: ast.Attribute, scope: _Scope) -> bool:
    """Is `node` an attribute of `torch`/`F`/`nn`/`math` as the callee's globals bind them?"""
    value = node.value
    return (
        isinstance(value, ast.Name)
        and value.id in NAMESPACES
        and scope.resolve(value.id) is NAMESPACES[value.id]
    )


def _namespace_call(expr: ast.expr, scope: _Scope) -> bool:
    """Is `expr` a call through `torch`/`F`/`nn`/`math` as the callee's globals bind them,
    outside the namespaces whose functions may write (`torch.distributed`, custom ops)?"""
    if not isinstance(expr, ast.Call) or alias.writes_through_args(expr):
        return False
    chain = alias.func_chain(expr.func)
    node = alias.chain_root(expr.func)
    if not (isinstance(node, ast.Name) and chain and node.id in NAMESPACES):
        return False
    if scope.resolve(node.id) is not NAMESPACES[node.id]:
        return False
    return chain[0] not in alias.IMPURE_TORCH_NAMESPACES


def _call_writes_nothing(call: ast.Call, scope: _Scope) -> bool:
    if alias.writes_through_args(call):
        return False
    func = call.func
    if isinstance(func, ast.Name):
        if any(keyword.arg == "key" for keyword in call.keywords):
            return False  # `min(xs, key=f)` calls `f`
        target = scope.resolve(func.id)
        if func.id in alias.PURE_BUILTINS and target is getattr(builtins, func.id, None):
            return True
        return inspect.isfunction(target) and function_writes_nothing(target, None, scope.depth + 1)
    if not isinstance(func, ast.Attribute):
        return False
    if _namespace_call(call, scope):
        return True
    receiver = func.value
    if isinstance(receiver, ast.Name) and receiver.id == "self" and scope.owner is not None:
        return _self_call_writes_nothing(scope.owner, func.attr, scope.depth + 1)
    if not hasattr(torch.Tensor, func.attr) or func.attr in {"data", "register_hook"}:
        return False
    if func.attr in CONTAINER_MUTATORS:
        return isinstance(_self_value(receiver, scope), torch.Tensor)
    if isinstance(receiver, ast.Name) and receiver.id not in scope.local:
        return False  # a method of a global object, not of a tensor the callee computed
    root = receiver
    while isinstance(root, (ast.Attribute, ast.Subscript)):
        root = root.value
    if isinstance(root, ast.Name) and root.id == "self":
        return isinstance(_self_value(receiver, scope), torch.Tensor)
    return True


def _self_value(expr: ast.expr, scope: _Scope) -> object:
    """The value of a `self.a.b` chain on the owner, or None when it is not one."""
    names: list[str] = []
    while isinstance(expr, ast.Attribute):
        names.insert(0, expr.attr)
        expr = expr.value
    if not (isinstance(expr, ast.Name) and expr.id == "self" and scope.owner is not None):
        return None
    value: object = scope.owner
    for name in names:
        value = getattr(value, name, None)
    return value


def _self_call_writes_nothing(owner: nn.Module, name: str, depth: int) -> bool:
    """Does `owner.<name>(...)` provably write nothing: a child module proven so, or a
    method of the class (not of the instance) proven so on `owner`?"""
    if name in owner.__dict__:
        return False  # an instance-level callable: another instance may differ
    child = dict(owner.named_children()).get(name)
    if child is not None:
        return module_writes_nothing(child, depth)
    method = inspect.getattr_static(type(owner), name, None)
    return inspect.isfunction(method) and function_writes_nothing(method, owner, depth)


def self_call_writes_nothing(module: nn.Module, name: str) -> bool:
    """Does calling `module.<name>(...)` (a child or a method) provably write nothing?"""
    return _self_call_writes_nothing(module, name, 0)


def stand_in_pure_calls(
    funcdef: ast.FunctionDef, module: nn.Module, globals_: dict[str, Any]
) -> tuple[ast.FunctionDef, dict[int, ast.AST], tuple[str, ...]]:
    """A copy of `funcdef` in which every call proven to write nothing (`self.<child>(...)`,
    `self.<method>(...)`, a module-level function) is the pure stand-in, a map from each
    original node's id to its twin in the copy, and the `self.<name>`s the proof relied on
    (per instance: the fuser proves them again on every instance it fuses)."""
    twin_def = copy.deepcopy(funcdef)
    twins = {id(a): b for a, b in zip(ast.walk(funcdef), ast.walk(twin_def))}
    relied: list[str] = []
    local = alias.local_names(funcdef)
    for call in [n for n in ast.walk(twin_def) if isinstance(n, ast.Call)]:
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id != "self" or type(getattr(module, func.attr, None)) in (
                alias.SAFE_CHILD_TYPES
            ):
                continue  # not a call of `self`'s, or one the analysis reads already
            if not self_call_writes_nothing(module, func.attr):
                continue
            relied.append(func.attr)
        elif not (
            isinstance(func, ast.Name)
            and func.id not in local
            and inspect.isfunction(globals_.get(func.id))
            and function_writes_nothing(globals_[func.id], None, 1)
        ):
            continue
        if alias.writes_through_args(call):
            continue
        arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
        stand_in = ast.Call(
            func=ast.Attribute(
                value=ast.Name(id="torch", ctx=ast.Load()), attr=STAND_IN, ctx=ast.Load()
            ),
            args=[func, *arguments],
            keywords=[],
        )
        source.replace_expr(twin_def, call, stand_in)
    return twin_def, twins, tuple(dict.fromkeys(relied))


def check_input_stable_reading_calls(
    funcdef: ast.FunctionDef,
    module: nn.Module,
    globals_: dict[str, Any],
    input_expr: ast.expr,
    region: list[ast.stmt],
) -> tuple[str, ...]:
    """`alias.check_input_stable`, and where it refuses, the same proof again with every
    call it could not read but whose callee provably writes nothing shown as a pure call
    (`stand_in_pure_calls`). Returns the `self.<name>`s the second proof relied on (empty
    when the first sufficed); refuses with the second proof's reason when both fail."""
    try:
        alias.check_input_stable(funcdef, module, input_expr, region)
        return ()
    except RewriteRefused:
        pass
    twin_def, twins, relied = stand_in_pure_calls(funcdef, module, globals_)
    twin_region = [twins[id(stmt)] for stmt in region]
    alias.check_input_stable(twin_def, module, twins[id(input_expr)], twin_region)
    return relied

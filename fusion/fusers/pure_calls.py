"""Calls that provably write nothing, read from their source, for the input-stability proof.

`fusion.analysis.alias` presumes that a call it cannot read (a q/k norm of the model's own class, a
method, a module-level helper) writes every name its arguments and receiver may alias, and
everything reachable from `self`. Between two sibling projections that presumption alone
refuses most merges of DeepSeek-style and normed attention. Here the callee's source is
read instead: it writes nothing when no statement of it stores into anything (no attribute
or item store or `del`, no augmented assignment, no in-place spelling, no `global`, nothing
that reaches locals by name) and every call it makes is known pure or itself proven, to
`MAX_DEPTH`. Anything else (no source, a closure, hooks, a call path of its own, a nested
function, a callee that cannot be resolved) is presumed to write, as before. A write needs
no in-place spelling to count: calls of torch functions that write what they are given
(`call_effects.namespace_call_writes`: `nn.init.constant`, `F.embedding(max_norm=)`), a numpy view
made anywhere (`x.numpy()`: its `put` and `sort` write), and a tensor-named method of a
module (`m.float()`) all fail the proof. `self.<name>` is what Python resolves it to
(`fusion.analysis.name_resolution`: a method on the class wins over a child of the same name), and
nothing of `self` is known in a method that rebinds it.

A proven call is shown to the alias analysis as a pure stand-in, `torch.<STAND_IN>(callee,
*arguments)`, whose value may alias the callee and every argument: aliasing through its
return value (a view of its input, state it hands back) stays tracked; only the presumed
write is gone (and only while no argument may be something no tensor, which the proof
presumed its parameters are). The analysis runs on a copy; the forward that is compiled
keeps its calls.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusion.analysis import alias, alias_terms, call_effects, source
from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.name_resolution import (
    Kind,
    resolve,
    resolve_chain,
    self_chain,
    self_is_bound_to_owner,
)
from fusion.errors import RewriteRefused

MAX_DEPTH = 3
"""Deepest chain of callees read (a norm calling its `_norm` method calling a helper)."""

STAND_IN = alias_terms.STAND_IN
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
    plain `nn.Module` call path, no instance-level forward, and either a torch layer that
    `alias_terms.is_safe_child` (an `nn.Embedding` with `max_norm` is not: it renormalises its own
    weight) or a forward whose source writes nothing (`function_writes_nothing`, reading
    `self.<x>` on this instance)."""
    if not isinstance(child, nn.Module) or depth > MAX_DEPTH:
        return False
    if has_hooks(child) or own_call_path(child) or "forward" in child.__dict__:
        return False
    if alias_terms.is_safe_child(child):
        return True
    return function_writes_nothing(type(child).forward, child, depth)


def function_writes_nothing(fn: Callable, owner: nn.Module | None, depth: int = 0) -> bool:
    """True when running the plain Python function `fn` (with `self` = `owner`, if given)
    provably writes nothing reachable from its caller; False whenever that is not shown
    (a decorated function among them: its wrapper is code the source does not show).

    Its parameters are presumed tensors or plain values (the alias analysis trusts a proven
    call only where no argument is `call_effects.may_be_foreign`), and so is what it returns: a
    function that may return a module or a numpy view (`_shares_foreign`) proves nothing,
    nor one that calls a tensor-named method on such a value (`arr.put(0, v)`, `m.float()`).
    `self.<name>` is read on `owner` only while `self` is its first parameter and never
    rebound (`name_resolution.self_is_bound_to_owner`); otherwise `self` is one more local
    (and may be any object)."""
    funcdef = None if depth > MAX_DEPTH else source.plain_function_def(fn)
    if funcdef is None:
        return False
    rebound = owner is not None and not self_is_bound_to_owner(funcdef)
    if rebound:
        owner = None  # `self = self.other`, or `self` is not the receiver: resolve nothing
    local = alias_terms.local_names(funcdef) - ({"self"} if owner is not None else set())
    scope = _Scope(owner, fn.__globals__, local, depth, {"self"} if rebound else set())
    scope.foreign |= _foreign_locals(funcdef, scope)
    body = [*funcdef.body, *funcdef.args.defaults, *filter(None, funcdef.args.kw_defaults)]
    if any(
        isinstance(node, ast.Return)
        and node.value is not None
        and _shares_foreign(node.value, scope)
        for node in ast.walk(funcdef)
    ):
        return False  # its caller would take what it returns for a tensor
    return all(_node_writes_nothing(node, scope) for stmt in body for node in ast.walk(stmt))


def _is_foreign_object(value: object) -> bool:
    """Is `value` something no tensor whose methods named like tensor methods may write:
    a module (`m.float()` casts its parameters in place) or an object sharing memory through
    the array or DLPack protocols (a numpy array: `arr.put(0, v)`, `arr.sort()`)?"""
    if isinstance(value, torch.Tensor):
        return False
    return (
        isinstance(value, (nn.Module, memoryview))
        or hasattr(value, "__array_interface__")
        or hasattr(value, "__dlpack__")
    )


def _shares_foreign(expr: ast.AST, scope: _Scope) -> bool:
    """May the value of `expr` be, hold or view a foreign object (`_is_foreign_object`): a
    local in `scope.foreign`, a `self.<chain>` or global that is one (or that cannot be
    resolved without running code), or a display, ternary, subscript or call of a function
    of ours that may pass one on? Arithmetic, comparisons and tensor or torch calls make new
    values; a method of a foreign object is refused where it is called."""
    chain = self_chain(expr)  # type: ignore[arg-type]
    if chain is not None and scope.owner is not None:
        resolved = resolve_chain(scope.owner, chain)
        if resolved.kind is Kind.UNKNOWN:
            return True  # a property, an ambiguous name: code decides what it is
        # An attribute of a config object (`self.config.eps`) is taken for a setting.
        return _is_foreign_object(resolved.value)
    if isinstance(expr, ast.Name):
        if expr.id in scope.foreign:
            return True
        return expr.id not in scope.local and _is_foreign_object(scope.resolve(expr.id))
    if isinstance(expr, ast.Attribute):
        return expr.attr in alias_terms.FOREIGN_VIEWS or _shares_foreign(expr.value, scope)
    if isinstance(expr, (ast.Subscript, ast.Starred, ast.NamedExpr)):
        return _shares_foreign(expr.value, scope)
    if isinstance(expr, ast.Call):
        func = expr.func
        calls_ours = isinstance(func, ast.Name) or (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
        )
        arguments = [*expr.args, *(keyword.value for keyword in expr.keywords)]
        return calls_ours and any(_shares_foreign(argument, scope) for argument in arguments)
    if isinstance(expr, ast.BinOp):
        sequences = (ast.Tuple, ast.List)  # `[a] + rest`, `(a,) * 2` hold `a`
        if isinstance(expr.left, sequences) or isinstance(expr.right, sequences):
            return _shares_foreign(expr.left, scope) or _shares_foreign(expr.right, scope)
        return False
    if isinstance(expr, (ast.Constant, ast.UnaryOp, ast.Compare, ast.JoinedStr)):
        return False
    return any(_shares_foreign(child, scope) for child in ast.iter_child_nodes(expr))


def _foreign_locals(funcdef: ast.FunctionDef, scope: _Scope) -> set[str]:
    """Locals that may hold a foreign object (`_shares_foreign`), to a fixed point over
    every binding form (flow-insensitive: bound to one anywhere, foreign everywhere)."""
    pairs: list[tuple[set[str], ast.AST]] = []
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Assign):
            pairs += [(alias_terms.store_names(target), node.value) for target in node.targets]
        elif isinstance(node, ast.NamedExpr) or (
            isinstance(node, ast.AnnAssign) and node.value is not None
        ):
            pairs.append((alias_terms.store_names(node.target), node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            pairs.append((alias_terms.store_names(node.target), node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((alias_terms.store_names(node.optional_vars), node.context_expr))
        elif isinstance(node, ast.Match):
            pairs += [
                (alias_terms.match_captures(case.pattern), node.subject) for case in node.cases
            ]
    foreign = set(scope.foreign)
    changed = True
    while changed:
        changed = False
        for stores, value in pairs:
            if not stores <= foreign and _shares_foreign(value, scope):
                foreign |= stores
                scope.foreign |= stores
                changed = True
    return foreign


@dataclass
class _Scope:
    """What a callee's names resolve to: its owner (`self`), globals and locals; its depth;
    its locals that may hold no tensor."""

    owner: nn.Module | None
    globals: dict[str, Any]
    local: set[str]
    depth: int
    foreign: set[str]
    """Locals that may hold something no tensor (`_foreign_locals`): a module, a numpy view."""

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
    if isinstance(node, ast.Name) and node.id in alias_terms.OPAQUE_BUILTINS:
        return False
    if (
        isinstance(node, ast.Attribute)
        and (node.attr in alias_terms.OPAQUE_BUILTINS or node.attr in alias_terms.FRAME_ATTRS)
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
    of a function that writes no argument however spelled (not `call_effects.namespace_call_writes`:
    `torch.distributed`, custom ops, `nn.init.constant`, `F.embedding(..., max_norm=m)`),
    and no `alias_terms.FOREIGN_VIEWS` method (`torch.Tensor.numpy(x)`)?"""
    if not isinstance(expr, ast.Call) or call_effects.writes_through_args(expr):
        return False
    chain = alias_terms.func_chain(expr.func)
    node = alias_terms.chain_root(expr.func)
    if not (isinstance(node, ast.Name) and chain and node.id in NAMESPACES):
        return False
    if scope.resolve(node.id) is not NAMESPACES[node.id]:
        return False
    if chain[0] in alias_terms.IMPURE_TORCH_NAMESPACES or chain[-1] in alias_terms.FOREIGN_VIEWS:
        return False
    return not call_effects.namespace_call_writes(expr)


def _call_writes_nothing(call: ast.Call, scope: _Scope) -> bool:
    if call_effects.writes_through_args(call):
        return False
    func = call.func
    if isinstance(func, ast.Name):
        if any(keyword.arg == "key" for keyword in call.keywords):
            return False  # `min(xs, key=f)` calls `f`
        target = scope.resolve(func.id)
        if func.id in alias_terms.PURE_BUILTINS and target is getattr(builtins, func.id, None):
            return True
        return inspect.isfunction(target) and function_writes_nothing(target, None, scope.depth + 1)
    if not isinstance(func, ast.Attribute):
        return False
    if _namespace_call(call, scope):
        return True
    receiver = func.value
    if isinstance(receiver, ast.Name) and receiver.id == "self" and scope.owner is not None:
        return _self_call_writes_nothing(scope.owner, func.attr, scope.depth + 1)
    if not hasattr(torch.Tensor, func.attr) or func.attr in alias_terms.NOT_PURE_TENSOR_METHODS:
        return False
    if func.attr in alias_terms.FOREIGN_VIEWS:
        # `x.numpy()` writes nothing itself, but hands back an array whose tensor-named
        # methods write (`put`, `sort`): a callee that makes one proves nothing.
        return False
    if func.attr in CONTAINER_MUTATORS:
        return isinstance(_self_value(receiver, scope), torch.Tensor)
    if isinstance(receiver, ast.Name) and receiver.id not in scope.local:
        return False  # a method of a global object, not of a tensor the callee computed
    if _shares_foreign(receiver, scope):
        return False  # `arr.put(0, v)` on a numpy view, `m.float()` on a module
    root = receiver
    while isinstance(root, (ast.Attribute, ast.Subscript)):
        root = root.value
    if isinstance(root, ast.Name) and root.id == "self":
        return isinstance(_self_value(receiver, scope), torch.Tensor)
    return True


def _self_value(expr: ast.expr, scope: _Scope) -> object:
    """The tensor a `self.a.b` chain is on the owner (resolved as Python resolves it:
    `fusion.analysis.name_resolution`), or None when it is not such a chain or not a tensor."""
    names = self_chain(expr)
    if names is None or scope.owner is None:
        return None
    return resolve_chain(scope.owner, names).tensor


def _self_call_writes_nothing(owner: nn.Module, name: str, depth: int) -> bool:
    """Does `owner.<name>(...)` provably write nothing: a child module proven so, or a
    method of the class proven so on `owner` (a static one with no `self`)? `name` is
    resolved as Python resolves it (`fusion.analysis.name_resolution.resolve`): a method on the class
    beside a child of the same name is the method, and such an ambiguous name, an
    instance-level callable (another instance may differ) or a property proves nothing.
    A name that raises when called (absent, or None) writes nothing: nothing after it runs."""
    resolved = resolve(owner, name)
    if resolved.raises_when_called:
        return True
    if resolved.kind is Kind.CHILD:
        return module_writes_nothing(resolved.value, depth)
    if resolved.kind is Kind.METHOD:
        return function_writes_nothing(resolved.value, owner, depth)
    if resolved.kind is Kind.STATIC:
        return function_writes_nothing(resolved.value, None, depth)
    return False


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
    local = alias_terms.local_names(funcdef)
    owner = module if self_is_bound_to_owner(funcdef) else None
    for call in [n for n in ast.walk(twin_def) if isinstance(n, ast.Call)]:
        func = call.func
        arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id != "self" or owner is None:
                continue  # not a call of `self`'s (or `self` is rebound: whose, unknown)
            if alias_terms.is_safe_child(resolve(owner, func.attr).child):
                continue  # one the analysis reads already
            if not self_call_writes_nothing(owner, func.attr):
                continue
            relied.append(func.attr)
        elif not (
            isinstance(func, ast.Name)
            and func.id not in local
            and inspect.isfunction(globals_.get(func.id))
            and function_writes_nothing(globals_[func.id], None, 1)
        ):
            continue
        if call_effects.writes_through_args(call):
            continue
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
    (`stand_in_pure_calls`); refuses with the second proof's reason when both fail.

    Returns the `self.<name>`s either proof may have taken for calls that write nothing:
    those the second proof stood in, and every `self.<name>(...)` in the region that writes
    nothing on this instance (a safe child such as an `nn.Embedding` without `max_norm`, a
    name that raises when called). The proof is made once per class; another instance of
    it may hold, under the same name, a child that writes (an embedding with `max_norm`), so
    the fuser proves each of these again on every instance (`self_call_writes_nothing`)."""
    trusted = _trusted_self_calls(funcdef, module, region)
    try:
        alias.check_input_stable(funcdef, module, input_expr, region)
        return trusted
    except RewriteRefused:
        pass
    twin_def, twins, relied = stand_in_pure_calls(funcdef, module, globals_)
    twin_region = [twins[id(stmt)] for stmt in region]
    alias.check_input_stable(twin_def, module, twins[id(input_expr)], twin_region)
    return tuple(dict.fromkeys((*relied, *trusted)))


def _trusted_self_calls(
    funcdef: ast.FunctionDef, module: nn.Module, region: list[ast.stmt]
) -> tuple[str, ...]:
    """The `self.<name>`s called in `region` that write nothing on `module` (so a proof may
    have trusted them); none when the forward rebinds `self` (then none were trusted)."""
    if not self_is_bound_to_owner(funcdef):
        return ()
    names = [
        node.func.attr
        for stmt in region
        for node in ast.walk(stmt)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    ]
    return tuple(name for name in dict.fromkeys(names) if self_call_writes_nothing(module, name))

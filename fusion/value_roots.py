"""What an expression's value may hold: the names (roots) whose storage it may share.

The first half of the source write analysis (`fusion.piece_writes` is the second): a
function under analysis is a `Scope`; `roots(expr, scope)` is every local or parameter
whose value (a view of it, or a container or object holding it) the value of `expr` may
hold. It is flow-insensitive and fails closed: an expression form not known to yield new
storage aliases whatever it reads, and a call whose callee cannot be read
(`resolve_callee`, `bind_arguments`, `Scope.summary`) may return any of its arguments.
Calls of plain Python functions, of `self`'s methods and of `self`'s children are read
(to MAX_CALL_DEPTH) instead of presumed, so `apply_rotary_pos_emb(q, k, cos, sin)` or a q/k
norm does not make every piece alias every other.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion import alias
from fusion.callpath import has_hooks, own_call_path
from fusion.pieces import VIEW_OPS
from fusion.tensor_meta import METADATA_ATTRS, METADATA_METHODS
from fusion.trace import CACHE_ARGUMENTS

MAY_RETURN_INPUT = frozenset(
    {
        "cpu",
        "cuda",
        "positive",
        "conj",
        "resolve_conj",
        "resolve_neg",
        "atleast_1d",
        "atleast_2d",
        "atleast_3d",
        "broadcast_to",
        "broadcast_tensors",
        "ravel",
        "align_as",
        "align_to",
        "rename",
        "refine_names",
        "coalesce",
        "to_dense",
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "einsum",
        "sum_to_size",
        "bool",
        "int",
        "long",
        "short",
        "char",
        "byte",
        "cfloat",
        "cdouble",
        "hsplit",
        "vsplit",
        "dsplit",
        "adjoint",
        "values",
        "indices",
        "as_subclass",
        "data",
        "get",
        "pop",
        "setdefault",
        "items",
        "copy",
        "__getitem__",
        "getitem",
        "itemgetter",
    }
)
"""Calls besides `VIEW_OPS` and in-place ones that may hand back their receiver or first
argument, or a view or element of it: a no-op cast or move (`x.cpu()` on a CPU tensor,
`x.bool()` on a bool one), dropout outside training, an einsum that only permutes, container
accessors."""

RESULT_MAY_HOLD_ARGUMENT = frozenset({"tuple", "min", "max", "abs", "sum", "zip", "enumerate"})
"""Builtins in `alias.PURE_BUILTINS` (they write no argument) whose result may still hold
one: `min(a, b)` is `a` or `b`, `tuple(xs)` holds the items."""

PURE_NAME_BUILTINS = (alias.PURE_BUILTINS - RESULT_MAY_HOLD_ARGUMENT) | frozenset(
    {"print", "repr", "id", "hash", "callable"}
)
"""Builtins whose result holds no tensor storage and that neither write nor keep an argument."""

FRESH_CHILD_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding)
"""Children (exact types) whose call returns a new tensor, never their input or a view of it
(`nn.Dropout` and `nn.Identity` may return their input)."""

NON_WRITING_BUILTINS = PURE_NAME_BUILTINS | frozenset(
    {"list", "tuple", "dict", "set", "frozenset", "zip", "enumerate", "reversed", "iter"}
    | {"next", "super", "getattr", "sum", "min", "max", "sorted"}
)
"""Builtins that write no argument, though their result may hold one (`tuple(xs)`,
`min(a, b)`). With a `key=` callback they call other code, and count as unknown."""

MAX_CALL_DEPTH = 4
"""How deep `written_pieces` reads calls of Python functions; deeper calls count as writes."""


@dataclass(frozen=True)
class Summary:
    """What a call of one Python function may do to its parameters."""

    writes: frozenset[str] = frozenset()
    """Parameters it may write through (directly or by passing them on)."""
    joins: tuple[frozenset[str], ...] = ()
    """Groups of parameters it may make hold one another (`box.append(t)`)."""
    returns: frozenset[str] = frozenset()
    """Parameters its result may hold (a view of, or a container with, their value)."""
    opaque: bool = False
    """Unreadable: it may write and return every argument and make them hold one another."""


OPAQUE = Summary(opaque=True)
PURE = Summary()


def names_read(node: ast.AST | None) -> set[str]:
    """Every name `node` reads: the fail-closed roots of an expression not understood."""
    if node is None:
        return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


class Scope:
    """One function under analysis: its AST, the module `self` is (None for a plain
    function), the globals its names resolve in, its depth in the call chain, a memo of
    callee summaries shared by the whole analysis, so each callee is read once, and the
    summariser that reads a callee (`fusion.piece_writes`: roots of a call's result depend
    on what the callee returns, which only the write analysis reads)."""

    def __init__(
        self,
        funcdef: ast.FunctionDef | ast.AsyncFunctionDef,
        module: nn.Module | None,
        namespace: dict[str, Any],
        depth: int,
        memo: dict[Any, Summary],
        summarise: Callable[[Any, nn.Module | None, Scope], Summary],
    ) -> None:
        self.summarise = summarise
        self.funcdef = funcdef
        self.module = module
        self.namespace = namespace
        self.depth = depth
        self.memo = memo
        self.locals = alias.local_names(funcdef)  # type: ignore[arg-type]
        self.local_values: dict[str, list[ast.expr]] = {}
        for node in ast.walk(funcdef):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    self.local_values.setdefault(target.id, []).append(value)
        self.effects: dict[int, tuple[set[str], list[set[str]]]] = {}

    def summary(self, fn: Any, module: nn.Module | None) -> Summary:
        """What calling `fn` (with `self` = `module`) may do to its parameters: the
        summariser this scope was made with, so a callee is read by the same (write)
        analysis as its caller and the memo is shared."""
        return self.summarise(fn, module, self)

    def is_global(self, name: str) -> bool:
        """Does `name` refer to the module-level (or builtin) object, unshadowed locally?"""
        return name not in self.locals


def namespace_of(func: ast.expr, scope: Scope) -> str | None:
    """`torch`, `F`, `operator`... when `func` is a function of such a namespace."""
    root = alias.namespace_root(func)
    return root if root is not None and scope.is_global(root) else None


def self_attr(func: ast.expr, scope: Scope) -> tuple[bool, Any]:
    """(True, the attribute's value) for a `self.<name>` callee when `self` is known."""
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
        and scope.module is not None
    ):
        return True, getattr(scope.module, func.attr, None)
    return False, None


def is_tensor_method(func: ast.expr, scope: Scope) -> bool:
    """Is `func` spelled as a public `torch.Tensor` method on something other than `self`?"""
    return (
        isinstance(func, ast.Attribute)
        and not self_attr(func, scope)[0]
        and hasattr(torch.Tensor, func.attr)
        and not func.attr.startswith("_")
        and func.attr not in {"register_hook", "apply_", "map_", "map2_", "data"}
    )


def is_builtin(call: ast.Call, scope: Scope, table: frozenset[str]) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Name)
        and func.id in table
        and scope.is_global(func.id)
        and not any(keyword.arg == "key" for keyword in call.keywords)
    )


def roots(node: ast.AST | None, scope: Scope) -> set[str]:
    """The names whose storage the value of `node` may share, or whose value it may hold (a
    tuple holding a view of `q` has root `q`). Empty only for what is known to be new
    storage or no tensor at all; a form not understood has every name it reads as roots."""
    if node is None or isinstance(node, (ast.Constant, ast.JoinedStr, ast.Compare)):
        return set()
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        if node.attr in METADATA_ATTRS:
            return set()
        return roots(node.value, scope)  # `q.T`, `q.data`, `self.saved`
    if isinstance(node, (ast.Subscript, ast.Starred)):
        return roots(node.value, scope)
    if isinstance(node, ast.IfExp):
        return roots(node.body, scope) | roots(node.orelse, scope)
    if isinstance(node, ast.BoolOp):
        return set().union(*(roots(value, scope) for value in node.values))
    if isinstance(node, ast.NamedExpr):
        return roots(node.value, scope)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(roots(element, scope) for element in node.elts))
    if isinstance(node, ast.Dict):
        return set().union(*(roots(part, scope) for part in [*node.keys, *node.values]))
    if isinstance(node, ast.UnaryOp):
        return set()  # `-q`, `~m`, `not c`: new values
    if isinstance(node, ast.BinOp):
        # Tensor arithmetic returns new storage, but `+` and `*` also concatenate and repeat
        # sequences (`[q] + [k]`, `(q,) * 2`), which hold their operands' elements. Neither
        # can involve a tensor operand, or a float; `+` cannot involve a number at all.
        if not isinstance(node.op, (ast.Add, ast.Mult)):
            return set()
        for operand in (node.left, node.right):
            if is_tensor_valued(operand, scope) or (
                isinstance(operand, ast.Constant)
                and (isinstance(operand.value, (float, complex)) or isinstance(node.op, ast.Add))
            ):
                return set()
        return roots(node.left, scope) | roots(node.right, scope)
    if isinstance(node, ast.Call):
        return call_roots(node, scope)
    return names_read(node)  # lambdas, comprehensions, awaits...: whatever they read


CONTAINER_METHODS = frozenset(
    {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add"}
    | {"setdefault", "get", "items", "keys", "values", "copy", "discard", "index", "count"}
)
"""Methods of lists, dicts and sets: they add, remove or hand back elements, never write one."""

NON_TENSOR_METHODS = METADATA_METHODS | {"item", "tolist", "numpy", "__len__"}
"""Tensor methods whose result is a Python value (a number, a list), not a tensor."""


def is_tensor_valued(node: ast.expr, scope: Scope) -> bool:
    """Is `node` certainly a tensor (never a sequence or an int): a `torch.*` or `F.*` call
    other than a metadata query, a tensor method call other than `NON_TENSOR_METHODS`, or
    arithmetic or a comparison with such an operand?"""
    if isinstance(node, ast.UnaryOp):
        return is_tensor_valued(node.operand, scope)
    if isinstance(node, ast.BinOp):
        return is_tensor_valued(node.left, scope) or is_tensor_valued(node.right, scope)
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    name = node.func.attr
    if name in NON_TENSOR_METHODS or name.startswith("_"):
        return False
    namespace = namespace_of(node.func, scope)
    if namespace in ("math", "operator"):
        return False
    if namespace is not None:
        return name not in {"is_tensor", "numel", "is_floating_point", "get_default_dtype"}
    receiver = node.func.value
    # A method of something that is itself certainly a tensor, or a view method (whatever
    # the receiver, only a tensor has `.view`/`.transpose`/...).
    return is_tensor_method(node.func, scope) and (
        is_tensor_valued(receiver, scope) or name in VIEW_OPS
    )


def call_arguments(call: ast.Call) -> list[ast.expr]:
    return [*call.args, *(keyword.value for keyword in call.keywords)]


def call_roots(call: ast.Call, scope: Scope) -> set[str]:
    """`roots` of a call's result."""
    func = call.func
    every = set().union(*(roots(argument, scope) for argument in call_arguments(call)))
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if isinstance(func, ast.Attribute) and name in METADATA_METHODS:
        return set()
    viewing = name in VIEW_OPS or name in MAY_RETURN_INPUT or alias.is_inplace_name(name)
    namespace = namespace_of(func, scope)
    if namespace == "operator":
        return every  # `operator.getitem(q, 0)`, `operator.iconcat(lst, [q])`
    if namespace is not None:
        if viewing:
            return roots(call.args[0], scope) if call.args else every
        return set()  # `torch.cat`, `F.silu`, `torch.matmul`: new storage
    is_self, child = self_attr(func, scope)
    if is_self and child is None:
        return set()  # calling a missing attribute raises: nothing is returned
    if is_self and type(child) in FRESH_CHILD_TYPES and has_hooks(child) is None:
        return set()  # a GEMM, a norm, a lookup: a new tensor
    resolved = resolve_callee(call, scope) if is_self or isinstance(func, ast.Name) else None
    if resolved is not None and resolved[0] is not no_writes:
        fn, module, bound = resolved
        summary = scope.summary(fn, module)
        binding = None if summary.opaque else bind_arguments(call, fn, bound, scope)
        if binding is not None:
            return set().union(*(binding.get(param, set()) for param in summary.returns))
        return every | roots(func, scope)
    if is_self and isinstance(child, nn.Module):
        return every  # `nn.Identity`, `nn.Dropout` in eval return their input
    if isinstance(func, ast.Attribute) and not is_self:
        receiver = roots(func.value, scope)
        if viewing:
            return receiver | (every if name == "set_" else set())
        if is_tensor_method(func, scope):
            return set()  # a tensor method that is no view: new storage
        return receiver | every
    if is_builtin(call, scope, PURE_NAME_BUILTINS):
        return set()
    if is_attention_lookup(func, scope, set()):
        return set()  # an attention interface returns new tensors (output, weights)
    return every | roots(func, scope)  # an unknown callee may return (part of) anything


def is_cache(node: ast.expr, scope: Scope, seen: set[str]) -> bool:
    """Is `node` the cache argument, or reached from it only (`cache.self_attention_cache`,
    a local bound to nothing else)?"""
    found = roots(node, scope)
    if not found:
        return False
    for root in found:
        if root in seen:
            continue
        seen.add(root)
        if root in CACHE_ARGUMENTS and root not in scope.local_values:
            continue
        values = scope.local_values.get(root)
        if not values or not bound_only_by_assignment(root, scope):
            return False
        if not all(is_cache(value, scope, seen) for value in values):
            return False
    return True


def bound_only_by_assignment(name: str, scope: Scope) -> bool:
    """Is every binding of `name` a plain `name = value` (no loop, walrus, unpacking)?"""
    stores = sum(
        isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id == name
        for n in ast.walk(scope.funcdef)
    )
    return stores == len(scope.local_values.get(name, ()))


def is_attention_lookup(node: ast.expr, scope: Scope, seen: set[str]) -> bool:
    if isinstance(node, ast.Subscript):
        base = node.value
        return isinstance(base, ast.Name) and base.id == "ALL_ATTENTION_FUNCTIONS"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        base = node.func.value
        return (
            isinstance(base, ast.Name)
            and base.id == "ALL_ATTENTION_FUNCTIONS"
            and node.func.attr in {"get_interface", "get", "__getitem__"}
        )
    if not (isinstance(node, ast.Name) and node.id in scope.local_values) or node.id in seen:
        return False
    seen.add(node.id)
    if not bound_only_by_assignment(node.id, scope):
        return False
    for value in scope.local_values[node.id]:
        if is_attention_lookup(value, scope, seen):
            continue
        fn = scope.namespace.get(value.id) if isinstance(value, ast.Name) else None
        if not (
            isinstance(value, ast.Name)
            and scope.is_global(value.id)
            and inspect.isfunction(fn)
            and not scope.summary(inspect.unwrap(fn), None).writes
            and not scope.summary(inspect.unwrap(fn), None).opaque
        ):
            return False
    return True


def resolve_callee(call: ast.Call, scope: Scope) -> tuple[Any, nn.Module | None, bool] | None:
    """(function, the module it runs on or None, whether `self` is bound) for a callee that
    can be read: a module-level Python function named directly, a method of `self`, or a
    hook-free child of `self` with a Python forward and nn.Module's call path; `None` for
    anything else. A child of a torch layer type that never writes its input (`nn.Linear`,
    `nn.RMSNorm`, ...: `fusion.alias.SAFE_CHILD_TYPES`) resolves to `no_writes`."""
    func = call.func
    if isinstance(func, ast.Name):
        fn = scope.namespace.get(func.id) if scope.is_global(func.id) else None
        return (inspect.unwrap(fn), None, False) if inspect.isfunction(fn) else None
    is_self, child = self_attr(func, scope)
    if not is_self or scope.module is None:
        return None
    if isinstance(child, nn.Module):
        if has_hooks(child) is not None or "forward" in child.__dict__:
            return None
        if type(child) in alias.SAFE_CHILD_TYPES:
            return None if getattr(child, "inplace", False) else (no_writes, None, False)
        if own_call_path(child) is not None:
            return None
        fn = inspect.unwrap(type(child).forward)
        return (fn, child, True) if inspect.isfunction(fn) else None
    method = inspect.getattr_static(type(scope.module), func.attr, None)
    if isinstance(method, staticmethod):
        method, bound = method.__func__, False
    else:
        bound = True
    if inspect.isfunction(method) and func.attr not in scope.module.__dict__:
        return inspect.unwrap(method), (scope.module if bound else None), bound
    return None


def no_writes(*args: Any, **kwargs: Any) -> None:
    """Stands for a callee known to write and keep nothing (a torch layer in
    `fusion.alias.SAFE_CHILD_TYPES`)."""


def bind_arguments(
    call: ast.Call, fn: Any, bound: bool, scope: Scope
) -> dict[str, set[str]] | None:
    """The roots of what `call` passes to each parameter of `fn` (`self` from the receiver
    when `bound`; a `*args` splat to every positional parameter from its position on, a
    `**options` splat to every parameter a keyword can reach); None when the arguments do
    not fit the signature."""
    if fn is no_writes:
        return {}
    parameters = inspect.signature(fn).parameters
    names = list(parameters)
    binding: dict[str, set[str]] = {name: set() for name in names}
    if bound:
        if not names:
            return None
        binding[names[0]] |= roots(call.func.value, scope)  # type: ignore[attr-defined]
        names = names[1:]
    kinds = {name: parameters[name].kind for name in names}
    positional = [
        n
        for n in names
        if kinds[n] in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    vararg = next((n for n in names if kinds[n] is inspect.Parameter.VAR_POSITIONAL), None)
    varkw = next((n for n in names if kinds[n] is inspect.Parameter.VAR_KEYWORD), None)
    for index, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            for param in [*positional[index:], vararg]:
                if param is not None:
                    binding[param] |= roots(arg, scope)
            continue
        param = positional[index] if index < len(positional) else vararg
        if param is None:
            return None  # too many arguments: the call raises, but do not guess
        binding[param] |= roots(arg, scope)
    for keyword in call.keywords:
        if keyword.arg is None:
            for param in names:
                if kinds[param] not in (
                    inspect.Parameter.POSITIONAL_ONLY,
                    inspect.Parameter.VAR_POSITIONAL,
                ):
                    binding[param] |= roots(keyword.value, scope)
            continue
        param = keyword.arg if keyword.arg in kinds else varkw
        if param is None:
            return None
        binding[param] |= roots(keyword.value, scope)
    return binding

"""What an expression's value may hold: the names (roots) whose storage it may share.

The first half of the source write analysis (`fusion.analysis.piece_writes` is the second): a
function under analysis is a `Scope`; `roots(expr, scope)` is every local or parameter
whose value (a view of it, or a container or object holding it) the value of `expr` may
hold. It is flow-insensitive and fails closed: an expression form not known to yield new
storage aliases whatever it reads, and a call whose callee cannot be read
(`resolve_callee`, `bind_arguments`, `Scope.summary`) may return any of its arguments.
Calls of plain Python functions, of `self`'s methods and of `self`'s children are read
(to MAX_CALL_DEPTH) instead of presumed, so `apply_rotary_pos_emb(q, k, cos, sin)` or a q/k
norm does not make every piece alias every other. `self.<name>` is what Python resolves it to
(`fusion.analysis.name_resolution`: a method on the class wins over a child of the same name, and a
function that rebinds `self` knows nothing of it); a decorated callee is not read (its
wrapper runs code its source does not show); and a callee's summary, read presuming tensors,
is not applied to a call passing something that may be none (`call_effects.may_be_foreign`: a
numpy view, whose `put` and `sort` write in place).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusion.analysis import alias, alias_terms, call_effects
from fusion.analysis.name_resolution import Kind, Resolution, self_is_bound_to_owner
from fusion.trace.pieces import VIEW_OPS
from fusion.trace.tensor_meta import METADATA_ATTRS, METADATA_METHODS
from fusion.trace.tracer import CACHE_ARGUMENTS

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
    | alias_terms.FOREIGN_VIEWS
    | {"from_numpy", "from_dlpack", "frombuffer", "as_tensor", "asarray", "as_strided"}
)
"""Calls besides `VIEW_OPS` and in-place ones that may hand back their receiver or first
argument, or a view or element of it: a no-op cast or move (`x.cpu()` on a CPU tensor,
`x.bool()` on a bool one), dropout outside training, an einsum that only permutes, container
accessors, the memory of a tensor seen as something else (`x.numpy()`, `x.untyped_storage()`:
`alias_terms.FOREIGN_VIEWS`) and a tensor over memory it is given (`torch.from_numpy(a)`,
`torch.from_dlpack(x)`, `torch.asarray(x)`)."""

RESULT_MAY_HOLD_ARGUMENT = frozenset({"tuple", "min", "max", "abs", "sum", "zip", "enumerate"})
"""Builtins in `alias_terms.PURE_BUILTINS` (they write no argument) whose result may still hold
one: `min(a, b)` is `a` or `b`, `tuple(xs)` holds the items."""

PURE_NAME_BUILTINS = (alias_terms.PURE_BUILTINS - RESULT_MAY_HOLD_ARGUMENT) | frozenset(
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
    foreign_return: bool = False
    """Its result may be something no tensor (`call_effects.may_be_foreign`: a numpy view of an
    argument, a module), whose methods named like tensor methods may write."""


OPAQUE = Summary(opaque=True)
PURE = Summary()


def names_read(node: ast.AST | None) -> set[str]:
    """Every name `node` reads: the fail-closed roots of an expression not understood."""
    if node is None:
        return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


class Scope:
    """One function under analysis: its AST, the module `self` is (None for a plain
    function, and for a method that rebinds `self`: `self = self.other` makes every
    `self.<name>` unknown), the globals its names resolve in, its depth in the call chain, a
    memo of callee summaries shared by the whole analysis, so each callee is read once, the
    summariser that reads a callee (`fusion.analysis.piece_writes`: roots of a call's result depend
    on what the callee returns, which only the write analysis reads), and the names that
    may hold something no tensor (`alias.foreign_names`: a numpy view, a module)."""

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
        self.module = module if self_is_bound_to_owner(funcdef) else None
        self.namespace = namespace
        self.depth = depth
        self.memo = memo
        self.locals = alias_terms.local_names(funcdef)  # type: ignore[arg-type]
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
        # Computed last: it reads the callees (`call_foreign`), which needs the rest of the
        # scope; until it is done, nothing is taken for foreign by the names alone.
        self.foreign: frozenset[str] = frozenset()
        self.foreign = alias.foreign_names(funcdef, self.module, calls=self.call_foreign)

    def call_foreign(self, call: ast.Call, foreign: Collection[str]) -> bool | None:
        """May the value of `call` be something no tensor, for a callee this analysis reads
        (`resolve_callee`): when its summary is opaque or says so, or when an argument may
        be (the summary presumed tensors); None for a callee it does not read
        (`call_effects.may_be_foreign` decides)."""
        func = call.func
        if not (is_self_call(func) or isinstance(func, ast.Name)):
            return None
        resolved = resolve_callee(call, self)
        if resolved is None:
            return None
        fn, module, _ = resolved
        if fn is no_writes:
            return False  # a GEMM, a norm, a lookup: a new tensor
        summary = self.summary(fn, module)
        if summary.opaque or summary.foreign_return:
            return True
        return any(
            call_effects.may_be_foreign(argument, self.module, foreign, calls=self.call_foreign)
            for argument in call_arguments(call)
        )

    def may_be_foreign(self, node: ast.AST) -> bool:
        """`call_effects.may_be_foreign` of `node` in this function, reading its callees."""
        return call_effects.may_be_foreign(node, self.module, self.foreign, calls=self.call_foreign)

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
    root = alias_terms.namespace_root(func)
    return root if root is not None and scope.is_global(root) else None


def self_attr(func: ast.expr, scope: Scope) -> Resolution | None:
    """What a `self.<name>` callee is when `self` is known, resolved as Python resolves it
    (`fusion.analysis.name_resolution.resolve`: a method on the class wins over a child of the same
    name); None for any other callee."""
    return alias_terms.self_callee(func, scope.module)


def is_self_call(func: ast.expr) -> bool:
    """Is `func` spelled `self.<name>` (whether or not `self` is known)?"""
    return (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
    )


def arguments_foreign(call: ast.Call, scope: Scope) -> bool:
    """May an argument of `call` be something no tensor (`call_effects.may_be_foreign`)? A callee's
    summary was read presuming tensors (`arr.put(0, v)` looks like a tensor op), so it does
    not hold for such a call."""
    return any(scope.may_be_foreign(argument) for argument in call_arguments(call))


def is_tensor_method(func: ast.expr, scope: Scope) -> bool:
    """Is `func` spelled as a public `torch.Tensor` method on something other than `self`,
    whose receiver is not `call_effects.may_be_foreign` (a numpy view's `put` and `sort`, a
    module's `float`, write in place)?"""
    return (
        isinstance(func, ast.Attribute)
        and not is_self_call(func)
        and hasattr(torch.Tensor, func.attr)
        and not func.attr.startswith("_")
        and func.attr not in {"register_hook", "apply_", "map_", "map2_"}
        and func.attr not in alias_terms.NOT_PURE_TENSOR_METHODS
        and not scope.may_be_foreign(func.value)
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
    viewing = name in VIEW_OPS or name in MAY_RETURN_INPUT or alias_terms.is_inplace_name(name)
    namespace = namespace_of(func, scope)
    if namespace == "operator":
        return every  # `operator.getitem(q, 0)`, `operator.iconcat(lst, [q])`
    if namespace is not None:
        if viewing:
            return roots(call.args[0], scope) if call.args else every
        return set()  # `torch.cat`, `F.silu`, `torch.matmul`: new storage
    resolution = self_attr(func, scope)
    is_self = is_self_call(func)
    if resolution is not None and resolution.raises_when_called:
        return set()  # calling a missing attribute raises: nothing is returned
    child = resolution.child if resolution is not None else None
    if (
        child is not None
        and type(child) in FRESH_CHILD_TYPES
        and alias_terms.runs_class_forward(child)
    ):
        return set()  # a GEMM, a norm, a lookup: a new tensor
    resolved = resolve_callee(call, scope) if is_self or isinstance(func, ast.Name) else None
    if resolved is not None and resolved[0] is not no_writes:
        fn, module, bound = resolved
        summary = scope.summary(fn, module)
        readable = not summary.opaque and not arguments_foreign(call, scope)
        binding = bind_arguments(call, fn, bound, scope) if readable else None
        if binding is not None:
            return set().union(*(binding.get(param, set()) for param in summary.returns))
        return every | roots(func, scope)
    if child is not None:
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
    child of `self` whose call runs its class's Python forward and nothing else
    (`alias_terms.runs_class_forward`); `None` for anything else. `self.<name>` is resolved as
    Python resolves it (`fusion.analysis.name_resolution.resolve`), so a method on the class beside a
    child of the same name is the method, and an ambiguous name, an instance-level callable
    or a property is unknown. A decorated function is unknown too: its wrapper runs code the
    source of the function it wraps does not show. A child that `alias_terms.is_safe_child` (an
    `nn.Linear`, an `nn.Embedding` without `max_norm`, ...) resolves to `no_writes`."""
    func = call.func
    if isinstance(func, ast.Name):
        fn = scope.namespace.get(func.id) if scope.is_global(func.id) else None
        return (fn, None, False) if _plain_function(fn) else None
    resolution = self_attr(func, scope)
    if resolution is None:
        return None
    child = resolution.child
    if child is not None:
        if alias_terms.is_safe_child(child):
            return no_writes, None, False
        if resolution.kind is not Kind.CHILD or not alias_terms.runs_class_forward(child):
            return None
        fn = type(child).forward
        return (fn, child, True) if _plain_function(fn) else None
    if resolution.kind is Kind.METHOD and _plain_function(resolution.value):
        return resolution.value, scope.module, True
    if resolution.kind is Kind.STATIC and _plain_function(resolution.value):
        return resolution.value, None, False
    return None


def _plain_function(fn: object) -> bool:
    """Is `fn` a Python function that wraps nothing (what its source shows is what runs)?"""
    return inspect.isfunction(fn) and inspect.unwrap(fn) is fn


def no_writes(*args: Any, **kwargs: Any) -> None:
    """Stands for a callee known to write and keep nothing (a child that
    `fusion.analysis.alias_terms.is_safe_child`)."""


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

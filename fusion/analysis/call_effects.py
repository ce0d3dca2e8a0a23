"""What one call may write, and whether a value may be no tensor.

`known_pure`: a call that cannot write through its arguments or receiver (a torch function
not spelled in place, a tensor method of a tensor, a safe child, a proven stand-in); anything
else is a write. `writes_through_args` and `namespace_call_writes`: the arguments a call
writes (in-place spellings, torch functions that write what they are given). `may_be_foreign`:
may a value be no tensor, so that a method named like a tensor method may write in place
(a numpy view's `put`, a module's `float`). `known_pure` and `may_be_foreign` answer each
other's questions, so they live together.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Callable, Collection, Iterable

import torch
from torch import nn

from fusion.analysis.alias_terms import (
    FOREIGN_VIEWS,
    IMPURE_TORCH_NAMESPACES,
    MUTATING_OPERATORS,
    NOT_PURE_TENSOR_METHODS,
    PURE_BUILTINS,
    STAND_IN,
    WRITES_UNLESS,
    WRITING_FUNCTIONS,
    func_chain,
    is_inplace_name,
    is_safe_child,
    namespace_root,
    self_callee,
)
from fusion.analysis.name_resolution import (
    resolve_chain,
    self_chain,
)
from fusion.trace.tensor_meta import METADATA_ATTRS

CallVerdict = Callable[[ast.Call, Collection[str]], bool | None]
"""A reader's own answer to "may this call's value be foreign?" (given the names foreign so
far): True or False for a call it reads itself (`fusion.analysis.value_roots` reads helpers), None to
leave the call to `may_be_foreign`."""


def _value_parts(node: ast.AST) -> list[ast.AST] | None:
    """The parts a composite expression's value may be or hold (`may_be_foreign`): both
    branches of a ternary, every operand of `and` / `or`, the elements of a display; none for
    arithmetic (a new value, never a view); None for an expression of another kind."""
    if isinstance(node, ast.IfExp):
        return [node.body, node.orelse]
    if isinstance(node, ast.BoolOp):
        return list(node.values)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return list(node.elts)
    if isinstance(node, ast.Dict):
        return list(node.values)
    if isinstance(node, ast.BinOp):
        # Arithmetic makes a new value (`arr * 2` is a new array: writing it writes nothing
        # bound); only concatenating or repeating a sequence display holds its elements.
        sequences = (ast.Tuple, ast.List)
        if not (isinstance(node.left, sequences) or isinstance(node.right, sequences)):
            return []
        return [node.left, node.right]
    return None


def may_be_foreign(
    expr: ast.AST,
    module: nn.Module | None,
    foreign: Collection[str],
    shadowed: frozenset[str] = frozenset(),
    calls: CallVerdict | None = None,
) -> bool:
    """May `expr` evaluate to something that is no tensor, so that a method of it named like
    a tensor method may write in place: a numpy view (`x.numpy().put(0, v)`, `.sort()`), a
    storage, a module (`self.child.float()` casts the child's parameters in place), a global
    object (`np.put(a, i, v)`), or whatever an unknown callee returns?

    False only for what is certainly a tensor or a plain value: a `self.a.b` that resolves to
    a tensor (or to nothing: using it raises), a name not in `foreign` (`foreign_names`), a literal, metadata, and the result
    of a call known pure that is no `FOREIGN_VIEWS` method (a torch function, a tensor method
    of a tensor, a safe child, a proven stand-in given no foreign argument; a pure builtin
    only when no argument may be foreign: `min(a, b)` may be `a`) or that `calls` answers
    for, and arithmetic (a new value, never a view)."""

    def foreign_value(node: ast.AST) -> bool:
        if isinstance(node, (ast.Constant, ast.UnaryOp, ast.Compare, ast.JoinedStr)):
            return False  # literals; `-a`, `a < b` of a numpy array are new arrays
        chain = self_chain(node)  # type: ignore[arg-type]
        if chain is not None:
            if module is None:
                return True
            resolved = resolve_chain(module, chain)
            # An absent (or None) attribute raises when used: no method of it ever runs.
            return resolved.tensor is None and not resolved.raises_when_called
        if isinstance(node, ast.Name):
            return node.id in foreign
        if isinstance(node, ast.Attribute):
            if node.attr in FOREIGN_VIEWS:
                return True
            return node.attr not in METADATA_ATTRS and foreign_value(node.value)
        if isinstance(node, (ast.Subscript, ast.Starred, ast.NamedExpr)):
            return foreign_value(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in FOREIGN_VIEWS:
                return True
            verdict = calls(node, foreign) if calls is not None else None
            if verdict is not None:
                return verdict
            if not known_pure(node, module, shadowed, foreign, calls):
                return True  # an unknown callee may return anything
            if isinstance(func, ast.Name):
                return any(
                    foreign_value(argument)
                    for argument in [*node.args, *(keyword.value for keyword in node.keywords)]
                )
            return False
        parts = _value_parts(node)
        if parts is None:
            # Lambdas, comprehensions, awaits, nested definitions: whatever they read.
            return any(
                (isinstance(inner, ast.Name) and inner.id in foreign)
                or (isinstance(inner, ast.Attribute) and inner.attr in FOREIGN_VIEWS)
                or (isinstance(inner, ast.Call) and foreign_value(inner))
                for inner in ast.walk(node)
                if inner is not node
            )
        return any(foreign_value(part) for part in parts)

    return foreign_value(expr)


_NAMESPACE_MODULES = {
    "torch": "torch",
    "F": "torch.nn.functional",
    "functional": "torch.nn.functional",
    "nn": "torch.nn",
}


UNREADABLE = "unreadable"
"""`_parameter`'s answer for a function that does not resolve or has no readable signature."""


@functools.cache
def _parameter(
    root: str, chain: tuple[str, ...], name: str
) -> tuple[int | None, object] | str | None:
    """(position, or None when keyword-only; default) of the parameter `name` of the
    function `root.<chain>` resolves to (`F.relu`, "inplace" -> (1, False)); None when it
    has no such parameter; `UNREADABLE` when it does not resolve or its signature cannot be
    read (a builtin such as `torch.batch_norm`). Cached: signatures do not change."""
    module_name = _NAMESPACE_MODULES.get(root)
    if module_name is None:
        return UNREADABLE
    try:
        target: object = importlib.import_module(module_name)
        for attr in chain:
            target = getattr(target, attr)
        parameters = list(inspect.signature(target).parameters.values())  # type: ignore[arg-type]
    except (AttributeError, ImportError, TypeError, ValueError):
        return UNREADABLE
    for position, parameter in enumerate(parameters):
        if parameter.name == name:
            positional = parameter.kind is parameter.POSITIONAL_OR_KEYWORD
            return (position if positional else None), parameter.default
    return None


def _inplace_position(root: str, chain: tuple[str, ...]) -> int | None:
    """Position of the `inplace` parameter of the function `root.<chain>` resolves to
    (`F.relu` -> 1), or None when it has none, it is keyword-only, or it does not resolve."""
    found = _parameter(root, chain, "inplace")
    return found[0] if isinstance(found, tuple) else None


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _is_literal(node: ast.expr, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _argument_is(
    call: ast.Call, root: str, chain: tuple[str, ...], name: str, value: object
) -> bool:
    """Is the parameter `name` of `call` (of the function `root.<chain>`) certainly the
    literal `value` (None, False): so passed by keyword or position, or left out and
    defaulting to it? True as well when the function has no such parameter; False when the
    signature cannot be read or a `*args`/`**options` splat may carry it."""
    found = _parameter(root, chain, name)
    if found is None:
        return True
    if not isinstance(found, tuple):
        return False
    position, default = found
    for keyword in call.keywords:
        if keyword.arg == name:
            return _is_literal(keyword.value, value)
        if keyword.arg is None:
            return False
    if position is not None:
        if any(isinstance(arg, ast.Starred) for arg in call.args[: position + 1]):
            return False
        if len(call.args) > position:
            return _is_literal(call.args[position], value)
    return default is value


def namespace_call_writes(call: ast.Call) -> bool:
    """Does `call`, a call of a function of the pure namespaces (`torch.*`, `F.*`, `nn.*`:
    `namespace_root`), write an argument although it is spelled out of place?

    True through a namespace that may (`IMPURE_TORCH_NAMESPACES` anywhere along the chain:
    `nn.init.constant`, `torch.utils.swap_tensors`, `torch.ops.mylib.f`), for a
    `WRITING_FUNCTIONS` function (`torch.native_batch_norm`, `torch.vmap`), and for a
    `WRITES_UNLESS` one whose parameter is not certainly its harmless literal
    (`F.embedding(i, w, max_norm=1.0)`, `F.batch_norm(..., training=True)`). Such a call
    writes every argument, as an unknown one does. False for anything else, including calls
    outside the pure namespaces (the caller decides those)."""
    root = namespace_root(call.func)
    chain = tuple(func_chain(call.func))
    if root is None or not chain:
        return False
    if any(attr in IMPURE_TORCH_NAMESPACES for attr in chain[:-1]):
        return True
    name = chain[-1]
    if name in WRITING_FUNCTIONS:
        return True
    if name in WRITES_UNLESS:
        parameter, harmless = WRITES_UNLESS[name]
        return not _argument_is(call, root, chain, parameter, harmless)
    return False


def writes_through_args(call: ast.Call) -> bool:
    """Is `call` spelled to write through an argument: `out=`, `inplace=` (anything but a
    literal False, by keyword or by position: `F.relu(x, True)`), a `**options` splat, or an
    in-place name anywhere along the callee (`x.add_`, `torch.relu_`, `x.__iadd__`,
    `torch.ops.aten.add_.Scalar`)?"""
    for keyword in call.keywords:
        if keyword.arg == "out":
            return True
        if keyword.arg == "inplace" and not _is_false(keyword.value):
            return True
        if keyword.arg is None:  # `**options` may carry `out=` or `inplace=True`
            return True
    chain = func_chain(call.func)
    if isinstance(call.func, ast.Name):
        chain = [call.func.id]
    if any(is_inplace_name(attr) for attr in chain):
        return True
    root = namespace_root(call.func)
    if root is not None:
        position = _inplace_position(root, tuple(chain))
        if position is not None:
            leading = call.args[: position + 1]
            if any(isinstance(arg, ast.Starred) for arg in leading):
                return True
            if len(call.args) > position and not _is_false(call.args[position]):
                return True
    return False


def known_pure(
    call: ast.Call,
    module: nn.Module | None,
    shadowed: Iterable[str] = (),
    foreign: Collection[str] = frozenset(),
    calls: CallVerdict | None = None,
) -> bool:
    """Is `call` known to write through none of its arguments or its receiver?

    `shadowed` holds builtin and namespace names the forward rebinds locally: a call through
    one of those is not the function the tables here describe. `foreign` holds the names that
    may hold something no tensor (`foreign_names`): a method named like a tensor method is
    known pure only on a receiver that is not `may_be_foreign` (`arr.put(0, v)` writes a
    numpy view in place, `self.child.float()` casts a child's parameters; `calls` answers for
    the calls the caller reads itself). `self.<name>` is resolved as Python resolves it
    (`fusion.analysis.name_resolution`): only a child that `is_safe_child`, or a name that raises when
    called, is pure.
    """
    if writes_through_args(call):
        return False
    func = call.func
    shadowed = frozenset(shadowed)
    if isinstance(func, ast.Name):
        # `min(xs, key=f)` calls `f` on each element: a pure builtin, an impure callback.
        return (
            func.id in PURE_BUILTINS
            and func.id not in shadowed
            and not any(keyword.arg == "key" for keyword in call.keywords)
        )
    if not isinstance(func, ast.Attribute):
        return False
    if isinstance(func.value, ast.Name) and func.value.id == "self":
        resolved = self_callee(func, module)
        if resolved is None:
            return False
        # Calling a missing or None attribute raises before anything is written (the branch
        # of another configuration, e.g. `q_proj` on a q-LoRA layer).
        return resolved.raises_when_called or is_safe_child(resolved.child)
    root = namespace_root(func)
    if root is not None:
        if root in shadowed or namespace_call_writes(call):
            return False
        if root == "torch" and func_chain(func) == [STAND_IN]:
            # Proven on the presumption that its parameters are tensors or plain values
            # (`arr.put(0, v)` on a numpy view is a write the proof took for a tensor op).
            return not any(
                may_be_foreign(argument, module, foreign, shadowed, calls)
                for argument in call.args[1:]
            )
        return not (root == "operator" and func.attr in MUTATING_OPERATORS)
    if may_be_foreign(func.value, module, foreign, shadowed, calls):
        return False
    # A tensor method that is not in-place returns a new tensor or a view; the view is
    # tracked by `aliasing_names`, never written here.
    return hasattr(torch.Tensor, func.attr) and func.attr not in NOT_PURE_TENSOR_METHODS

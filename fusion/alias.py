"""May-alias and may-write analysis over a forward's AST.

Merging projections moves every projection's read of its input to the earliest call. That
is only correct when nothing between the earliest and the latest call changes the input's
value: not by rebinding its name, not by writing through it, and not by writing through any
other name that may share its storage (a view, a container holding it, a bound method).

Both halves over-approximate. `aliasing_names` may report names that do not alias, and
`written_names` may report names that are not written; a false hit costs a fusion, a miss
would silently change a model's outputs. Anything the analysis does not understand (an
unknown callee receiving a tracked name, `exec`, a lambda) counts as a write.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from torch import nn

from fusion.errors import RewriteRefused

METADATA_ATTRS = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_leaf"}
)
"""Tensor attributes that are plain Python values sharing no storage with the tensor."""

METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "stride", "element_size", "nelement", "is_contiguous", "get_device"}
)
"""Tensor methods returning Python numbers/tuples: reading through them never aliases."""

PURE_NAMESPACES = frozenset({"torch", "F", "nn", "functional", "math", "operator"})
"""Roots of call chains (`torch.cat`, `F.silu`, `nn.functional.gelu`) whose functions return
new values unless spelled in place (`*_`, `out=`, `inplace=True`)."""

PURE_BUILTINS = frozenset(
    {
        "len",
        "isinstance",
        "issubclass",
        "int",
        "float",
        "bool",
        "str",
        "tuple",
        "range",
        "min",
        "max",
        "abs",
        "sum",
        "any",
        "all",
        "zip",
        "enumerate",
        "hasattr",
        "type",
        "round",
        "divmod",
        "pow",
    }
)
"""Builtins that cannot write through their arguments (`getattr` is deliberately absent: it
hands back bound methods that can)."""

OPAQUE_BUILTINS = frozenset(
    {"exec", "eval", "locals", "globals", "vars", "setattr", "delattr", "__import__", "compile"}
)
"""Callables that can reach any local by name: a region calling one writes everything."""

SAFE_CHILD_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Dropout,
    nn.Identity,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Embedding,
)
"""Children whose forward never writes its input (exact classes only, and only when not
constructed `inplace=True`). Any other child receiving a tracked value counts as a write."""

EVERYTHING = "*"
"""Member of a written-names set meaning "anything may have been written"."""


# -- alias reads ---------------------------------------------------------------------------


def _is_self_child_call(node: ast.Call, module: nn.Module | None, types: tuple[type, ...]) -> bool:
    func = node.func
    if not (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
        and module is not None
    ):
        return False
    child = getattr(module, func.attr, None)
    return child is None or type(child) in types


def returns_fresh(node: ast.expr, module: nn.Module | None = None) -> bool:
    """Does evaluating `node` yield storage that aliases nothing already bound?

    True for literals, for a call of a `self.<child>` that is an exact `nn.Linear` (a GEMM
    writes a new tensor) or absent/None (the call cannot run at all, so the branch holding
    it never executes), for a view chain on such a call, and for tuples or ternaries whose
    every part is fresh. Everything else is conservatively not fresh.
    """
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.IfExp):
        if isinstance(node.test, ast.Constant):
            return returns_fresh(node.body if node.test.value else node.orelse, module)
        return returns_fresh(node.body, module) and returns_fresh(node.orelse, module)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(returns_fresh(element, module) for element in node.elts)
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if _is_self_child_call(node, module, (nn.Linear,)):
            return True
        node = node.func.value
    return False


def alias_reads(node: ast.AST, module: nn.Module | None = None) -> set[str]:
    """Names whose storage the value of `node` may share.

    Metadata (`x.shape`, `x.size(0)`, `x.dtype`) yields plain Python values, and a fresh
    sub-expression (`returns_fresh`) yields new storage, so names reached only through those
    are excluded; every other name read counts. Names bound inside a lambda or comprehension
    are still counted when read: over-approximation is the safe direction.
    """
    names: set[str] = set()
    stack: list[ast.AST] = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, ast.expr) and returns_fresh(current, module):
            continue
        if isinstance(current, ast.Attribute) and current.attr in METADATA_ATTRS:
            continue
        if (
            isinstance(current, ast.Call)
            and isinstance(current.func, ast.Attribute)
            and current.func.attr in METADATA_METHODS
        ):
            # `x.size(d)` is a number whatever `x` is; its arguments still count.
            stack.extend(current.args)
            stack.extend(keyword.value for keyword in current.keywords)
            continue
        if isinstance(current, ast.Name) and isinstance(current.ctx, ast.Load):
            names.add(current.id)
        stack.extend(ast.iter_child_nodes(current))
    return names


def _store_names(target: ast.AST) -> set[str]:
    return {
        node.id
        for node in ast.walk(target)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }


def _bindings(tree: ast.AST) -> list[tuple[set[str], ast.AST | None]]:
    """Every (names bound, value expression) pair in `tree`, whatever the binding form."""
    pairs: list[tuple[set[str], ast.AST | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs.append((set().union(*(_store_names(t) for t in node.targets)), node.value))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            value = node.value
            if isinstance(node, ast.AugAssign):
                # `t += v` keeps `t`'s storage for tensors and may merge `v` into it.
                value = ast.Tuple(
                    elts=[ast.Name(id=_root_name(node.target) or "", ctx=ast.Load()), node.value],
                    ctx=ast.Load(),
                )
            pairs.append((_store_names(node.target), value))
        elif isinstance(node, ast.NamedExpr):
            pairs.append((_store_names(node.target), node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            pairs.append((_store_names(node.target), node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((_store_names(node.optional_vars), node.context_expr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not tree:
            # A nested function closes over (so aliases) whatever its body reads.
            pairs.append(({node.name}, node))
    return pairs


def aliasing_names(
    funcdef: ast.FunctionDef, seed: Iterable[str], module: nn.Module | None = None
) -> set[str]:
    """`seed` plus every name of `funcdef` that may alias one of them, to a fixed point.

    A binding whose value may alias (`alias_reads`) a tracked name taints every name it
    binds: `h = x.view(-1)`, `a, b = x.chunk(2)`, `lst = [x]`, `for t in (x,)`, `f = x.add_`.
    Flow-insensitive on purpose: a name tainted anywhere is tainted everywhere.
    """
    names = set(seed)
    bindings = [(stores, value) for stores, value in _bindings(funcdef) if value is not None]
    changed = True
    while changed:
        changed = False
        for stores, value in bindings:
            if stores <= names:
                continue
            if alias_reads(value, module) & names:
                names |= stores
                changed = True
    return names


# -- writes ----------------------------------------------------------------------------------


def _root_name(node: ast.AST) -> str | None:
    """The `Name` at the root of an attribute/subscript/call chain (`a.b[c].d()` -> `a`)."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Starred):
            node = node.value
        else:
            break
    return node.id if isinstance(node, ast.Name) else None


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def writes_through_args(call: ast.Call) -> bool:
    """Is `call` spelled to write through an argument: `out=`, `inplace=` (anything but a
    literal False), or a trailing-underscore name (`x.add_`, `torch.relu_`)?"""
    for keyword in call.keywords:
        if keyword.arg == "out":
            return True
        if keyword.arg == "inplace" and not (
            isinstance(keyword.value, ast.Constant) and keyword.value.value is False
        ):
            return True
        if keyword.arg is None:  # `**options` may carry `out=` or `inplace=True`
            return True
    name = _call_name(call)
    return name.endswith("_") and not name.endswith("__")


def _namespace_root(func: ast.expr) -> str | None:
    """`torch` for `torch.nn.functional.silu`, `F` for `F.silu`; None for other chains."""
    node = func
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) and node.id in PURE_NAMESPACES else None


def _known_pure(call: ast.Call, module: nn.Module | None) -> bool:
    """Is `call` known to write through none of its arguments or its receiver?"""
    if writes_through_args(call):
        return False
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in PURE_BUILTINS
    if not isinstance(func, ast.Attribute):
        return False
    if isinstance(func.value, ast.Name) and func.value.id == "self":
        if module is None:
            return False
        child = getattr(module, func.attr, None)
        if child is None:
            # Calling a missing or None attribute raises before anything is written (the
            # branch of another configuration, e.g. `q_proj` on a q-LoRA layer).
            return True
        if not isinstance(child, nn.Module):
            return False
        return (
            type(child) in SAFE_CHILD_TYPES
            and not getattr(child, "inplace", False)
            and not child._forward_hooks
            and not child._forward_pre_hooks
        )
    if _namespace_root(func) is not None:
        return True
    import torch  # deferred: only the method table is needed, once

    # A tensor method that is not in-place returns a new tensor or a view; the view is
    # tracked by `aliasing_names`, never written here.
    return hasattr(torch.Tensor, func.attr) and func.attr not in {"data", "register_hook"}


def written_names(region: Iterable[ast.stmt], module: nn.Module | None = None) -> set[str]:
    """Names that executing `region` may rebind, delete, or write through.

    Rebinding (`x = ...`, `del x`, `for x in`, `x += 1`), writes through a name (`x[i] = v`,
    `x.a = v`), in-place spellings (`x.op_()`, `torch.op_(x)`, `out=x`, `inplace=True`), a
    statement whose result is discarded (it can only be there for a side effect), and every
    call not known to be pure: those write every name their arguments and receiver may alias.
    `EVERYTHING` is included when the region can reach locals by name (`exec`, `locals()`).
    """
    written: set[str] = set()
    for stmt in region:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                written.add(node.id)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(
                node.ctx, (ast.Store, ast.Del)
            ):
                root = _root_name(node)
                if root:
                    written.add(root)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                written.add(EVERYTHING)
            elif isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name) and node.func.id in OPAQUE_BUILTINS:
                    written.add(EVERYTHING)
                    continue
                if (
                    isinstance(node.func, ast.Attribute)
                    and node.func.attr.endswith("_")
                    and not node.func.attr.endswith("__")
                ):
                    root = _root_name(node.func.value)
                    if root:
                        written.add(root)
                if not _known_pure(node, module):
                    written |= _call_reads(node, module)
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            written |= _call_reads(stmt.value, module)
    return written


def _call_reads(call: ast.Call, module: nn.Module | None) -> set[str]:
    """Names a call may write when it is not known to be pure: whatever its receiver and
    arguments may alias."""
    reads: set[str] = set()
    func = call.func
    if isinstance(func, ast.Attribute):
        reads |= alias_reads(func.value, module)
    elif not isinstance(func, ast.Name):
        reads |= alias_reads(func, module)
    else:
        reads.add(func.id)  # a local callable may close over (alias) anything it was built from
    for arg in call.args:
        reads |= alias_reads(arg, module)
    for keyword in call.keywords:
        reads |= alias_reads(keyword.value, module)
    return reads


def input_names(expr: ast.expr) -> set[str]:
    """Every name the input expression `expr` reads."""
    return {node.id for node in ast.walk(expr) if isinstance(node, ast.Name)}


def check_input_stable(
    funcdef: ast.FunctionDef,
    module: nn.Module | None,
    input_expr: ast.expr,
    region: list[ast.stmt],
) -> None:
    """Refuse unless `input_expr` has the same value throughout `region`.

    `region` is every statement from the earliest to the latest projection call (inclusive);
    the merged call will read the input once, before the first of them. The input is stable
    when no name it reads, and no name that may alias one, can be written in the region.
    """
    tracked = aliasing_names(funcdef, input_names(input_expr), module)
    written = written_names(region, module)
    if EVERYTHING in written:
        raise RewriteRefused("the region between projections can write any local (exec/locals)")
    hit = sorted(tracked & written)
    if hit:
        raise RewriteRefused(
            f"projection input may change between the projection calls (written: {', '.join(hit)})"
        )

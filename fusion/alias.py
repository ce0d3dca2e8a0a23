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
import functools
import importlib
import inspect
from collections.abc import Iterable

from torch import nn

from fusion.callpath import has_hooks
from fusion.errors import RewriteRefused
from fusion.source import method_source
from fusion.tensor_meta import METADATA_ATTRS, METADATA_METHODS

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
"""Callables that can reach any local by name: a region calling one writes everything, and
a value built from one (`d = locals()`) may alias anything."""

FRAME_ATTRS = frozenset({"_getframe", "currentframe", "f_locals", "f_globals", "f_back", "stack"})
"""Attributes that reach frames (`sys._getframe().f_locals`): as opaque as `locals()`."""

INPLACE_DUNDERS = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__imatmul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__ilshift__",
        "__irshift__",
        "__iand__",
        "__ixor__",
        "__ior__",
        "__setitem__",
        "__delitem__",
        "__setattr__",
        "__delattr__",
        "__setstate__",
        "__init__",
        "__set__",
    }
)
"""Dunder methods that mutate their receiver (`x.__iadd__(1)`, `x.__setitem__(i, v)`)."""

MUTATING_OPERATORS = frozenset(
    {"setitem", "delitem", "iconcat"}
    | {name.strip("_") for name in INPLACE_DUNDERS if name.startswith("__i")}
)
"""`operator` functions that write through their first argument (`operator.iadd(x, 1)`)."""

IMPURE_TORCH_NAMESPACES = frozenset({"ops", "distributed", "library", "cuda", "_C", "classes"})
"""`torch.<ns>` namespaces whose functions may write arguments without an in-place spelling
(`torch.distributed.all_reduce(x)`, custom ops in `torch.ops`)."""

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
    if child is None:
        return True
    # A forward hook may return (or a pre-hook substitute) any tensor it can reach.
    return type(child) in types and has_hooks(child) is None


def returns_fresh(node: ast.expr, module: nn.Module | None = None) -> bool:
    """Does evaluating `node` yield storage that aliases nothing already bound?

    True for literals, for a call of a `self.<child>` that is an exact, hook-free
    `nn.Linear` (a GEMM writes a new tensor) or absent/None (the call cannot run at all, so
    the branch holding it never executes), for a method chain on such a call whose arguments
    are themselves fresh (`.view(-1)`, `.transpose(1, 2)`; not `.set_(y)` or `.new(y)`,
    which return storage of their argument), and for tuples or ternaries whose every part is
    fresh. Everything else is conservatively not fresh (`alias_reads` then looks inside).
    """
    if isinstance(node, ast.Constant) or (
        isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant)
    ):
        return True  # a literal (`1.5`, `None`, `-1`): nothing to share
    if isinstance(node, ast.IfExp):
        if isinstance(node.test, ast.Constant):
            return returns_fresh(node.body if node.test.value else node.orelse, module)
        return returns_fresh(node.body, module) and returns_fresh(node.orelse, module)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(returns_fresh(element, module) for element in node.elts)
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if _is_self_child_call(node, module, (nn.Linear,)):
            return True
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        if not all(returns_fresh(argument, module) for argument in arguments):
            return False
        node = node.func.value
    return False


def alias_reads(node: ast.AST, module: nn.Module | None = None) -> set[str]:
    """Names whose storage the value of `node` may share.

    Metadata (`x.shape`, `x.size(0)`, `x.dtype`) yields plain Python values, and a fresh
    sub-expression (`returns_fresh`) yields new storage, so names reached only through those
    are excluded; every other name read counts. Names bound inside a lambda or comprehension
    are still counted when read: over-approximation is the safe direction. `EVERYTHING` is
    included when the value may be built from locals reached by name (`locals()`, `eval`).
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
        if is_opaque(current):
            names.add(EVERYTHING)
        if isinstance(current, ast.Name) and isinstance(current.ctx, ast.Load):
            names.add(current.id)
        stack.extend(ast.iter_child_nodes(current))
    return names


def is_opaque(node: ast.AST, shadowed: Iterable[str] | None = None) -> bool:
    """Does `node` name something that reaches locals by name (`locals`, `exec`, a frame)?

    Given `shadowed` (the namespace names the forward rebinds), an attribute of an
    unshadowed torch/math/operator namespace is not opaque: `torch.stack` is not
    `inspect.stack`. Without it every `*.stack` counts, as it must where a local `torch`
    could be anything."""
    if isinstance(node, ast.Name):
        return node.id in OPAQUE_BUILTINS
    if not isinstance(node, ast.Attribute):
        return False
    if shadowed is not None:
        root = namespace_root(node)
        if root is not None and root not in set(shadowed):
            return False
    return node.attr in OPAQUE_BUILTINS or node.attr in FRAME_ATTRS


def store_names(target: ast.AST) -> set[str]:
    return {
        node.id
        for node in ast.walk(target)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }


def _written_through(target: ast.AST, module: nn.Module | None) -> set[str]:
    """Names of the objects a store or `del` into `target` writes through: `c[k] = v` and
    `o.a = v` write `c` and `o`, and whatever the written object may alias
    (`torch.flatten(x)[0] = v` writes `x`, `(a if c else b)[0] = v` writes both)."""
    names: set[str] = set()
    for node in ast.walk(target):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            names |= alias_reads(node.value, module)
            root = _root_name(node)
            if root:
                names.add(root)
    return names


def _targets(target: ast.AST, module: nn.Module | None) -> set[str]:
    """Names a binding to `target` may make alias the bound value: the names it binds and
    the containers or objects it stores into (`lst[0] = x` makes `lst` hold `x`)."""
    return store_names(target) | _written_through(target, module)


def match_captures(pattern: ast.AST) -> set[str]:
    """Names a `match` case pattern binds (`case y`, `case [*rest]`, `case {**rest}`)."""
    names: set[str] = set()
    for node in ast.walk(pattern):
        if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return names


def _bindings(
    tree: ast.AST, module: nn.Module | None = None, shadowed: Iterable[str] = ()
) -> list[tuple[set[str], ast.AST | None]]:
    """Every (names bound, value expression) pair in `tree`, whatever the binding form.

    Besides plain bindings this includes stores into containers and objects (`lst[0] = x`,
    `self.saved = x`), `match` captures, nested functions and classes, and every call not
    known to be pure: such a call may store any of its arguments into its receiver or into
    another argument (`lst.append(x)`, `d.update(k=x)`), so they all may alias each other.
    """
    shadowed = frozenset(shadowed)
    pairs: list[tuple[set[str], ast.AST | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs.append((set().union(*(_targets(t, module) for t in node.targets)), node.value))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            value = node.value
            if isinstance(node, ast.AugAssign):
                # `t += v` keeps `t`'s storage for tensors and may merge `v` into it.
                value = ast.Tuple(
                    elts=[ast.Name(id=_root_name(node.target) or "", ctx=ast.Load()), node.value],
                    ctx=ast.Load(),
                )
            pairs.append((_targets(node.target, module), value))
        elif isinstance(node, ast.NamedExpr):
            pairs.append((store_names(node.target), node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            pairs.append((_targets(node.target, module), node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((_targets(node.optional_vars, module), node.context_expr))
        elif isinstance(node, ast.Match):
            for case in node.cases:
                pairs.append((match_captures(case.pattern), node.subject))
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not tree
        ):
            # A nested function closes over (so aliases) whatever its body reads.
            pairs.append(({node.name}, node))
        elif isinstance(node, ast.Call) and not known_pure(node, module, shadowed):
            pairs.append((_call_reads(node, module) - {EVERYTHING}, node))
    return pairs


def local_names(funcdef: ast.FunctionDef) -> set[str]:
    """Every name `funcdef` binds locally, in any binding form (so a builtin or namespace
    such as `min` or `F` spelled in its body may not be the one the analysis knows)."""
    names: set[str] = set()
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not funcdef
        ):
            names.add(node.name)
        elif isinstance(node, ast.pattern):
            names |= match_captures(node)
    return names


def _shadowed(funcdef: ast.FunctionDef) -> frozenset[str]:
    return frozenset(local_names(funcdef) & (PURE_BUILTINS | PURE_NAMESPACES))


def aliasing_names(
    funcdef: ast.FunctionDef, seed: Iterable[str], module: nn.Module | None = None
) -> set[str]:
    """`seed` plus every name of `funcdef` that may alias one of them, to a fixed point.

    Aliasing is symmetric, so a binding joins the names it binds and the names its value
    may alias (`alias_reads`) whenever either side is tracked: `h = x.view(-1)`,
    `a, b = x.chunk(2)`, `lst = [x]`, `lst.append(x)`, `for t in (x,)`, `f = x.add_`,
    `match x: case h:` track the new name; `x = v` tracks `v` (from there on, writes
    through `v` write the input). A value built from locals reached by name (`d = locals()`)
    taints whatever it binds, and binding a tracked name to one (`x = eval("v")`) adds
    `EVERYTHING`: any name may then hold the input. Flow-insensitive on purpose: a name
    tainted anywhere is tainted everywhere.
    """
    return _aliasing(funcdef, seed, module, _shadowed(funcdef))


def _aliasing(
    funcdef: ast.FunctionDef,
    seed: Iterable[str],
    module: nn.Module | None,
    shadowed: frozenset[str],
) -> set[str]:
    names = set(seed)
    bindings = [
        (stores, alias_reads(value, module))
        for stores, value in _bindings(funcdef, module, shadowed)
        if value is not None
    ]
    changed = True
    while changed:
        changed = False
        for stores, reads in bindings:
            joined = stores | reads
            if joined <= names:
                continue
            if stores & names or reads & names:
                names |= joined
                changed = True
            elif EVERYTHING in reads and not stores <= names:
                # The value may be any local (`d = locals()`): what it binds may hold `x`.
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


def is_inplace_name(name: str) -> bool:
    """Is `name` spelled as an in-place operation: a trailing underscore (`add_`, `relu_`)
    or a mutating dunder (`__iadd__`, `__setitem__`)?"""
    return (name.endswith("_") and not name.endswith("__")) or name in INPLACE_DUNDERS


def func_chain(func: ast.expr) -> list[str]:
    """Attribute names along `func` from its root outwards (`torch.ops.aten.add_.Scalar` ->
    `["ops", "aten", "add_", "Scalar"]`), stopping at anything that is not an attribute
    (`chain_root`)."""
    attrs: list[str] = []
    node = func
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return attrs[::-1]


def chain_root(func: ast.expr) -> ast.expr:
    """What `func`'s attribute chain starts from (`torch` in `torch.nn.functional.silu`)."""
    while isinstance(func, ast.Attribute):
        func = func.value
    return func


_NAMESPACE_MODULES = {
    "torch": "torch",
    "F": "torch.nn.functional",
    "functional": "torch.nn.functional",
    "nn": "torch.nn",
}


@functools.cache
def _inplace_position(root: str, chain: tuple[str, ...]) -> int | None:
    """Position of the `inplace` parameter of the function `root.<chain>` resolves to
    (`F.relu` -> 1), or None when it has none or does not resolve."""
    module_name = _NAMESPACE_MODULES.get(root)
    if module_name is None:
        return None
    try:
        target: object = importlib.import_module(module_name)
        for attr in chain:
            target = getattr(target, attr)
        parameters = list(inspect.signature(target).parameters.values())  # type: ignore[arg-type]
    except (AttributeError, ImportError, TypeError, ValueError):
        return None
    for position, parameter in enumerate(parameters):
        if parameter.name == "inplace":
            return position if parameter.kind is parameter.POSITIONAL_OR_KEYWORD else None
    return None


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


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


def namespace_root(func: ast.expr) -> str | None:
    """`torch` for `torch.nn.functional.silu`, `F` for `F.silu`; None for other chains."""
    node = chain_root(func)
    return node.id if isinstance(node, ast.Name) and node.id in PURE_NAMESPACES else None


def known_pure(call: ast.Call, module: nn.Module | None, shadowed: Iterable[str] = ()) -> bool:
    """Is `call` known to write through none of its arguments or its receiver?

    `shadowed` holds builtin and namespace names the forward rebinds locally: a call through
    one of those is not the function the tables here describe.
    """
    if writes_through_args(call):
        return False
    func = call.func
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
            and has_hooks(child) is None
        )
    root = namespace_root(func)
    if root is not None:
        if root in shadowed:
            return False
        chain = func_chain(func)
        if root == "torch" and chain and chain[0] in IMPURE_TORCH_NAMESPACES:
            return False
        return not (root == "operator" and func.attr in MUTATING_OPERATORS)
    import torch  # deferred: only the method table is needed, once

    # A tensor method that is not in-place returns a new tensor or a view; the view is
    # tracked by `aliasing_names`, never written here.
    return hasattr(torch.Tensor, func.attr) and func.attr not in {"data", "register_hook"}


def written_names(
    region: Iterable[ast.stmt], module: nn.Module | None = None, shadowed: Iterable[str] = ()
) -> set[str]:
    """Names that executing `region` may rebind, delete, or write through.

    Rebinding in any form (`x = ...`, `del x`, `for x in`, `x += 1`, `with ... as x`,
    `except ... as x`, `import ... as x`, `def x`, `match ... case x`), writes through a name
    or anything it may alias (`x[i] = v`, `x.a = v`, `torch.flatten(x)[0] = v`), in-place
    spellings (`x.op_()`, `torch.op_(x)`, `x.__iadd__(v)`, `operator.iadd(x, v)`, `out=x`,
    `inplace=True` by keyword or position), a statement whose result is discarded (it can
    only be there for a side effect), and every call not known to be pure: those write every
    name their arguments and receiver may alias. `EVERYTHING` is included when the region
    can reach locals by name (`exec`, `locals()`, a frame's `f_locals`, `global`).
    """
    rebound, through = _effects(region, module, frozenset(shadowed))
    return rebound | through


def _effects(
    region: Iterable[ast.stmt], module: nn.Module | None, shadowed: frozenset[str]
) -> tuple[set[str], set[str]]:
    """`written_names` split in two: names the region may rebind or delete (which changes
    nothing another name sees), and names it may write *through* (which changes the value
    of every alias: in-place calls, item/attribute stores, augmented assignment)."""
    rebound: set[str] = set()
    through: set[str] = set()
    for stmt in region:
        for node in ast.walk(stmt):
            if is_opaque(node, shadowed) or isinstance(node, (ast.Global, ast.Nonlocal)):
                through.add(EVERYTHING)
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                rebound.add(node.id)
            elif isinstance(node, ast.AugAssign):
                # `t += v` is in place for tensors: a write through `t`, not only a rebinding.
                through |= store_names(node.target)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(
                node.ctx, (ast.Store, ast.Del)
            ):
                through |= _written_through(node, module)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                rebound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                rebound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                rebound.add(node.name)
            elif isinstance(node, ast.pattern):
                rebound |= match_captures(node)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                through |= _call_reads(node.value, module)
            elif isinstance(node, ast.Call):
                if isinstance(node.func, ast.Attribute) and is_inplace_name(node.func.attr):
                    root = _root_name(node.func.value)
                    if root:
                        through.add(root)
                if not known_pure(node, module, shadowed):
                    through |= _call_reads(node, module)
    return rebound, through


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
    when no name it reads can be rebound in the region, and no name that may alias one can be
    written through (rebinding an alias, `h = x.view(-1); h = y`, changes no storage).

    Assumed, not checked: at entry the forward's arguments do not share storage with each
    other or with state reachable from `self` or globals (a serving engine passes fresh
    activations). Aliasing created inside the forward is tracked in full.
    """
    names = input_names(input_expr)
    shadowed = _shadowed(funcdef)
    tracked = _aliasing(funcdef, names, module, shadowed)
    rebound, through = _effects(region, module, shadowed)
    if EVERYTHING in through:
        raise RewriteRefused("the region between projections can write any local (exec/locals)")
    if EVERYTHING in tracked and through:
        raise RewriteRefused(
            "the projection input may be any local (exec/locals) and the region writes "
            f"through {', '.join(sorted(through))}"
        )
    # Rebinding an alias leaves the input's storage alone; rebinding a name the input
    # expression reads changes the input itself.
    hit = sorted((tracked & through) | (names & rebound))
    if hit:
        raise RewriteRefused(
            f"projection input may change between the projection calls (written: {', '.join(hit)})"
        )


# -- write-free methods ------------------------------------------------------------------


def check_write_free(module: nn.Module, name: str = "forward", depth: int = 0) -> None:
    """Refuse unless `module`'s `name` method (and the helper methods it calls on `self`)
    provably writes no tensor: no augmented assignment, no store through a subscript or
    attribute, and no call that may write its arguments (`fusion.alias` decides which calls
    are pure).

    The traced graph cannot show a write: fx records `h *= s` as `h = h * s`, and a
    discarded in-place call (`F.relu(x, inplace=True)`) has no user in the dataflow. Yet with
    a float32 input `x.to(torch.float32)` is `x` itself, so such a write changes the caller's
    tensor (a residual kept before the norm) and every later read of it, while FusedRMSNorm
    is a pure function of its input. No Transformers RMSNorm writes anything.
    """
    cls = type(module)
    if depth > 3:
        raise RewriteRefused(f"{cls.__name__}.{name}: helper calls nest too deeply to check")
    funcdef = method_source(cls, name)
    shadowed = local_names(funcdef) & (PURE_BUILTINS | PURE_NAMESPACES)
    for node in ast.walk(funcdef):
        if isinstance(node, ast.AugAssign):
            raise RewriteRefused(
                f"{cls.__name__}.{name} has an augmented assignment (may write a tensor in place)"
            )
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            raise RewriteRefused(f"{cls.__name__}.{name} stores through a subscript or attribute")
        if not isinstance(node, ast.Call) or known_pure(node, module, shadowed):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
            and inspect.isfunction(getattr(cls, func.attr, None))
            and not writes_through_args(node)
        ):
            check_write_free(module, func.attr, depth + 1)  # a helper such as Gemma's _norm
            continue
        raise RewriteRefused(
            f"{cls.__name__}.{name} calls {ast.unparse(func)}, which may write its arguments"
        )

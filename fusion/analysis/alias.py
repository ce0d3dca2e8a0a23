"""May-alias and may-write analysis over a forward's AST.

Merging projections moves every projection's read of its input to the earliest call. That
is only correct when nothing between the earliest and the latest call changes the input's
value: not by rebinding its name, not by writing through it, and not by writing through any
other name that may share its storage (a view, a container holding it, a bound method).

Both halves over-approximate. `aliasing_names` may report names that do not alias, and
`written_names` may report names that are not written; a false hit costs a fusion, a miss
would silently change a model's outputs. Anything the analysis does not understand (an
unknown callee receiving a tracked name, `exec`, a lambda) counts as a write, and so does a
write with no in-place spelling: torch functions that write what they are given
(`namespace_call_writes`: `nn.init.constant`, `torch.utils.swap_tensors`,
`F.embedding(max_norm=)`, `F.batch_norm(training=True)`) and methods named like tensor
methods on something that may be no tensor (`may_be_foreign`: a numpy view's `put`, a
module's `float`). `self.<name>` is what Python resolves it to (`fusion.analysis.name_resolution`),
and nothing of `self` is known in a forward that rebinds it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Callable, Collection, Iterable

import torch
from torch import nn

from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.name_resolution import (
    Kind,
    Resolution,
    resolve,
    resolve_chain,
    self_chain,
    self_is_bound_to_owner,
)
from fusion.analysis.source import method_source
from fusion.errors import RewriteRefused
from fusion.trace.tensor_meta import METADATA_ATTRS, METADATA_METHODS

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

IMPURE_TORCH_NAMESPACES = frozenset(
    {"ops", "distributed", "library", "cuda", "_C", "classes"}
    | {"init", "utils", "func", "autograd", "jit", "compiler", "_dynamo", "fx", "export"}
    | {"_higher_order_ops"}
)
"""Namespaces, anywhere along a `torch`/`nn` call chain, whose functions may write arguments
without an in-place spelling: collectives (`torch.distributed.all_reduce(x)`), custom ops
(`torch.ops`), the deprecated initialisers without the underscore (`nn.init.constant(t, v)`,
`nn.init.normal(t)`, `nn.init.xavier_uniform(t)`: they fill `t` in place), `torch.utils` /
`nn.utils` (`swap_tensors(a, b)` swaps two tensors' contents, `vector_to_parameters(v, ts)`
rebinds each `t.data`, `parametrize` rewrites a module), and the namespaces that call a
function they are given (`torch.func.vmap(f)`, `torch.utils.checkpoint.checkpoint(f, x)`,
`torch.autograd`, `torch.jit`, `torch.compiler`): that callee may write anything."""

WRITING_FUNCTIONS = frozenset(
    {"vmap", "cond", "compile", "while_loop"}
    | {"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update"}
    | {"cudnn_batch_norm", "miopen_batch_norm", "batch_norm_update_stats"}
    | {"fused_moving_avg_obs_fake_quant", "_fused_moving_avg_obs_fq_helper"}
    | {"swap_tensors", "vector_to_parameters"}
)
"""Functions of the pure namespaces that write an argument with no in-place spelling (the
batch-norm kernels update `running_mean`/`running_var`, fake-quant its observers' ranges), or
that call a function they are given (`torch.vmap(f)`, `torch.cond(p, f, g, ops)`,
`torch.compile(f)`): a call of one writes every argument."""

WRITES_UNLESS: dict[str, tuple[str, object]] = {
    "embedding": ("max_norm", None),
    "embedding_bag": ("max_norm", None),
    "batch_norm": ("training", False),
    "instance_norm": ("use_input_stats", False),
}
"""Functions that write an argument unless one parameter is a given literal:
`F.embedding(ids, w, max_norm=m)` renormalises the looked-up rows of `w` in place,
`F.batch_norm(x, mean, var, training=True)` and `F.instance_norm` (whose `use_input_stats`
defaults to True) update the running statistics they are passed. A call writes every
argument unless the parameter is, by keyword or position, that literal, or is left out and
defaults to it (where the signature cannot be read, as for `torch.batch_norm`, it writes)."""

FOREIGN_VIEWS = frozenset(
    {"numpy", "__array__", "__array_interface__", "__cuda_array_interface__", "__dlpack__"}
    | {"untyped_storage", "storage", "_typed_storage"}
)
"""Tensor methods and attributes that hand back an object sharing the tensor's memory that
is no tensor (a numpy array, a storage, a DLPack capsule): its methods named like tensor
methods are not (`arr.put(0, v)`, `arr.sort()`, `arr.resize(n)` write in place), so a
value reached through one is `may_be_foreign`."""

NOT_PURE_TENSOR_METHODS = frozenset(
    {"data", "register_hook", "register_post_accumulate_grad_hook", "backward"}
)
"""`torch.Tensor` attributes that are not out-of-place computations: `data` (a setter),
hook registration, and `backward` (it runs every hook of the graph)."""

STAND_IN = "__fusion_pure_call__"
"""`torch.<STAND_IN>(callee, *arguments)`: what `fusion.fusers.pure_calls` shows this
analysis in place of a call it proved writes nothing and returns nothing foreign (no such
function exists: the analysed copy is never compiled). The proof presumed its parameters
tensors or plain values, so it is pure, and its value not `may_be_foreign`, only when no
argument may be foreign."""

SAFE_CHILD_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Dropout,
    nn.Identity,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Embedding,
)
"""Children whose forward never writes its input or its own state (exact classes only, and
only as `is_safe_child` qualifies them: not `inplace=True`, no `max_norm` on an embedding).
Any other child receiving a tracked value counts as a write."""

EVERYTHING = "*"
"""Member of a written-names set meaning "anything may have been written"."""


# -- alias reads ---------------------------------------------------------------------------


def runs_class_forward(child: nn.Module) -> bool:
    """Does calling `child` run its class's `forward` and nothing else: no hook (a forward
    hook may return, and a pre-hook substitute, any tensor it can reach), `nn.Module`'s call
    path, and no instance-level `forward` (`child.forward = f` makes the call run `f`)?"""
    return (
        has_hooks(child) is None and own_call_path(child) is None and "forward" not in vars(child)
    )


def is_safe_child(child: object) -> bool:
    """Does calling `child` provably write nothing, neither its input nor its own state?

    True for an exact `SAFE_CHILD_TYPES` instance that `runs_class_forward`, was not built
    `inplace=True`, and, for an `nn.Embedding`, has no `max_norm`: such an embedding
    renormalises the rows it looks up in its own weight, in place, on every call."""
    return (
        isinstance(child, nn.Module)
        and type(child) in SAFE_CHILD_TYPES
        and not getattr(child, "inplace", False)
        and getattr(child, "max_norm", None) is None
        and runs_class_forward(child)
    )


def self_callee(func: ast.expr, module: nn.Module | None) -> Resolution | None:
    """What a `self.<name>` callee is (`fusion.analysis.name_resolution.resolve`), or None when `func`
    is not one or `module` is unknown."""
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
        and module is not None
    ):
        return resolve(module, func.attr)
    return None


def _is_self_child_call(node: ast.Call, module: nn.Module | None, types: tuple[type, ...]) -> bool:
    resolved = self_callee(node.func, module)
    if resolved is None:
        return False
    if resolved.raises_when_called:
        return True
    child = resolved.child
    return child is not None and type(child) in types and runs_class_forward(child)


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
    tree: ast.AST,
    module: nn.Module | None,
    shadowed: frozenset[str],
    foreign: Collection[str],
    calls: CallVerdict | None = None,
) -> list[tuple[set[str], ast.AST | None, bool]]:
    """Every (names bound, value expression, mutual) triple in `tree`, whatever the binding
    form.

    Besides plain bindings this includes stores into containers and objects (`lst[0] = x`,
    `self.saved = x`), `match` captures, nested functions and classes, and every call not
    known to be pure: such a call may store any of its arguments into its receiver or into
    another argument (`lst.append(x)`, `d.update(k=x)`), so they all may alias each other
    (`mutual`: the names are not bound to the call's value, they may hold one another).
    """
    pairs: list[tuple[set[str], ast.AST | None, bool]] = []

    def add(stores: set[str], value: ast.AST | None) -> None:
        pairs.append((stores, value, False))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            add(set().union(*(_targets(t, module) for t in node.targets)), node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            value = node.value
            if isinstance(node, ast.AugAssign):
                # `t += v` keeps `t`'s storage for tensors and may merge `v` into it.
                value = ast.Tuple(
                    elts=[ast.Name(id=_root_name(node.target) or "", ctx=ast.Load()), node.value],
                    ctx=ast.Load(),
                )
            add(_targets(node.target, module), value)
        elif isinstance(node, ast.NamedExpr):
            add(store_names(node.target), node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            add(_targets(node.target, module), node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            add(_targets(node.optional_vars, module), node.context_expr)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                add(match_captures(case.pattern), node.subject)
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not tree
        ):
            # A nested function closes over (so aliases) whatever its body reads.
            add({node.name}, node)
        elif isinstance(node, ast.Call) and not known_pure(node, module, shadowed, foreign, calls):
            pairs.append((_call_reads(node, module) - {EVERYTHING}, node, True))
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


def _shadowed(funcdef: ast.AST) -> frozenset[str]:
    return frozenset(local_names(funcdef) & (PURE_BUILTINS | PURE_NAMESPACES))  # type: ignore[arg-type]


CallVerdict = Callable[[ast.Call, Collection[str]], bool | None]
"""A reader's own answer to "may this call's value be foreign?" (given the names foreign so
far): True or False for a call it reads itself (`fusion.analysis.value_roots` reads helpers), None to
leave the call to `may_be_foreign`."""


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
        parts: list[ast.AST]
        if isinstance(node, ast.IfExp):
            parts = [node.body, node.orelse]
        elif isinstance(node, ast.BoolOp):
            parts = list(node.values)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            parts = list(node.elts)
        elif isinstance(node, ast.Dict):
            parts = list(node.values)
        elif isinstance(node, ast.BinOp):
            # Arithmetic makes a new value (`arr * 2` is a new array: writing it writes
            # nothing bound); only concatenating or repeating a sequence display holds its
            # elements.
            sequences = (ast.Tuple, ast.List)
            if not (isinstance(node.left, sequences) or isinstance(node.right, sequences)):
                return False
            parts = [node.left, node.right]
        else:
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


def foreign_names(
    tree: ast.AST,
    module: nn.Module | None,
    globals_too: bool = True,
    calls: CallVerdict | None = None,
) -> frozenset[str]:
    """Names of `tree` that may hold something no tensor (`may_be_foreign`): with
    `globals_too`, every global it reads other than the pure namespaces and builtins
    (`np`, a helper module); and, to a fixed point, every name a binding form binds to a
    value that may be foreign (`a = x.numpy()`, `for r in arr`, `z = np.asarray(x)`), and
    every name a call not known pure may make hold a foreign one (`box.append(a)`).
    The function's own parameters are presumed tensors or plain values: at entry a forward
    receives activations, and a callee is read only where its arguments are not foreign.
    `calls` answers for the calls the caller reads itself (`CallVerdict`)."""
    shadowed = _shadowed(tree)
    local = local_names(tree)  # type: ignore[arg-type]
    foreign: set[str] = set()
    if globals_too:
        known = (PURE_NAMESPACES | PURE_BUILTINS) - shadowed
        foreign = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and node.id not in local and node.id not in known
        }
    changed = True
    while changed:
        changed = False
        for stores, value, mutual in _bindings(tree, module, shadowed, frozenset(foreign), calls):
            if mutual and isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                stores = stores - {value.func.id}  # the callee holds none of its arguments
            if stores <= foreign:
                continue
            if mutual:
                hit = bool(stores & foreign)
            else:
                hit = value is not None and may_be_foreign(value, module, foreign, shadowed, calls)
            if hit:
                foreign |= stores
                changed = True
    return frozenset(foreign)


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
    if not self_is_bound_to_owner(funcdef):
        module = None  # `self` may be another object: none of its attributes are known
    foreign = foreign_names(funcdef, module)
    return _aliasing(funcdef, seed, module, _shadowed(funcdef), foreign)


def _aliasing(
    funcdef: ast.FunctionDef,
    seed: Iterable[str],
    module: nn.Module | None,
    shadowed: frozenset[str],
    foreign: Collection[str],
) -> set[str]:
    names = set(seed)
    bindings = [
        (stores, alias_reads(value, module))
        for stores, value, _ in _bindings(funcdef, module, shadowed, foreign)
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


def namespace_root(func: ast.expr) -> str | None:
    """`torch` for `torch.nn.functional.silu`, `F` for `F.silu`; None for other chains."""
    node = chain_root(func)
    return node.id if isinstance(node, ast.Name) and node.id in PURE_NAMESPACES else None


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
    Which names may hold something no tensor is read from `region` alone (`foreign_names`
    without its globals: the region's free names are taken for the forward's locals).
    """
    region = list(region)
    foreign = foreign_names(ast.Module(body=region, type_ignores=[]), module, globals_too=False)
    rebound, through = _effects(region, module, frozenset(shadowed), foreign)
    return rebound | through


def _effects(
    region: Iterable[ast.stmt],
    module: nn.Module | None,
    shadowed: frozenset[str],
    foreign: Collection[str],
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
                if not known_pure(node, module, shadowed, foreign):
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

    `self.<name>` is read as Python resolves it (`fusion.analysis.name_resolution`); where that
    depends on code (a property) or the name is ambiguous (a method on the class and a child
    of the same name), and it is read in the region or by the input, the proof refuses. Where
    the forward rebinds `self`, nothing of `self` is known (every call on it may write).

    Assumed, not checked: at entry the forward's arguments do not share storage with each
    other or with state reachable from `self` or globals (a serving engine passes fresh
    activations), and are tensors or plain values (no numpy views). Aliasing created inside
    the forward is tracked in full.
    """
    if not self_is_bound_to_owner(funcdef):
        module = None  # `self = self.other`: `self.<name>` may be any object's attribute
    if module is not None:
        unresolved = _unresolved_self_names([input_expr, *region], module)
        if unresolved:
            raise RewriteRefused(unresolved)
    names = input_names(input_expr)
    shadowed = _shadowed(funcdef)
    foreign = foreign_names(funcdef, module)
    tracked = _aliasing(funcdef, names, module, shadowed, foreign)
    rebound, through = _effects(region, module, shadowed, foreign)
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


def _unresolved_self_names(nodes: Iterable[ast.AST], module: nn.Module) -> str | None:
    """The reason for the first `self.<name>` read in `nodes` that `fusion.analysis.name_resolution`
    cannot resolve without running code or guessing (a property, an ambiguous name), or
    None when every one resolves."""
    for tree in nodes:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                resolved = resolve(module, node.attr)
                if resolved.kind is Kind.UNKNOWN:
                    return resolved.reason
    return None


# -- write-free methods ------------------------------------------------------------------


def check_write_free(module: nn.Module, name: str = "forward", depth: int = 0) -> None:
    """Refuse unless `module`'s `name` method (and the helper methods it calls on `self`)
    provably writes no tensor: no augmented assignment, no store through a subscript or
    attribute, and no call that may write its arguments (`fusion.analysis.alias` decides which calls
    are pure; a method of a helper's result is one of a tensor only where the helper is shown
    to return no foreign value, `may_be_foreign`).

    The traced graph cannot show a write: fx records `h *= s` as `h = h * s`, and a
    discarded in-place call (`F.relu(x, inplace=True)`) has no user in the dataflow. Yet with
    a float32 input `x.to(torch.float32)` is `x` itself, so such a write changes the caller's
    tensor (a residual kept before the norm) and every later read of it, while FusedRMSNorm
    is a pure function of its input. No Transformers RMSNorm writes anything.
    """
    _write_free_returns_foreign(module, name, depth, {})


def _write_free_returns_foreign(
    module: nn.Module, name: str, depth: int, memo: dict[str, bool]
) -> bool:
    """`check_write_free`'s proof of `module.<name>`; returns whether what the method returns
    may be foreign (`may_be_foreign`), so a caller knows whether the result's tensor-named
    methods are tensor methods. `memo` holds the helpers already proven (a recursive one
    counts as returning something foreign until its proof is done)."""
    if name in memo:
        return memo[name]
    memo[name] = True
    cls = type(module)
    if depth > 3:
        raise RewriteRefused(f"{cls.__name__}.{name}: helper calls nest too deeply to check")
    funcdef = method_source(cls, name)
    if not self_is_bound_to_owner(funcdef):
        raise RewriteRefused(
            f"{cls.__name__}.{name} rebinds self (or does not take it first): "
            "what its self.<name> calls run is unknown"
        )
    unresolved = _unresolved_self_names([funcdef], module)
    if unresolved:
        raise RewriteRefused(f"{cls.__name__}.{name}: {unresolved}")
    shadowed = _shadowed(funcdef)

    def helper(call: ast.Call) -> str | None:
        """The name of the `self.<method>` `call` runs, where the proof reads it."""
        resolved = self_callee(call.func, module)
        if resolved is None or resolved.kind is not Kind.METHOD or writes_through_args(call):
            return None
        return call.func.attr  # type: ignore[attr-defined]

    def calls(call: ast.Call, foreign: Collection[str]) -> bool | None:
        method = helper(call)
        if method is None:
            return None
        arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
        return any(
            may_be_foreign(argument, module, foreign, shadowed, calls) for argument in arguments
        ) or _write_free_returns_foreign(module, method, depth + 1, memo)

    foreign = foreign_names(funcdef, module, calls=calls)
    for node in ast.walk(funcdef):
        if isinstance(node, ast.AugAssign):
            raise RewriteRefused(
                f"{cls.__name__}.{name} has an augmented assignment (may write a tensor in place)"
            )
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            raise RewriteRefused(f"{cls.__name__}.{name} stores through a subscript or attribute")
        if not isinstance(node, ast.Call) or known_pure(node, module, shadowed, foreign, calls):
            continue
        method = helper(node)
        if method is not None:
            _write_free_returns_foreign(module, method, depth + 1, memo)  # Gemma's `_norm`
            continue
        raise RewriteRefused(
            f"{cls.__name__}.{name} calls {ast.unparse(node.func)}, which may write its arguments"
        )
    memo[name] = any(
        may_be_foreign(node.value, module, foreign, shadowed, calls)
        for node in ast.walk(funcdef)
        if isinstance(node, ast.Return) and node.value is not None
    )
    return memo[name]

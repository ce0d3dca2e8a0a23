"""The vocabulary of the alias and write analyses (`fusion.analysis.alias`): which
namespaces, builtins and methods are pure, opaque, in place or foreign, and the AST helpers
every analysis shares (roots and chains of names, stores, pattern captures, locals, and what
an expression may hand back: `alias_reads`).

Everything here over-approximates: a name that may be read is read, a callable that may reach
any local is opaque (`is_opaque`); the analyses above it count what they do not understand as
a write.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from torch import nn

from fusion.analysis.callpath import has_hooks, own_call_path
from fusion.analysis.name_resolution import (
    Resolution,
    resolve,
)
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


def written_through(target: ast.AST, module: nn.Module | None) -> set[str]:
    """Names of the objects a store or `del` into `target` writes through: `c[k] = v` and
    `o.a = v` write `c` and `o`, and whatever the written object may alias
    (`torch.flatten(x)[0] = v` writes `x`, `(a if c else b)[0] = v` writes both)."""
    names: set[str] = set()
    for node in ast.walk(target):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            names |= alias_reads(node.value, module)
            root = root_name(node)
            if root:
                names.add(root)
    return names


def target_names(target: ast.AST, module: nn.Module | None) -> set[str]:
    """Names a binding to `target` may make alias the bound value: the names it binds and
    the containers or objects it stores into (`lst[0] = x` makes `lst` hold `x`)."""
    return store_names(target) | written_through(target, module)


def match_captures(pattern: ast.AST) -> set[str]:
    """Names a `match` case pattern binds (`case y`, `case [*rest]`, `case {**rest}`)."""
    names: set[str] = set()
    for node in ast.walk(pattern):
        if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return names


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


def shadowed_names(funcdef: ast.AST) -> frozenset[str]:
    return frozenset(local_names(funcdef) & (PURE_BUILTINS | PURE_NAMESPACES))  # type: ignore[arg-type]


# -- writes ----------------------------------------------------------------------------------


def root_name(node: ast.AST) -> str | None:
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


def namespace_root(func: ast.expr) -> str | None:
    """`torch` for `torch.nn.functional.silu`, `F` for `F.silu`; None for other chains."""
    node = chain_root(func)
    return node.id if isinstance(node, ast.Name) and node.id in PURE_NAMESPACES else None


def call_reads(call: ast.Call, module: nn.Module | None) -> set[str]:
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

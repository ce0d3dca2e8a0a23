"""Which split pieces of a merged GEMM must be made contiguous, or fresh, to behave like
the originals.

A projection returns a contiguous tensor; a piece of the merged output split along the last
dimension is a strided view of it. Most code cannot tell the difference, but a `.view` that
merges the last dimension with another fails on the piece, and `is_contiguous()` answers
differently. Rather than guess, each piece is replayed through the traced graph on meta
tensors with its real (strided) layout: wherever the replay raises, or a value still aliasing
the piece is returned or asked about its layout, that piece gets `.contiguous()`.

A piece is also a view of a multi-output op, and under autograd neither it nor any view of
it may be written in place ("Output 0 of SplitWithSizes is a view and is being modified
inplace"), while the projection's own output may (OLMo clamps q/k/v in place, rotary
embeddings are written back, queries are scaled with `q *= s`). A piece that may be written,
directly or through anything holding or viewing it, therefore becomes a copy of its own
(FRESH; `stacked.make_fresh`): a new, non-view tensor with standard contiguous strides, like
the projection's. So does a piece whose layout is asked (`stride()`, `untyped_storage()`,
...) or that is returned: `.contiguous()` hands back the piece itself where it already
counts as contiguous (size-1 leading dimensions), merged strides and storage included. Writes are found twice, because neither
view is complete: the replay sees every traced write (an in-place op bumps the merged
tensor's version counter, even on meta), and `written_pieces` reads the rewritten source for
the writes fx cannot record (`q *= s` is traced as `q = q * s`) or that sit on paths the trace
did not take (a branch on a config flag, the KV-cache branch). The source half fails closed:
an expression it does not understand may alias whatever it reads, and a call it cannot read
may write whatever it is passed (see the section below). Under `no_grad` a write to a piece
changes exactly what a write to the projection's output would, so a copy never changes a
value: a false alarm costs one copy.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fusion import alias
from fusion.callpath import has_hooks, own_call_path
from fusion.graph import is_leaf_call, output_value
from fusion.trace import CACHE_ARGUMENTS, META_VALUE

LAYOUT_QUESTIONS = frozenset(
    {"is_contiguous", "data_ptr", "stride", "storage", "untyped_storage", "numpy", "storage_offset"}
)
"""Methods whose answer differs between a contiguous tensor and a strided piece."""


VIEW_OPS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "as_strided",
        "detach",
        "diagonal",
        "expand",
        "expand_as",
        "movedim",
        "moveaxis",
        "narrow",
        "permute",
        "select",
        "squeeze",
        "transpose",
        "t",
        "unfold",
        "unsqueeze",
        "unbind",
        "split",
        "split_with_sizes",
        "chunk",
        "tensor_split",
        "swapaxes",
        "swapdims",
        "getitem",
        "contiguous",
        "to",
        "type",
        "type_as",
        "float",
        "half",
        "bfloat16",
        "double",
        "real",
        "imag",
        "view_as_real",
        "view_as_complex",
        "T",
        "mT",
        "H",
        "mH",
    }
)
"""Ops that may return (a view of) their input rather than new storage."""


def _op_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _aliases(value: object, piece: torch.Tensor) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "meta" and torch._C._is_alias_of(value, piece)
    if isinstance(value, (tuple, list)):
        return any(_aliases(item, piece) for item in value)
    return False


def _value(arg: object, values: dict[fx.Node, object]) -> object:
    def lookup(item: object) -> object:
        if isinstance(item, fx.Node):
            if item in values:
                return values[item]
            if META_VALUE not in item.meta:
                raise LookupError(f"no meta value for {item.name}")
            return item.meta[META_VALUE]
        return item

    return fx.node.map_aggregate(arg, lookup)


def _run(node: fx.Node, module: nn.Module, values: dict[fx.Node, object]) -> object:
    args, kwargs = _value(node.args, values), _value(node.kwargs, values)
    if node.op == "call_function":
        return node.target(*args, **kwargs)  # type: ignore[operator]
    if node.op == "call_method":
        receiver, *rest = args
        return getattr(receiver, str(node.target))(*rest, **kwargs)
    child = module.get_submodule(str(node.target))
    state = {
        name: torch.empty_like(tensor, device="meta")
        for name, tensor in [*child.named_parameters(), *child.named_buffers()]
    }
    return torch.func.functional_call(child, state, tuple(args), kwargs)


OK, CONTIGUOUS, FRESH = "ok", "contiguous", "fresh"
"""Verdicts on a piece: usable as split, needs `.contiguous()`, needs a copy of its own
(`stacked.make_fresh`)."""


def _piece_verdict(graph: fx.Graph, module: nn.Module, node: fx.Node, piece: torch.Tensor) -> str:
    values: dict[fx.Node, object] = {node: piece}
    queue = list(node.users)
    seen: set[fx.Node] = set()
    version = piece._version
    verdict = OK
    while queue:
        user = queue.pop(0)
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output":
            # A view of the piece escapes: the caller may write it, or ask its layout.
            return FRESH
        if is_leaf_call(user):
            continue  # attention kernels take strided inputs; nothing after sees the piece
        if user.op == "call_method" and user.target in LAYOUT_QUESTIONS:
            # Only a copy of its own answers like the projection's output: `.contiguous()`
            # returns the piece itself where it already counts as contiguous (size-1 leading
            # dimensions), with the merged tensor's strides and storage.
            return FRESH
        try:
            result = _run(user, module, values)
        except LookupError:
            # Another input is unknown (e.g. rotary tables): a new-storage op (arithmetic)
            # ends the piece's reach; an op that may be a view cannot be checked.
            if user.op == "call_module" or _op_name(user) in VIEW_OPS:
                verdict = CONTIGUOUS
            continue
        except Exception:
            verdict = CONTIGUOUS
            continue
        if piece._version != version:
            return FRESH  # the op wrote the piece (or a view of it) in place
        if _aliases(result, piece):
            values[user] = result
            queue.extend(user.users)
    return verdict


def piece_verdicts(graph: fx.Graph, module: nn.Module, nodes: Sequence[fx.Node]) -> tuple[str, ...]:
    """For each projection call node, in order: OK, CONTIGUOUS or FRESH (see the module
    docstring). All CONTIGUOUS when the trace is partial or a node has no meta value: uses
    not seen cannot be proven layout-agnostic (`written_pieces` still covers writes)."""
    shapes = [node.meta.get(META_VALUE) for node in nodes]
    if output_value(graph) is None or not all(isinstance(s, torch.Tensor) for s in shapes):
        return (CONTIGUOUS,) * len(nodes)
    widths = [int(s.shape[-1]) for s in shapes]  # type: ignore[union-attr]
    lead = tuple(shapes[0].shape[:-1])  # type: ignore[union-attr]
    merged = torch.empty(*lead, sum(widths), device="meta", dtype=shapes[0].dtype)  # type: ignore[union-attr]
    pieces = merged.split(widths, dim=-1)
    return tuple(_piece_verdict(graph, module, node, piece) for node, piece in zip(nodes, pieces))


def needs_contiguous(
    graph: fx.Graph, module: nn.Module, nodes: Sequence[fx.Node]
) -> tuple[bool, ...]:
    """For each projection call node, in order: must its piece be made contiguous (or
    fresh, which is contiguous too)?"""
    return tuple(verdict != OK for verdict in piece_verdicts(graph, module, nodes))


# -- writes spelled in the source ---------------------------------------------------------------
#
# The source half is flow-insensitive and fails closed in both of its questions. "Which names
# may hold a piece (a view of it, or a container or object holding one)?" counts every
# expression form not known to yield new storage as aliasing whatever it reads. "Which names
# may be written through?" counts every write spelling, and every call not known to leave its
# arguments alone as writing all of them. Calls of plain Python functions, of `self`'s methods
# and of `self`'s children are read (recursively, to MAX_CALL_DEPTH) instead of presumed to
# write, so that `apply_rotary_pos_emb(q, k, cos, sin)` or a q/k norm does not cost a copy.

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

PURE_NAME_BUILTINS = frozenset(
    {
        "len",
        "isinstance",
        "issubclass",
        "int",
        "float",
        "bool",
        "str",
        "range",
        "hasattr",
        "type",
        "round",
        "divmod",
        "pow",
        "any",
        "all",
        "print",
        "repr",
        "id",
        "hash",
        "callable",
    }
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

_EVERYTHING = alias.EVERYTHING


@dataclass(frozen=True)
class _Summary:
    """What a call of one Python function may do to its parameters."""

    writes: frozenset[str] = frozenset()
    """Parameters it may write through (directly or by passing them on)."""
    joins: tuple[frozenset[str], ...] = ()
    """Groups of parameters it may make hold one another (`box.append(t)`)."""
    returns: frozenset[str] = frozenset()
    """Parameters its result may hold (a view of, or a container with, their value)."""
    opaque: bool = False
    """Unreadable: it may write and return every argument and make them hold one another."""


_OPAQUE = _Summary(opaque=True)
_PURE = _Summary()


def _names_read(node: ast.AST | None) -> set[str]:
    """Every name `node` reads: the fail-closed roots of an expression not understood."""
    if node is None:
        return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


class _Scope:
    """One function under analysis: its AST, the module `self` is (None for a plain
    function), the globals its names resolve in, its depth in the call chain, and a memo of
    callee summaries shared by the whole analysis, so each callee is read once."""

    def __init__(
        self,
        funcdef: ast.FunctionDef | ast.AsyncFunctionDef,
        module: nn.Module | None,
        namespace: dict[str, Any],
        depth: int,
        memo: dict[Any, _Summary],
    ) -> None:
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

    def is_global(self, name: str) -> bool:
        """Does `name` refer to the module-level (or builtin) object, unshadowed locally?"""
        return name not in self.locals


def _namespace(func: ast.expr, scope: _Scope) -> str | None:
    """`torch`, `F`, `operator`... when `func` is a function of such a namespace."""
    root = alias._namespace_root(func)
    return root if root is not None and scope.is_global(root) else None


def _self_attr(func: ast.expr, scope: _Scope) -> tuple[bool, Any]:
    """(True, the attribute's value) for a `self.<name>` callee when `self` is known."""
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
        and scope.module is not None
    ):
        return True, getattr(scope.module, func.attr, None)
    return False, None


def _is_tensor_method(func: ast.expr, scope: _Scope) -> bool:
    """Is `func` spelled as a public `torch.Tensor` method on something other than `self`?"""
    return (
        isinstance(func, ast.Attribute)
        and not _self_attr(func, scope)[0]
        and hasattr(torch.Tensor, func.attr)
        and not func.attr.startswith("_")
        and func.attr not in {"register_hook", "apply_", "map_", "map2_", "data"}
    )


def _is_builtin(call: ast.Call, scope: _Scope, table: frozenset[str]) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Name)
        and func.id in table
        and scope.is_global(func.id)
        and not any(keyword.arg == "key" for keyword in call.keywords)
    )


def _roots(node: ast.AST | None, scope: _Scope) -> set[str]:
    """The names whose storage the value of `node` may share, or whose value it may hold (a
    tuple holding a view of `q` has root `q`). Empty only for what is known to be new
    storage or no tensor at all; a form not understood has every name it reads as roots."""
    if node is None or isinstance(node, (ast.Constant, ast.JoinedStr, ast.Compare)):
        return set()
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        if node.attr in alias.METADATA_ATTRS:
            return set()
        return _roots(node.value, scope)  # `q.T`, `q.data`, `self.saved`
    if isinstance(node, (ast.Subscript, ast.Starred)):
        return _roots(node.value, scope)
    if isinstance(node, ast.IfExp):
        return _roots(node.body, scope) | _roots(node.orelse, scope)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_roots(value, scope) for value in node.values))
    if isinstance(node, ast.NamedExpr):
        return _roots(node.value, scope)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_roots(element, scope) for element in node.elts))
    if isinstance(node, ast.Dict):
        return set().union(*(_roots(part, scope) for part in [*node.keys, *node.values]))
    if isinstance(node, ast.UnaryOp):
        return set()  # `-q`, `~m`, `not c`: new values
    if isinstance(node, ast.BinOp):
        # Tensor arithmetic returns new storage, but `+` and `*` also concatenate and repeat
        # sequences (`[q] + [k]`, `(q,) * 2`), which hold their operands' elements. Neither
        # can involve a tensor operand, or a float; `+` cannot involve a number at all.
        if not isinstance(node.op, (ast.Add, ast.Mult)):
            return set()
        for operand in (node.left, node.right):
            if _is_tensor_valued(operand, scope) or (
                isinstance(operand, ast.Constant)
                and (isinstance(operand.value, (float, complex)) or isinstance(node.op, ast.Add))
            ):
                return set()
        return _roots(node.left, scope) | _roots(node.right, scope)
    if isinstance(node, ast.Call):
        return _call_roots(node, scope)
    return _names_read(node)  # lambdas, comprehensions, awaits...: whatever they read


CONTAINER_METHODS = frozenset(
    {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add"}
    | {"setdefault", "get", "items", "keys", "values", "copy", "discard", "index", "count"}
)
"""Methods of lists, dicts and sets: they add, remove or hand back elements, never write one."""

NON_TENSOR_METHODS = alias.METADATA_METHODS | {"item", "tolist", "numpy", "__len__"}
"""Tensor methods whose result is a Python value (a number, a list), not a tensor."""


def _is_tensor_valued(node: ast.expr, scope: _Scope) -> bool:
    """Is `node` certainly a tensor (never a sequence or an int): a `torch.*` or `F.*` call
    other than a metadata query, a tensor method call other than `NON_TENSOR_METHODS`, or
    arithmetic or a comparison with such an operand?"""
    if isinstance(node, ast.UnaryOp):
        return _is_tensor_valued(node.operand, scope)
    if isinstance(node, ast.BinOp):
        return _is_tensor_valued(node.left, scope) or _is_tensor_valued(node.right, scope)
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    name = node.func.attr
    if name in NON_TENSOR_METHODS or name.startswith("_"):
        return False
    namespace = _namespace(node.func, scope)
    if namespace in ("math", "operator"):
        return False
    if namespace is not None:
        return name not in {"is_tensor", "numel", "is_floating_point", "get_default_dtype"}
    receiver = node.func.value
    # A method of something that is itself certainly a tensor, or a view method (whatever
    # the receiver, only a tensor has `.view`/`.transpose`/...).
    return _is_tensor_method(node.func, scope) and (
        _is_tensor_valued(receiver, scope) or name in VIEW_OPS
    )


def _arguments(call: ast.Call) -> list[ast.expr]:
    return [*call.args, *(keyword.value for keyword in call.keywords)]


def _call_roots(call: ast.Call, scope: _Scope) -> set[str]:
    """`_roots` of a call's result."""
    func = call.func
    every = set().union(*(_roots(argument, scope) for argument in _arguments(call)))
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if isinstance(func, ast.Attribute) and name in alias.METADATA_METHODS:
        return set()
    viewing = name in VIEW_OPS or name in MAY_RETURN_INPUT or alias.is_inplace_name(name)
    namespace = _namespace(func, scope)
    if namespace == "operator":
        return every  # `operator.getitem(q, 0)`, `operator.iconcat(lst, [q])`
    if namespace is not None:
        if viewing:
            return _roots(call.args[0], scope) if call.args else every
        return set()  # `torch.cat`, `F.silu`, `torch.matmul`: new storage
    is_self, child = _self_attr(func, scope)
    if is_self and child is None:
        return set()  # calling a missing attribute raises: nothing is returned
    if is_self and type(child) in FRESH_CHILD_TYPES and has_hooks(child) is None:
        return set()  # a GEMM, a norm, a lookup: a new tensor
    resolved = _resolve(call, scope) if is_self or isinstance(func, ast.Name) else None
    if resolved is not None and resolved[0] is not _no_writes:
        fn, module, bound = resolved
        summary = _summary(fn, module, scope)
        binding = None if summary.opaque else _bind(call, fn, bound, scope)
        if binding is not None:
            return set().union(*(binding.get(param, set()) for param in summary.returns))
        return every | _roots(func, scope)
    if is_self and isinstance(child, nn.Module):
        return every  # `nn.Identity`, `nn.Dropout` in eval return their input
    if isinstance(func, ast.Attribute) and not is_self:
        receiver = _roots(func.value, scope)
        if viewing:
            return receiver | (every if name == "set_" else set())
        if _is_tensor_method(func, scope):
            return set()  # a tensor method that is no view: new storage
        return receiver | every
    if _is_builtin(call, scope, PURE_NAME_BUILTINS):
        return set()
    if _is_attention_lookup(func, scope, set()):
        return set()  # an attention interface returns new tensors (output, weights)
    return every | _roots(func, scope)  # an unknown callee may return (part of) anything


def _call_effects(call: ast.Call, scope: _Scope) -> tuple[set[str], list[set[str]]]:
    """(names `call` may write through, groups of names it may make hold one another)."""
    key = id(call)
    if key not in scope.effects:
        scope.effects[key] = _compute_call_effects(call, scope)
    return scope.effects[key]


def _compute_call_effects(call: ast.Call, scope: _Scope) -> tuple[set[str], list[set[str]]]:
    func = call.func
    every = set().union(*(_roots(argument, scope) for argument in _arguments(call)))
    unknown = every | _roots(func, scope)  # receiver included: `obj.method(...)`
    namespace = _namespace(func, scope)
    # `**options` may carry `out=` or `inplace=True`; a `*args` splat matters only where
    # `inplace` is positional, which `writes_through_args` checks.
    splat = any(keyword.arg is None for keyword in call.keywords)
    outs = [keyword.value for keyword in call.keywords if keyword.arg == "out"]
    spelled = ast.Call(
        func=func,
        args=call.args,
        keywords=[k for k in call.keywords if k.arg not in (None, "out")],
    )
    in_place = alias.writes_through_args(spelled)
    if not in_place and not outs and _trusted_call(call, scope):
        return set(), []
    if in_place or outs or (splat and _resolve(call, scope) is None):
        written = set().union(*(_roots(out, scope) for out in outs))
        if in_place:
            if isinstance(func, ast.Attribute) and namespace is None:
                written |= _roots(func.value, scope)
                if not _is_tensor_method(func, scope):
                    written |= every  # an in-place method of something else: any argument
            else:
                written |= _roots(call.args[0], scope) if call.args else every
                if namespace is None:
                    written |= every  # a function of ours spelled in place: any argument
        if splat:
            written |= every  # a splat may carry `out=` or the written operand anywhere
        if namespace is None and not _is_tensor_method(func, scope):
            return written | unknown, [unknown]
        return written, []
    if namespace == "operator":
        if getattr(func, "attr", "") in alias.MUTATING_OPERATORS:
            return (_roots(call.args[0], scope) if call.args else every), [every]
        return set(), []
    if namespace is not None:
        chain = alias._func_chain(func)
        if namespace == "torch" and chain and chain[0] in alias.IMPURE_TORCH_NAMESPACES:
            return every, [every]
        return set(), []
    if _is_tensor_method(func, scope) and func.attr in CONTAINER_METHODS:
        # `s.add(q)` on a set, or `a.add(q)` on a tensor (new storage): the receiver may
        # come to hold the argument; neither writes it.
        return set(), [unknown]
    if _is_builtin(call, scope, NON_WRITING_BUILTINS) or _is_tensor_method(func, scope):
        return set(), []
    is_self, child = _self_attr(func, scope)
    if is_self and child is None:
        return set(), []  # calling a missing attribute raises before anything is written
    if (
        isinstance(func, ast.Attribute)
        and func.attr in CONTAINER_METHODS
        and not is_self
        and _is_box(func.value, scope)
    ):
        return set(), [unknown]  # `kwargs.pop(...)`, `box.append(q)`: holds, never writes
    resolved = _resolve(call, scope)
    if resolved is None:
        return unknown, [unknown]
    fn, module, bound = resolved
    summary = _summary(fn, module, scope)
    binding = _bind(call, fn, bound, scope) if not summary.opaque else None
    if binding is None:
        return unknown, [unknown]
    written = set().union(*(binding.get(param, set()) for param in summary.writes))
    groups = [
        set().union(*(binding.get(param, set()) for param in group)) for group in summary.joins
    ]
    return written, [group for group in groups if group]


def _trusted_call(call: ast.Call, scope: _Scope) -> bool:
    """Is `call` an attention interface looked up at run time, or a KV-cache update?

    Both are trusted, not read, as the rest of fusion already trusts them: the tracer
    records attention interfaces as opaque leaves and the layout replay lets strided
    pieces through them, since every Transformers attention kernel reads q/k/v without
    writing them; a Transformers `Cache.update(key_states, value_states, ...)` (and its
    `update_conv_state`/`update_recurrent_state` kin) copies or concatenates the new
    states into storage of its own. So is an activation looked up in Transformers'
    `ACT2FN` registry (`ACT2FN[name](x)`): its activations are out of place. Module-level functions are read
    instead (`_resolve`); trusted is only what cannot be read: `ALL_ATTENTION_FUNCTIONS[...]`
    and `.get_interface(...)` lookups, a local bound to nothing but those and readable
    attention functions that write nothing, and `.update` on the cache argument."""
    func = call.func
    if isinstance(func, ast.Attribute) and (
        func.attr == "update" or func.attr.startswith("update_")
    ):
        return _is_cache(func.value, scope, set())
    if (
        isinstance(func, ast.Subscript)
        and isinstance(func.value, ast.Name)
        and func.value.id == "ACT2FN"
        and scope.is_global("ACT2FN")
    ):
        return True  # Transformers' activation registry: functional activations
    # The lookup itself reads a registry; its result is an interface.
    return _is_attention_lookup(call, scope, set()) or _is_attention_lookup(func, scope, set())


def _is_cache(node: ast.expr, scope: _Scope, seen: set[str]) -> bool:
    """Is `node` the cache argument, or reached from it only (`cache.self_attention_cache`,
    a local bound to nothing else)?"""
    roots = _roots(node, scope)
    if not roots:
        return False
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        if root in CACHE_ARGUMENTS and root not in scope.local_values:
            continue
        values = scope.local_values.get(root)
        if not values or not _bound_only_by_assignment(root, scope):
            return False
        if not all(_is_cache(value, scope, seen) for value in values):
            return False
    return True


def _bound_only_by_assignment(name: str, scope: _Scope) -> bool:
    """Is every binding of `name` a plain `name = value` (no loop, walrus, unpacking)?"""
    stores = sum(
        isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id == name
        for n in ast.walk(scope.funcdef)
    )
    return stores == len(scope.local_values.get(name, ()))


def _is_attention_lookup(node: ast.expr, scope: _Scope, seen: set[str]) -> bool:
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
    if not _bound_only_by_assignment(node.id, scope):
        return False
    for value in scope.local_values[node.id]:
        if _is_attention_lookup(value, scope, seen):
            continue
        fn = scope.namespace.get(value.id) if isinstance(value, ast.Name) else None
        if not (
            isinstance(value, ast.Name)
            and scope.is_global(value.id)
            and inspect.isfunction(fn)
            and not _summary(inspect.unwrap(fn), None, scope).writes
            and not _summary(inspect.unwrap(fn), None, scope).opaque
        ):
            return False
    return True


def _resolve(call: ast.Call, scope: _Scope) -> tuple[Any, nn.Module | None, bool] | None:
    """(function, the module it runs on or None, whether `self` is bound) for a callee that
    can be read: a module-level Python function named directly, a method of `self`, or a
    hook-free child of `self` with a Python forward and nn.Module's call path; `None` for
    anything else. A child of a torch layer type that never writes its input (`nn.Linear`,
    `nn.RMSNorm`, ...: `fusion.alias.SAFE_CHILD_TYPES`) resolves to `_no_writes`."""
    func = call.func
    if isinstance(func, ast.Name):
        fn = scope.namespace.get(func.id) if scope.is_global(func.id) else None
        return (inspect.unwrap(fn), None, False) if inspect.isfunction(fn) else None
    is_self, child = _self_attr(func, scope)
    if not is_self or scope.module is None:
        return None
    if isinstance(child, nn.Module):
        if has_hooks(child) is not None or "forward" in child.__dict__:
            return None
        if type(child) in alias.SAFE_CHILD_TYPES:
            return None if getattr(child, "inplace", False) else (_no_writes, None, False)
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


def _no_writes(*args: Any, **kwargs: Any) -> None:
    """Stands for a callee known to write and keep nothing (a torch layer in
    `fusion.alias.SAFE_CHILD_TYPES`)."""


def _summary(fn: Any, module: nn.Module | None, caller: _Scope) -> _Summary:
    """What calling the Python function `fn` (with `self` = `module`) may do to its
    parameters, read from its source; `_OPAQUE` when the source cannot be read, the function
    is a closure, or the call chain is deeper than MAX_CALL_DEPTH."""
    if fn is _no_writes:
        return _PURE
    key = (fn, id(module))
    if key in caller.memo:
        return caller.memo[key]
    if caller.depth >= MAX_CALL_DEPTH:
        return _OPAQUE
    caller.memo[key] = _OPAQUE  # a recursive call is not read twice: unknown until done
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return _OPAQUE
    funcdef = tree.body[0] if tree.body else None
    if (
        not isinstance(funcdef, (ast.FunctionDef, ast.AsyncFunctionDef))
        or getattr(fn, "__code__", None) is None
        or fn.__code__.co_freevars
    ):
        return _OPAQUE
    scope = _Scope(funcdef, module, fn.__globals__, caller.depth + 1, caller.memo)
    written = _written(scope)
    arguments = funcdef.args
    params = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    params += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
    held = {param: _holders(scope, param) for param in params}
    returned: set[str] = set()
    generator = False
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Return):
            returned |= _roots(node.value, scope)
        elif isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            generator = True  # a generator or coroutine holds its whole frame
    if generator or _EVERYTHING in written:
        summary = _OPAQUE
    else:
        summary = _Summary(
            returns=frozenset(param for param in params if held[param] & returned),
            writes=frozenset(param for param in params if held[param] & written),
            joins=tuple(
                frozenset({param} | (held[param] & set(params)))
                for param in params
                if held[param] & (set(params) - {param})
            ),
        )
    caller.memo[key] = summary
    return summary


def _bind(call: ast.Call, fn: Any, bound: bool, scope: _Scope) -> dict[str, set[str]] | None:
    """The roots of what `call` passes to each parameter of `fn` (`self` from the receiver
    when `bound`; a `*args` splat to every positional parameter from its position on, a
    `**options` splat to every parameter a keyword can reach); None when the arguments do
    not fit the signature."""
    if fn is _no_writes:
        return {}
    parameters = inspect.signature(fn).parameters
    names = list(parameters)
    binding: dict[str, set[str]] = {name: set() for name in names}
    if bound:
        if not names:
            return None
        binding[names[0]] |= _roots(call.func.value, scope)  # type: ignore[attr-defined]
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
                    binding[param] |= _roots(arg, scope)
            continue
        param = positional[index] if index < len(positional) else vararg
        if param is None:
            return None  # too many arguments: the call raises, but do not guess
        binding[param] |= _roots(arg, scope)
    for keyword in call.keywords:
        if keyword.arg is None:
            for param in names:
                if kinds[param] not in (
                    inspect.Parameter.POSITIONAL_ONLY,
                    inspect.Parameter.VAR_POSITIONAL,
                ):
                    binding[param] |= _roots(keyword.value, scope)
            continue
        param = keyword.arg if keyword.arg in kinds else varkw
        if param is None:
            return None
        binding[param] |= _roots(keyword.value, scope)
    return binding


def _binding_pairs(scope: _Scope) -> list[tuple[set[str], set[str]]]:
    """(names that may come to hold the value, roots of the value) for every binding form,
    stores into containers and objects included (`box[0] = q` makes `box` hold `q`), and for
    every call that may make its arguments or receiver hold one another (`lst.append(q)`):
    those join both ways."""
    pairs: list[tuple[set[str], set[str]]] = []

    def holders(target: ast.AST) -> set[str]:
        names = alias._store_names(target)
        for node in ast.walk(target):
            if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
                node.ctx, (ast.Store, ast.Del)
            ):
                names |= _roots(node.value, scope)
        return names

    for node in ast.walk(scope.funcdef):
        if isinstance(node, ast.Assign):
            stores = set().union(*(holders(target) for target in node.targets))
            pairs.append((stores, _roots(node.value, scope)))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            # `lst += [q]` extends in place; `t += v` keeps `t`.
            pairs.append((holders(node.target), _roots(node.value, scope)))
        elif isinstance(node, ast.NamedExpr):
            pairs.append((alias._store_names(node.target), _roots(node.value, scope)))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            pairs.append((holders(node.target), _roots(node.iter, scope)))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            pairs.append((holders(node.optional_vars), _roots(node.context_expr, scope)))
        elif isinstance(node, ast.Match):
            for case in node.cases:
                pairs.append((alias._match_captures(case.pattern), _roots(node.subject, scope)))
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node is not scope.funcdef
        ):
            pairs.append(({node.name}, _names_read(node)))  # a closure over what it reads
        elif isinstance(node, ast.Call):
            for group in _call_effects(node, scope)[1]:
                pairs.append((group, group))
    return pairs


def _holders(scope: _Scope, seed: str) -> set[str]:
    """`seed` and every name of the function that may hold (a view of) its value, to a
    fixed point. Flow-insensitive: a name that holds it anywhere holds it everywhere."""
    names = {seed}
    pairs = _binding_pairs(scope)
    changed = True
    while changed:
        changed = False
        for stores, reads in pairs:
            if reads & names and not stores <= names:
                names |= stores
                changed = True
    return names


def _reaches_locals(node: ast.AST, scope: _Scope) -> bool:
    """Can `node` reach any local by name (`exec`, `locals()`, `setattr`, a frame's
    `f_locals`, `global`)? `torch.stack` is not `inspect.stack`."""
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return True
    if isinstance(node, ast.Attribute) and _namespace(node, scope) not in (None, "operator"):
        return False
    return alias._is_opaque(node)


def _written(scope: _Scope) -> set[str]:
    """Names the function may write through (not merely rebind): augmented assignment,
    stores and deletes through a subscript or attribute, in-place spellings (`x.op_()`,
    `torch.op_(x)`, `x.__iadd__(v)`, `operator.iadd(x, v)`, `out=x`, `inplace=True` by
    keyword or position, a `**options` splat), and calls that may write their arguments
    (`_call_effects`); nested functions and lambdas included. Contains `_EVERYTHING` when
    the function can reach locals by name (`exec`, `locals()`, `setattr`, a frame)."""
    written: set[str] = set()
    for node in ast.walk(scope.funcdef):
        if _reaches_locals(node, scope):
            written.add(_EVERYTHING)
        if isinstance(node, ast.AugAssign):
            written |= _roots(node.target, scope)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            if not _is_box(node.value, scope):
                written |= _roots(node.value, scope)
        elif isinstance(node, ast.Call):
            written |= _call_effects(node, scope)[0]
    return written


def _is_box(node: ast.expr, scope: _Scope) -> bool:
    """Can a store into `node` (`node[k] = v`, `node.a = v`) only replace what it holds,
    never write a piece's storage? True for a parameter the forward never rebinds (it is an
    object from before the call, so neither a piece nor a view of one: `self`, a dict of
    shared states; not so for a callee's parameters, which may be pieces) and for a name
    bound only to a new container display (`d = {}`)."""
    if not isinstance(node, ast.Name):
        return False
    arguments = scope.funcdef.args
    params = {
        a.arg
        for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)
        if a is not None
    } | {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    stores = [
        n
        for n in ast.walk(scope.funcdef)
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)) and n.id == node.id
    ]
    if node.id in params:
        return scope.depth == 0 and not stores
    values = scope.local_values.get(node.id, [])
    displays = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
    return (
        bool(values)
        and _bound_only_by_assignment(node.id, scope)
        and all(isinstance(value, displays) for value in values)
    )


def _asked_or_returned(scope: _Scope) -> set[str]:
    """Names whose layout the forward asks (`x.stride()`, `x.is_contiguous()`,
    `x.untyped_storage()`, ...: `LAYOUT_QUESTIONS`) or that it returns to its caller (who
    may write them, or ask): a piece reaching either must be a copy of its own."""
    names: set[str] = set()
    for node in ast.walk(scope.funcdef):
        if isinstance(node, ast.Return):
            names |= _roots(node.value, scope)
        elif isinstance(node, ast.Attribute) and node.attr in LAYOUT_QUESTIONS:
            if _namespace(node, scope) is not None:
                names |= _EVERYTHING_READ  # `torch.Tensor.stride(q)`: its argument
            else:
                names |= _roots(node.value, scope)
    return names


_EVERYTHING_READ = {_EVERYTHING}
"""A layout question spelled through a namespace: fail closed, every piece."""


def written_pieces(
    funcdef: ast.FunctionDef,
    temps: Sequence[str],
    module: nn.Module | None = None,
    namespace: dict[str, Any] | None = None,
) -> tuple[bool, ...]:
    """For each split temporary of a rewritten forward: may its piece, or anything holding
    or viewing it, be written in place anywhere in the source, whether or not the trace
    took that path (or be asked its layout, or be returned: then, too, only a copy of its
    own behaves like the projection's output)?

    True when a name that may hold the piece (`_holders`: through views, casts, ternaries,
    containers, objects, loop variables, closures, calls) is written through by any spelling
    (`_written`), and for every piece when the forward can reach locals by name (`exec`,
    `locals()`). `module` and `namespace` (the forward's globals) let calls of `self`'s
    children and methods and of module-level functions be read instead of presumed to write
    their arguments. Both halves over-approximate: a false hit costs one copy, a miss would
    be a fused forward that autograd rejects where the original ran.
    """
    try:
        scope = _Scope(funcdef, module, namespace or {}, 0, {})
        written = _written(scope) | _asked_or_returned(scope)
        if _EVERYTHING in written:
            return (True,) * len(temps)
        return tuple(bool(_holders(scope, temp) & written) for temp in temps)
    except (RecursionError, ValueError, TypeError, AttributeError):
        # Code this analysis cannot take apart (a signature inspect cannot read, an AST too
        # deep): fail closed, every piece its own copy.
        return (True,) * len(temps)

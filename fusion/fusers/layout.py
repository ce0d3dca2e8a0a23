"""Which split pieces of a merged GEMM must be made contiguous, or fresh, to behave like
the originals.

A projection returns a contiguous tensor; a piece of the merged output split along the last
dimension is a strided view of it. Most code cannot tell the difference, but a `.view` that
merges the last dimension with another fails on the piece, and `is_contiguous()` answers
differently. Rather than guess, each piece is replayed through the traced graph on meta
tensors with its real (strided) layout: wherever the replay raises, or a value still aliasing
the piece is returned or asked about its layout, that piece gets `.contiguous()`.

A piece is also a view of a multi-output op, and under autograd such a view may not be
written in place ("Output 0 of SplitWithSizes is a view and is being modified inplace"),
while the projection's own output may (OLMo clamps q/k/v in place). A piece written in
place, or through anything aliasing it, therefore gets `.clone()`: a fresh, contiguous,
non-view tensor like the projection's. Writes are found twice, because neither view is
complete: the replay sees every traced write (an in-place op bumps the merged tensor's
version counter, even on meta), and `written_pieces` reads the rewritten source for the
writes fx cannot record (`q *= s` is traced as `q = q * s`) or that sit on paths the trace
did not take (a branch on a config flag, the KV-cache branch).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

import torch
from torch import fx, nn

from fusion import alias
from fusion.graph import is_leaf_call, output_value
from fusion.trace import META_VALUE

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
"""Verdicts on a piece: usable as split, needs `.contiguous()`, needs `.clone()`."""


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
            verdict = CONTIGUOUS  # a view of the piece escapes to the caller
            continue
        if is_leaf_call(user):
            continue  # attention kernels take strided inputs; nothing after sees the piece
        if user.op == "call_method" and user.target in LAYOUT_QUESTIONS:
            verdict = CONTIGUOUS
            continue
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


def _root(node: ast.AST) -> str | None:
    """The name a value may be a view (or an element) of: through attributes, subscripts,
    and methods or `torch.*`/`F.*` functions that may return a view of their receiver or
    first argument (`VIEW_OPS`, and in-place methods, which return their receiver):
    `q.view(...)[0].T` and `torch.flatten(q)` -> `q`. None for new storage (`q * 2`,
    `q.new_zeros(...)`, `q.softmax(-1)`) and for what is not spelled as a view."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name not in VIEW_OPS and not alias.is_inplace_name(name):
                return None
            namespace = node.func.value
            while isinstance(namespace, ast.Attribute):
                namespace = namespace.value
            if isinstance(namespace, ast.Name) and namespace.id in alias.PURE_NAMESPACES:
                if not node.args:
                    return None
                node = node.args[0]
            else:
                node = node.func.value
        else:
            return node.id if isinstance(node, ast.Name) else None


def _piece_names(funcdef: ast.FunctionDef, temp: str) -> set[str]:
    """`temp` and every name bound (anywhere, flow-insensitively) to a view or element of
    it: `q = temp.view(...).transpose(1, 2)`, `a, b = temp.chunk(2)`, `q = k = temp`."""
    names = {temp}
    bindings: list[tuple[list[ast.expr], ast.expr]] = []
    for node in ast.walk(funcdef):
        if isinstance(node, ast.Assign):
            bindings.append((node.targets, node.value))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            bindings.append(([node.target], node.value))
    changed = True
    while changed:
        changed = False
        for targets, value in bindings:
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
            if not any(_root(v) in names for v in values):
                continue
            for target in targets:
                bound = {
                    n.id
                    for n in ast.walk(target)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                }
                if not bound <= names:
                    names |= bound
                    changed = True
    return names


def _written_roots(funcdef: ast.FunctionDef) -> set[str]:
    """Roots (`_root`) of every value `funcdef` writes by an explicit in-place spelling:
    augmented assignment, a store through a subscript or attribute, an in-place method or
    function (`x.clamp_()`, `torch.relu_(x)`, `x.__imul__(s)`), `out=`, `inplace=` (by
    keyword or position). Rebinding a name is not a write."""
    roots: set[str | None] = set()
    for node in ast.walk(funcdef):
        if isinstance(node, ast.AugAssign):
            roots.add(_root(node.target))
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
            node.ctx, (ast.Store, ast.Del)
        ):
            roots.add(_root(node.value))
        elif isinstance(node, ast.Call):
            spelled = ast.Call(
                func=node.func,
                args=node.args,
                keywords=[k for k in node.keywords if k.arg is not None],
            )
            if not alias.writes_through_args(spelled):
                continue
            if isinstance(node.func, ast.Attribute):
                roots.add(_root(node.func.value))
            roots |= {_root(arg) for arg in node.args[:1]}
            roots |= {_root(k.value) for k in node.keywords if k.arg == "out"}
    return {root for root in roots if root is not None}


def written_pieces(funcdef: ast.FunctionDef, temps: Sequence[str]) -> tuple[bool, ...]:
    """For each split temporary of a rewritten forward: is a view of its piece written by an
    explicit in-place spelling anywhere in the source, whether or not the trace took that
    path? (Writes the replay can see, such as an in-place child or helper, are its job.)

    Deliberately narrower than `fusion.alias`, which is built for the opposite question
    (may anything change the projection input?) and taints every argument of an unknown
    call, and everything stored into a container, with everything else: that would clone
    the pieces of most cache-updating attentions for nothing. A write missed here can only
    be one autograd rejects loudly; under no_grad, a write to a piece changes exactly the
    values a write to the projection's output would.
    """
    written = _written_roots(funcdef)
    return tuple(bool(_piece_names(funcdef, temp) & written) for temp in temps)

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
(FRESH; `fusion.fusers.stacked.settle_layouts`): a new, non-view tensor with standard
contiguous strides, like the projection's. So does a piece whose layout is asked
(`stride()`, `untyped_storage()`, ...) or that is returned: `.contiguous()` hands back the
piece itself where it already counts as contiguous (size-1 leading dimensions), merged
strides and storage included.

The replay is exact on the path the trace took, and only there: a layout-sensitive use on
a branch it did not take (`if self.flatten: q = q.view(-1)`, `if mask is None:`, a helper's
own branch) is found in the source by `fusion.analysis.piece_paths`, which makes that piece fresh.

Writes are found twice, because neither view is complete: this replay sees every traced
write (an in-place op bumps the merged tensor's version counter, even on meta), and
`fusion.analysis.piece_writes.written_pieces` reads the rewritten source for the writes fx cannot
record or that sit on paths the trace did not take. Under `no_grad` a write to a piece
changes exactly what a write to the projection's output would, so a copy never changes a
value: a false alarm costs one copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx, nn

from fusion.trace.graph import is_leaf_call, output_value
from fusion.trace.tracer import META_VALUE

LAYOUT_QUESTIONS = frozenset(
    {"is_contiguous", "data_ptr", "stride", "storage", "untyped_storage", "numpy", "storage_offset"}
    | {"as_strided"}
)
"""Methods whose answer differs between a contiguous tensor and a strided piece (`as_strided`
reads the storage from the piece's offset with the strides it is given: other values)."""


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
(`stacked.settle_layouts`)."""


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

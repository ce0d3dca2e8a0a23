"""Small predicates and walks over a traced fx graph.

Every function here is pure: it reads nodes and the module the graph was traced from, and
changes neither. Walks stop at leaf calls (attention interfaces), because what crosses an
attention call is consumed by attention, not projected by it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import fx, nn

from fusion.trace.tensor_meta import METADATA_ATTRS, METADATA_METHODS
from fusion.trace.tracer import LEAF_CALL

DTYPE_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})
"""Tensor methods that only change dtype (or device): `peel` looks through them."""

_OP_NAMESPACES = (torch, F, operator)

NEW_METHODS = frozenset({"new_empty", "new_zeros", "new_ones", "new_full"})
"""`x.new_*(...)`: the receiver gives only dtype and device, never values."""


def is_fn(node: object, target: object) -> bool:
    """Is `node` a call of exactly the function `target`?"""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def is_method(node: object, name: str) -> bool:
    """Is `node` a method call `.<name>(...)`?"""
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def is_op(node: object, name: str) -> bool:
    """Is `node` the op `name` spelled as `torch.<name>`, `F.<name>`, `operator.<name>` or a
    tensor method `x.<name>()`?"""
    if any(is_fn(node, getattr(ns, name, None)) for ns in _OP_NAMESPACES):
        return True
    return hasattr(torch.Tensor, name) and is_method(node, name)


def is_leaf_call(node: object) -> bool:
    """Is `node` an opaque call recorded by `fusion.trace.tracer.leaf_call` (an attention call)?"""
    return isinstance(node, fx.Node) and bool(node.meta.get(LEAF_CALL, False))


def submodule(node: fx.Node, module: nn.Module) -> nn.Module | None:
    """The child a `call_module` node calls, or None for any other node."""
    if node.op != "call_module":
        return None
    try:
        return module.get_submodule(str(node.target))
    except AttributeError:
        return None


def is_linear(node: object, module: nn.Module) -> bool:
    """Is `node` a call of an `nn.Linear` child of `module` (subclasses included; whether a
    subclass is safe to merge is the fuser's question, not the graph's)."""
    return isinstance(node, fx.Node) and isinstance(submodule(node, module), nn.Linear)


def peel(node: object) -> object:
    """`node` with dtype/device casts (`.to`, `.float()`, `.type_as`...) stripped."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in DTYPE_CASTS:
        node = node.args[0]
    return node


def find_node(graph: fx.Graph, predicate: Callable[[fx.Node], bool]) -> fx.Node | None:
    """The first node of `graph`, in trace order, satisfying `predicate`, or None."""
    return next((node for node in graph.nodes if predicate(node)), None)


def output_value(graph: fx.Graph) -> object | None:
    """What the traced forward returns, or None when the trace did not reach the return."""
    output = find_node(graph, lambda n: n.op == "output")
    if output is None or not output.args:
        return None
    return output.args[0]


def is_metadata(node: object) -> bool:
    """Is `node` a read of a tensor's metadata (`x.shape`, `x.size(0)`, `x.dtype`), whose
    result carries no tensor values?"""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) >= 2 and node.args[1] in METADATA_ATTRS
    return node.op == "call_method" and node.target in METADATA_METHODS


def _node_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs whose values flow into `node`'s value: none for a metadata read, and
    not the receiver of `x.new_zeros(...)` (only its dtype and device are used)."""
    if is_metadata(node):
        return []
    if node.op == "call_method" and node.target in NEW_METHODS:
        inputs: list[fx.Node] = []
        fx.node.map_arg((node.args[1:], node.kwargs), inputs.append)
        return list(dict.fromkeys(inputs))
    return list(node.all_input_nodes)


def upstream_linear(node: object, module: nn.Module) -> fx.Node | None:
    """The nearest linear (fewest steps, breadth first) whose output values flow into
    `node`, walking back through ops and non-linear children (dropout after an output
    projection), never through a leaf call or a metadata read (`x.shape` carries no values:
    `view(q.shape)` does not make `q`'s projection an input)."""
    queue: list[object] = [node]
    seen: set[fx.Node] = set()
    while queue:
        current = queue.pop(0)
        if not isinstance(current, fx.Node) or current in seen:
            continue
        seen.add(current)
        if is_linear(current, module):
            return current
        if current.op in ("call_function", "call_method", "call_module") and not is_leaf_call(
            current
        ):
            queue.extend(_node_inputs(current))
    return None


def downstream_linear(
    node: fx.Node, module: nn.Module, *, through_children: bool = False
) -> fx.Node | None:
    """The nearest linear consuming `node`'s value (breadth first, through ops and casts),
    never through a leaf call (an attention interface) or a metadata read. With
    `through_children`, also through calls of `module`'s other children (a norm between
    MLA's down- and up-projection)."""
    passable = ("call_function", "call_method") + (("call_module",) if through_children else ())
    queue = [user for user in node.users if node in _node_inputs(user)]
    seen: set[fx.Node] = set()
    while queue:
        current = queue.pop(0)
        if current in seen:
            continue
        seen.add(current)
        if is_linear(current, module):
            return current
        if current.op in passable and not is_leaf_call(current):
            queue.extend(user for user in current.users if current in _node_inputs(user))
    return None


def returned_linear(graph: fx.Graph, module: nn.Module) -> str | None:
    """Name of the linear that produces the forward's (first) returned value, found by
    dataflow; None if no linear does or the trace never reached the return."""
    value = output_value(graph)
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    linear = upstream_linear(value, module)
    return None if linear is None else str(linear.target)


def linear_calls(graph: fx.Graph, module: nn.Module) -> list[fx.Node]:
    """Every linear call node of `graph`, in trace order."""
    return [node for node in graph.nodes if is_linear(node, module)]


def calls_by_target(nodes: Iterable[fx.Node]) -> dict[str, list[fx.Node]]:
    """`call_module` nodes grouped by the child they call (a child called twice shows twice)."""
    groups: dict[str, list[fx.Node]] = {}
    for node in nodes:
        if node.op == "call_module":
            groups.setdefault(str(node.target), []).append(node)
    return groups


SHAPE_OPS = ("reshape", "view", "flatten", "contiguous")
"""Ops that only reshape a value: `x.view(-1, h)` still holds the values of `x`."""


def first_input(graph: fx.Graph) -> fx.Node | None:
    """The graph's first placeholder (a forward's first argument), or None."""
    return next((n for n in graph.nodes if n.op == "placeholder"), None)


def call_arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    """Argument `name` of a call node, passed positionally at `index` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def strip_reshapes(node: object, module: nn.Module) -> object:
    """`node` with reshapes (`SHAPE_OPS`) and `nn.Identity` children stripped (no casts: a
    cast changes the values a consumer sees; `peel` is the walk through casts)."""
    while isinstance(node, fx.Node):
        shape_only = any(is_op(node, name) for name in SHAPE_OPS)
        identity = node.op == "call_module" and isinstance(
            module.get_submodule(str(node.target)), nn.Identity
        )
        if not (shape_only or identity):
            break
        node = node.args[0]
    return node


def calls_child_on(node: object, x: fx.Node, module: nn.Module) -> bool:
    """Is `node` a child module called on just `x` (up to reshapes), nothing else?"""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_module"
        and len(node.args) == 1
        and not node.kwargs
        and strip_reshapes(node.args[0], module) is x
    )

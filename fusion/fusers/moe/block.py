"""Matching an MoE block by dataflow in its traced forward: the experts call, the router it
reads, a (gated) shared expert as the other addend of the output, and nothing else with
state. `match_packed` reads a Transformers 5 block; `looks_routed` tells a Transformers 4 block
(a `ModuleList` of experts, refused whole by the fuser) from a decoder stack."""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from fusion.analysis.reads import guarded_reads, portable_keys, recording
from fusion.analysis.source import reads_training, returns_tuple
from fusion.errors import RewriteRefused
from fusion.fusers.moe.experts import packed_experts_activation
from fusion.fusers.moe.router import Routing, router_program
from fusion.runtime.moe import RouteSpec
from fusion.trace.graph import calls_child_on, first_input, is_op, output_value, strip_reshapes
from fusion.trace.tracer import trace


@dataclass(frozen=True)
class MoEMatch:
    """What one kind of MoE block computes, in names of its children: always a Transformers
    5 block with packed experts (a Transformers 4 `ModuleList` is refused before a match is
    made: `fusion.fusers.moe.fuser.MODULELIST_REFUSAL`)."""

    router_name: str
    router_weight: str
    """Name of the router weight within the router child."""
    spec: RouteSpec
    experts_name: str
    activation: str
    shared_name: str | None = None
    shared_gate_name: str | None = None
    training_sensitive: bool = False
    reads: tuple[tuple[str, str], ...] = ()
    """`(module path in the block, attribute name)` of every attribute the routing proof read
    on the block and the router (`routing_reads`), guarded by the fused block per call."""
    read_keys: tuple = ()
    """Their values on the matched instance (`fusion.analysis.reads.portable_keys`): another
    instance takes this match only with equal keys."""


def _other_state(module: nn.Module, accounted: set[str]) -> None:
    for name, child in module.named_children():
        if name in accounted:
            continue
        if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None:
            raise RewriteRefused(f"child {name} holds state the fused block would not run")
    own = [n for n, _ in module.named_parameters(recurse=False)] + [
        n for n, _ in module.named_buffers(recurse=False)
    ]
    if own:
        raise RewriteRefused(f"the block holds state of its own ({own})")


def _shared(node: Any, x: fx.Node, module: nn.Module) -> tuple[str, str | None]:
    """(shared expert, its gate or None) for `shared(x)` or `sigmoid(gate(x)) * shared(x)`."""
    node = strip_reshapes(node, module)
    if calls_child_on(node, x, module):
        return str(node.target), None
    if is_op(node, "mul") and len(node.args) == 2:
        for gated, shared in (node.args, node.args[::-1]):
            gated, shared = strip_reshapes(gated, module), strip_reshapes(shared, module)
            if not (is_op(gated, "sigmoid") and calls_child_on(shared, x, module)):
                continue
            gate = strip_reshapes(gated.args[0], module)
            if calls_child_on(gate, x, module):
                linear = module.get_submodule(str(gate.target))
                if (
                    type(linear) is nn.Linear
                    and linear.out_features == 1
                    and linear.bias is None
                    and str(gate.target) != str(shared.target)
                ):
                    return str(shared.target), str(gate.target)
    raise RewriteRefused("the output adds a term that is not a (gated) shared expert of the input")


def match_packed(graph: fx.Graph, module: nn.Module, experts_name: str) -> MoEMatch:
    x = first_input(graph)
    out = output_value(graph)
    if isinstance(out, (tuple, list)):
        raise RewriteRefused("the block returns a tuple")
    if out is None:
        reason = (
            "returns a tuple" if returns_tuple(type(module)) else "does not trace to its return"
        )
        raise RewriteRefused(f"the block {reason}")
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == experts_name]
    if x is None or len(calls) != 1:
        raise RewriteRefused(f"{experts_name} is not called exactly once")
    experts_node = calls[0]
    experts = module.get_submodule(experts_name)
    activation = packed_experts_activation(experts)
    try:
        bound = inspect.signature(type(experts).forward).bind(
            None, *experts_node.args, **experts_node.kwargs
        )
    except TypeError as exc:
        raise RewriteRefused(f"experts call does not bind: {exc}") from exc
    arguments = list(bound.arguments.values())[1:]
    if len(arguments) != 3:
        raise RewriteRefused("experts are called with other than (hidden, ids, weights)")
    hidden, ids, weights = arguments
    if strip_reshapes(hidden, module) is not x:
        raise RewriteRefused("experts do not read the block input")
    router = ids.args[0] if isinstance(ids, fx.Node) and ids.args else None
    if not (
        isinstance(router, fx.Node)
        and ids.target is operator.getitem
        and ids.args == (router, 2)
        and isinstance(weights, fx.Node)
        and weights.target is operator.getitem
        and weights.args == (router, 1)
        and calls_child_on(router, x, module)
    ):
        raise RewriteRefused("experts do not take (ids, weights) = router(x)[2], router(x)[1]")
    router_name = str(router.target)
    router_module = module.get_submodule(router_name)
    if isinstance(router_module, nn.Linear):
        raise RewriteRefused("the router is a bare linear returning logits, not routing")
    routing, reads = routing_reads(module, router_module)
    root = strip_reshapes(out, module)
    shared_name = shared_gate_name = None
    if root is not experts_node:
        if not (is_op(root, "add") and len(root.args) == 2):
            raise RewriteRefused(
                "the block does not return the experts' output (plus a shared expert)"
            )
        a, b = (strip_reshapes(arg, module) for arg in root.args)
        if b is experts_node:
            a, b = b, a
        if a is not experts_node:
            raise RewriteRefused(
                "the block does not return the experts' output (plus a shared expert)"
            )
        shared_name, shared_gate_name = _shared(b, x, module)
    accounted = {experts_name, router_name, shared_name, shared_gate_name} - {None}
    _other_state(module, accounted)
    return MoEMatch(
        router_name=router_name,
        router_weight=routing.weight_name,
        spec=routing.spec,
        experts_name=experts_name,
        activation=activation,
        shared_name=shared_name,
        shared_gate_name=shared_gate_name,
        training_sensitive=reads_training(type(module)) or reads_training(type(router_module)),
        reads=reads,
        read_keys=portable_keys(module, reads),
    )


def routing_reads(
    block: nn.Module, router: nn.Module
) -> tuple[Routing, tuple[tuple[str, str], ...]]:
    """The router's program and what proving it read on the block and the router, as
    `(path in the block, name)`: the block's own trace (which children it calls, each
    attribute of its own its forward reads) and the router's (`self.top_k`,
    `self.norm_topk_prob`, `self.routed_scaling_factor`, ... frozen into the program's
    steps), recorded as they are read (`fusion.analysis.reads.recording`), with the router's
    `forward` and call path (the fused block stands in for calling it). Parameters and
    buffers are guarded by presence only: `FusedMoE.route` reads them by name per call.
    RewriteRefused for a read no per-call guard can see, or an instance-level forward on
    the router (the program is its class's)."""
    with recording(block) as recorded:
        trace(block)
        routing = router_program(router)
    reads = guarded_reads(
        block, recorded, within=(block, router), called=(router,), live_tensors=True
    )
    return routing, reads


def looks_routed(graph: fx.Graph, module: nn.Module) -> bool:
    """Does the (possibly partial) graph select experts: a top-k over a linear child's
    output? A decoder stack also holds a `ModuleList` of linear-bearing modules, but no
    top-k; it is not an MoE block at all, so it gets no verdict."""
    for node in graph.nodes:
        if is_op(node, "topk"):
            stack, seen = [node], set()
            while stack:
                current = stack.pop()
                if current in seen or not isinstance(current, fx.Node):
                    continue
                seen.add(current)
                if current.op == "call_module" and isinstance(
                    module.get_submodule(str(current.target)), nn.Linear
                ):
                    return True
                stack.extend(current.all_input_nodes)
    return False

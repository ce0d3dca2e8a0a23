"""QKV: the three sibling q/k/v projections of an attention block -> one `qkv_proj` GEMM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from fusion.errors import RewriteRefused
from fusion.fusers.stacked import (
    StackedFuser,
    linear_inputs,
    projection_graph,
    unique_targets,
    width,
)
from fusion.trace.graph import find_node, is_leaf_call, is_linear, output_value, returned_linear


@dataclass
class QKVFuser(StackedFuser):
    """Three linears reading the same value in a module that calls attention.

    q is the widest of the three (ties: the first traced), then k and v in trace order; MHA,
    GQA and MQA differ only in widths, which `MergedLinear.output_sizes` records per instance.
    The output projection is found by dataflow from the returned value and never merged.
    """

    name: ClassVar[str] = "qkv"

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return sum(isinstance(c, nn.Linear) for c in module.children()) >= 3

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> QKVFuser | None:
        stops_early = _stops_before_projections(graph, module)
        graph, decided = projection_graph(graph, module)
        triple = None if graph is None else _triple(graph, module)
        if triple is None:
            if stops_early:
                # The plain trace stopped before the first projection (a branch on a traced
                # value, an op fx cannot follow), and the trace deciding its branches shows
                # no q/k/v either (or none that can be told from the path it took, e.g. into
                # `super().forward(...)`): no verdict is possible, and that is worth saying.
                raise RewriteRefused("the forward does not trace as far as its projections")
            return None
        targets = unique_targets(triple)
        if targets is None:
            raise RewriteRefused("a projection is called more than once")
        q = max(targets, key=lambda name: (width(module, name), -targets.index(name)))
        k, v = (name for name in targets if name != q)
        fuser = cls(source_class=type(module).__name__, shards=(q, k, v), merged_name="qkv_proj")
        fuser.prepare(module, graph, decided)
        return fuser


def _stops_before_projections(graph: fx.Graph | None, module: nn.Module) -> bool:
    """Did the trace of a module with a forward of its own end before any linear call?"""
    return (
        graph is not None
        and type(module).forward is not nn.Module.forward  # containers: no forward
        and output_value(graph) is None
        and not any(is_linear(node, module) for node in graph.nodes)
    )


def _triple(graph: fx.Graph, module: nn.Module) -> list[fx.Node] | None:
    """The three linear calls reading one value in a graph that calls attention (the output
    projection excluded), None when there is no such group; refuses when several are."""
    if find_node(graph, is_leaf_call) is None:
        return None
    output = returned_linear(graph, module)
    groups = [
        [node for node in nodes if str(node.target) != output]
        for nodes in linear_inputs(graph, module).values()
    ]
    triples = [nodes for nodes in groups if len(nodes) == 3]
    if len(triples) > 1:
        raise RewriteRefused("several groups of three linears: q/k/v ambiguous")
    # No triple: four or more projections of one input (gated attention: q/k/v plus a gate)
    # are the sibling fuser's, which merges all of them into one GEMM with the same proofs.
    return triples[0] if triples else None

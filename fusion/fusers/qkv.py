"""QKV: the three sibling q/k/v projections of an attention block -> one `qkv_proj` GEMM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from fusion.errors import RewriteRefused
from fusion.fusers.stacked import StackedFuser, linear_inputs, unique_targets, width
from fusion.graph import find_node, is_leaf_call, is_linear, output_value, returned_linear


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
        if graph is None or find_node(graph, is_leaf_call) is None:
            if (
                graph is not None
                and type(module).forward is not nn.Module.forward  # containers: no forward
                and output_value(graph) is None
                and not any(is_linear(node, module) for node in graph.nodes)
            ):
                # The trace stopped before the first projection (e.g. Transformers 4's
                # `if output_attentions: return super().forward(...)`): no verdict is
                # possible, and that is worth saying rather than passing over in silence.
                raise RewriteRefused("the forward does not trace as far as its projections")
            return None
        output = returned_linear(graph, module)
        groups = [
            [node for node in nodes if str(node.target) != output]
            for nodes in linear_inputs(graph, module).values()
        ]
        triples = [nodes for nodes in groups if len(nodes) == 3]
        if not triples:
            if any(len(nodes) > 3 for nodes in groups):
                raise RewriteRefused("more than three linears read the attention input")
            return None
        if len(triples) > 1:
            raise RewriteRefused("several groups of three linears: q/k/v ambiguous")
        targets = unique_targets(triples[0])
        if targets is None:
            raise RewriteRefused("a projection is called more than once")
        q = max(targets, key=lambda name: (width(module, name), -targets.index(name)))
        k, v = (name for name in targets if name != q)
        fuser = cls(source_class=type(module).__name__, shards=(q, k, v), merged_name="qkv_proj")
        fuser.prepare(module, graph)
        return fuser

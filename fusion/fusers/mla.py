"""MLA: DeepSeek V2/V3 attention's two input projections -> one `fused_qkv_a_proj` GEMM.

Found by dataflow, never by name: exactly two linears read the attention input, and at
least one of them is a low-rank "a" projection (its output reaches another linear, through
splits and norms). With q-LoRA the pair is `q_a_proj` + `kv_a_proj_with_mqa`; without it,
`q_proj` + `kv_a_proj_with_mqa`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from fusion.errors import RewriteRefused
from fusion.fusers.stacked import StackedFuser, linear_inputs, projection_graph, unique_targets
from fusion.trace.graph import downstream_linear, find_node, is_leaf_call, returned_linear


@dataclass
class MLAFuser(StackedFuser):
    """The two projections of the attention input, in trace order."""

    name: ClassVar[str] = "mla"

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return sum(isinstance(c, nn.Linear) for c in module.children()) >= 3

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> MLAFuser | None:
        graph, decided = projection_graph(graph, module)
        if graph is None or find_node(graph, is_leaf_call) is None:
            return None
        output = returned_linear(graph, module)
        placeholders = [node for node in graph.nodes if node.op == "placeholder"]
        if not placeholders:
            return None
        nodes = [
            node
            for node in linear_inputs(graph, module).get(placeholders[0], [])
            if str(node.target) != output
        ]
        if len(nodes) != 2 or not any(
            downstream_linear(n, module, through_children=True) for n in nodes
        ):
            return None
        shards = unique_targets(nodes)
        if shards is None:
            raise RewriteRefused("a projection is called more than once")
        fuser = cls(
            source_class=type(module).__name__, shards=shards, merged_name="fused_qkv_a_proj"
        )
        fuser.prepare(module, graph, decided)
        return fuser

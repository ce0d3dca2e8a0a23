"""Sibling merge: >= 2 linears reading one input -> one GEMM.

The fallback for projections no specific fuser claims: gated attention (q/k/v plus a gate
or another projection of the same input), linear-attention input projections, a GLU whose
activation `ActAndMul` does not reproduce, a cross-attention's k/v pair. Whatever code sits
between the calls, the merge is exactly as safe as the q/k/v one: `rewrite_stacked` proves
each projection called once on one side-effect-free input expression that nothing between
the first and the last call can change (alias analysis), and that every call stays in its
region and global state (`fusion.analysis.regions`), and refuses otherwise. Where a region barrier
splits the group (gated attention's gate, read after the attention call and a cache update
that cannot be proven to keep global state), the calls before the barrier are merged alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from fusion.analysis.regions import RegionRefused
from fusion.errors import RewriteRefused
from fusion.fusers.stacked import StackedFuser, linear_inputs, projection_graph, unique_targets
from fusion.trace.graph import returned_linear


@dataclass
class SiblingFuser(StackedFuser):
    """Every linear reading one input (the output projection excluded), merged in trace order."""

    name: ClassVar[str] = "sibling"

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return sum(isinstance(c, nn.Linear) for c in module.children()) >= 2

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> SiblingFuser | None:
        graph, decided = projection_graph(graph, module)
        if graph is None:
            return None
        output = returned_linear(graph, module)
        readers = [nodes for nodes in linear_inputs(graph, module).values() if len(nodes) >= 2]
        groups = [[node for node in nodes if str(node.target) != output] for nodes in readers]
        groups = [nodes for nodes in groups if len(nodes) >= 2]
        if not groups:
            if readers:
                names = " and ".join(str(node.target) for node in readers[0])
                raise RewriteRefused(
                    f"{names} read one input, but {output} makes the returned value (taken "
                    "for the output projection, never merged): fewer than two remain"
                )
            return None
        if len(groups) > 1:
            raise RewriteRefused("several groups of sibling linears")
        shards = unique_targets(groups[0])
        if shards is None:
            raise RewriteRefused("a projection is called more than once")
        try:
            return cls._prepared(module, graph, decided, shards)
        except RegionRefused as refused:
            # A barrier (a grad-mode switch, a call not proven to keep global state, a
            # `with` around some calls) splits the group: merge the calls before it, if
            # two or more, with every proof made again for them alone. Gated attention's
            # gate after the attention call stays a projection of its own.
            before = tuple(name for name in shards if name in refused.mergeable)
            if len(before) < 2 or before == shards:
                raise
            return cls._prepared(module, graph, decided, before)

    @classmethod
    def _prepared(
        cls, module: nn.Module, graph: fx.Graph, decided: bool, shards: tuple[str, ...]
    ) -> SiblingFuser:
        """A fuser merging `shards`, its rewrite prepared (`StackedFuser.prepare`)."""
        fuser = cls(
            source_class=type(module).__name__,
            shards=shards,
            merged_name="_".join(shards) + "_merged",
        )
        fuser.prepare(module, graph, decided)
        return fuser

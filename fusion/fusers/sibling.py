"""Sibling merge: >= 2 linears reading one input, assigned side by side -> one GEMM.

The fallback for projections no specific fuser claims (e.g. four gated-attention
projections). It only accepts the simplest layout: every statement from the first call to
the last is a plain `name = self.<projection>(input)` assignment, so nothing can happen
between the calls at all.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from fusion import source
from fusion.errors import RewriteRefused
from fusion.fusers.stacked import StackedFuser, linear_inputs, unique_targets
from fusion.graph import returned_linear


def _plain_assignments(module: nn.Module, shards: tuple[str, ...]) -> None:
    funcdef, _ = source.recover_forward(type(module))
    calls = [source.self_call_and_refs(funcdef, name)[0] for name in shards]
    block, indices = source.dominating_block(funcdef, calls)
    for stmt in block[min(indices) : max(indices) + 1]:
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and any(stmt.value is call for call in calls)
        ):
            raise RewriteRefused("statements between sibling projections are not plain assignments")


@dataclass
class SiblingFuser(StackedFuser):
    """Every linear reading one input (the output projection excluded), merged in trace order."""

    name: ClassVar[str] = "sibling"

    @classmethod
    def candidate(cls, module: nn.Module) -> bool:
        return sum(isinstance(c, nn.Linear) for c in module.children()) >= 2

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> SiblingFuser | None:
        if graph is None:
            return None
        output = returned_linear(graph, module)
        groups = [
            [node for node in nodes if str(node.target) != output]
            for nodes in linear_inputs(graph, module).values()
        ]
        groups = [nodes for nodes in groups if len(nodes) >= 2]
        if not groups:
            return None
        if len(groups) > 1:
            raise RewriteRefused("several groups of sibling linears")
        shards = unique_targets(groups[0])
        if shards is None:
            raise RewriteRefused("a projection is called more than once")
        _plain_assignments(module, shards)
        fuser = cls(
            source_class=type(module).__name__,
            shards=shards,
            merged_name="_".join(shards) + "_merged",
        )
        fuser.prepare(module, graph)
        return fuser

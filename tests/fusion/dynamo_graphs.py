"""Shared by tests that check what `torch.compile` traces: the graph Dynamo records."""

from __future__ import annotations

import torch
from torch import nn


def compiled_call_targets(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """`module(x)` compiled fullgraph (no gradient), and the names of the call targets
    Dynamo recorded in its one graph."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(x)
    assert len(graphs) == 1
    return out, [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]

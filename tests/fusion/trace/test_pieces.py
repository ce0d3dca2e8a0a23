"""`fusion.trace.pieces`: replaying each split piece of a merged GEMM through the traced graph
tells which pieces a plain view serves, which need `.contiguous()`, and which must be copies
of their own."""

from __future__ import annotations

import torch
from torch import nn

from fusion.trace.pieces import CONTIGUOUS, FRESH, OK, needs_contiguous, piece_verdicts
from fusion.trace.tracer import trace


class _Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.k_proj = nn.Linear(8, 4, bias=False)
        self.v_proj = nn.Linear(8, 4, bias=False)


class Plain(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q[..., :4] * k + v).sum(-1)


class MergesLastDimension(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # `.view` across the split dimension needs a contiguous q; k and v are only added.
        return q.view(-1).sum() + (k + v).sum()


class WritesInPlace(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        k.clamp_(-1.0, 1.0)
        return (q[..., :4] + k + v).sum(-1)


def _verdicts(module: nn.Module) -> tuple[str, ...]:
    graph = trace(module)
    assert graph is not None
    nodes = [n for n in graph.nodes if n.op == "call_module"]
    return piece_verdicts(graph, module, nodes)


def test_pieces_used_elementwise_stay_views() -> None:
    assert _verdicts(Plain()) == (OK, OK, OK)


def test_a_view_across_the_split_dimension_needs_a_contiguous_piece() -> None:
    verdicts = _verdicts(MergesLastDimension())
    assert verdicts[0] != OK
    assert verdicts[1:] == (OK, OK)


def test_a_piece_written_in_place_becomes_a_copy_of_its_own() -> None:
    verdicts = _verdicts(WritesInPlace())
    assert verdicts[1] == FRESH
    assert verdicts[0] == OK and verdicts[2] == OK


def test_needs_contiguous_follows_the_verdicts() -> None:
    module = WritesInPlace()
    graph = trace(module)
    assert graph is not None
    nodes = [n for n in graph.nodes if n.op == "call_module"]
    assert needs_contiguous(graph, module, nodes) == (False, True, False)


def test_a_partial_trace_makes_every_piece_contiguous() -> None:
    class Untraceable(_Projections):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            if q.sum() > 0:  # data-dependent control flow: the trace stops here
                return q
            return k + v

    module = Untraceable()
    graph = trace(module)
    assert graph is not None
    nodes = [n for n in graph.nodes if n.op == "call_module"]
    assert piece_verdicts(graph, module, nodes) == (CONTIGUOUS,) * len(nodes)


class ReadsThroughAsStrided(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # `as_strided` reads the storage as told: a strided piece gives other values.
        flat = q.as_strided((q.numel(),), (1,))
        return flat.sum() + (k + v).sum()


def test_as_strided_on_a_piece_needs_a_copy_of_its_own() -> None:
    assert _verdicts(ReadsThroughAsStrided()) == (FRESH, OK, OK)

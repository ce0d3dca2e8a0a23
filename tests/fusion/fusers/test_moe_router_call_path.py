"""A MoE block whose router or expert linears compute something around `forward` must not
fuse: FusedMoE recomputes routing and experts from their weights, bypassing `__call__`.

The gap sits next to the fuzzer's `FlagCallLinear` bug in the projection fusers (a per-instance
`__call__` silently dropped on every instance but the traced one)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fusion
from tests.fusion.fusers.moe_helpers import HIDDEN, SparseMoeV4, randomized


class ScaledCallLinear(nn.Linear):
    scale = 1.0

    def __call__(self, x):
        return super().__call__(x) * self.scale


def _swap_router(block: SparseMoeV4) -> SparseMoeV4:
    router = ScaledCallLinear(HIDDEN, block.num_experts, bias=False)
    router.load_state_dict(block.gate.state_dict())
    block.gate = router
    return block


def test_router_with_own_call_path_refused_on_every_instance() -> None:
    plain, scaled = randomized(SparseMoeV4()), randomized(SparseMoeV4(), seed=1)
    model = nn.Sequential(_swap_router(plain), _swap_router(scaled))
    model[1].gate.scale = 3.0  # only this instance changes its routing
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert "moe" not in report.counts(), str(report)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), fused(x))


def test_instance_level_call_on_an_expert_linear_keeps_running_its_own_call() -> None:
    """Transformers 4 blocks are refused as a whole (MODULELIST_REFUSAL); the experts are
    merged one by one, and an expert linear with its own `_call_impl` (here `w2`, which the
    GLU merge never takes) is still called through it: outputs bit-identical."""
    odd, plain = randomized(SparseMoeV4()), randomized(SparseMoeV4(), seed=1)
    odd.experts[3].w2.__dict__["_call_impl"] = odd.experts[3].w2._call_impl
    model = nn.Sequential(odd, plain)
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert "moe" not in report.counts() and "glu" in report.counts(), str(report)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fused(x), model(x))

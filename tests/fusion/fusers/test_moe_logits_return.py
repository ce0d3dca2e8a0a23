"""Transformers 4 blocks returning `(output, router_logits)` (`fusion.fusers.moe.
logits_return`): the pair is read, then the block refused as every Transformers 4 block is
(`MODULELIST_REFUSAL`); any other tuple, or logits written or rebound before the return,
refused for that reason first."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.fusers.moe.fuser import MODULELIST_REFUSAL
from fusion.moe_modules import FusedMoE
from tests.fusion.fusers.helpers import reasons
from tests.fusion.fusers.test_moe import HIDDEN, SparseMoeV4, randomized
from tests.fusion.tiny_models import relative_error


def _routed(self, hidden_states, router_logits):
    """The expert loop of Transformers 4 Mixtral (outside the forwards under test)."""
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
    for expert_idx in range(self.num_experts):
        idx, top_x = torch.where(expert_mask[expert_idx])
        current = self.experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, current.to(hidden_states.dtype))
    return final


class WithLogits(SparseMoeV4):
    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        final_hidden_states = _routed(self, hidden_states, router_logits)
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


class ScaledLogits(SparseMoeV4):
    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        final_hidden_states = _routed(self, hidden_states, router_logits)
        router_logits.mul_(2.0)
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


class ReboundLogits(SparseMoeV4):
    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        final_hidden_states = _routed(self, hidden_states, router_logits)
        router_logits = router_logits * 2.0
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


class ReturnsInput(SparseMoeV4):
    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        final_hidden_states = _routed(self, hidden_states, router_logits)
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), hidden_states


def test_block_returning_router_logits_is_refused_as_every_transformers4_block() -> None:
    """The pair is read (no other refusal comes first), but the block is a Transformers 4
    one: refused (`MODULELIST_REFUSAL`), its experts fused one by one, the same pair
    returned, the logits bit for bit."""
    model = nn.Sequential(randomized(WithLogits()))
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert "moe" not in report.counts() and MODULELIST_REFUSAL in reasons(report)
    assert not isinstance(fused[0], FusedMoE)
    for seed in range(3):
        x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            (out, logits), (fused_out, fused_logits) = model(x), fused(x)
        assert fused_logits.dtype == logits.dtype and torch.equal(fused_logits, logits)
        assert relative_error(out, fused_out) <= 1e-5


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        (ScaledLogits, "the block uses router_logits.mul_"),
        (ReboundLogits, "a tuple other than (output, router logits)"),
        (ReturnsInput, "a tuple other than (output, router logits)"),
    ],
)
def test_other_pairs_are_refused(block: type, reason: str) -> None:
    report = fusion.plan(nn.Sequential(randomized(block())))
    assert "moe" not in report.counts()
    assert reason in reasons(report)

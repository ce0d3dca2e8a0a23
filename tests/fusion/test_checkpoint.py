"""Unfused checkpoints load into fused models, and export back bit-identically."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusion
from fusion.checkpoint import unfused_state_dict
from tests.fusion.fusers import hazards
from tests.fusion.tiny_models import tiny_model, token_ids


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "deepseek_v3"])
def test_round_trip_bit_identical(model_type: str) -> None:
    unfused = tiny_model(model_type, seed=1)
    fused = tiny_model(model_type, seed=2)  # different weights, same architecture
    fusion.fuse(fused)
    fused.load_state_dict(unfused.state_dict())  # strict: every unfused key maps
    exported = unfused_state_dict(fused)
    original = unfused.state_dict()
    assert set(exported) == set(original)
    assert all(torch.equal(exported[key], original[key]) for key in original)
    ids = token_ids()
    with torch.no_grad():
        assert torch.allclose(unfused(ids).logits, fused(ids).logits, rtol=1e-5, atol=1e-6)


def test_mixed_bias_round_trip_drops_synthetic_zeros() -> None:
    module = hazards.Attention()
    module.k_proj = nn.Linear(32, 16, bias=True)
    fused = copy.deepcopy(module)
    fusion.fuse(fused)
    exported = unfused_state_dict(fused)
    assert set(exported) == set(module.state_dict())
    assert "q_proj.bias" not in exported and torch.equal(
        exported["k_proj.bias"], module.k_proj.bias
    )


def test_mapping_is_scoped_by_qualname() -> None:
    # Two attention blocks; only the first is fused. The second's q_proj keys must stay.
    model = nn.ModuleDict({"fused": hazards.Attention(), "plain": hazards.Attention()})
    model["plain"].k_proj.register_forward_hook(lambda *args: None)  # keeps it unfused
    source = copy.deepcopy(model)
    report = fusion.fuse(model)
    assert [r.qualname for r in report.applied] == ["fused"]
    model.load_state_dict(source.state_dict())
    assert torch.equal(model["plain"].q_proj.weight, source["plain"].q_proj.weight)
    assert torch.equal(model["fused"].qkv_proj.weight[:32], source["fused"].q_proj.weight)


def test_partial_unfused_checkpoint_is_a_clear_error() -> None:
    fused = hazards.Attention()
    fusion.fuse(fused)
    state = hazards.Attention().state_dict()
    del state["v_proj.weight"]
    with pytest.raises(KeyError, match=r"v_proj\.weight"):
        fused.load_state_dict(state)

"""`fusion.runtime.params`: a repack of experts never changes what trains or drops state a shard
carries; merged projections keep their own Parameters (and so their state)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusion
from fusion.errors import RewriteRefused
from fusion.runtime.params import apply_state, common_state
from tests.fusion.fusers import hazards
from tests.fusion.fusers.moe_helpers import SparseMoeV4
from tests.fusion.tiny_models import tiny_model, token_ids


class TaggedParameter(nn.Parameter):
    """A Parameter subclass (as quantisation and sharding libraries use)."""


def _qkv_refusal(report: fusion.FusionReport) -> str:
    reasons = [s.reason for s in report.skipped if s.fuser == "qkv"]
    assert reasons, str(report)
    return reasons[0]


@pytest.mark.parametrize(
    "frozen", [("q_proj",), ("k_proj", "v_proj"), ("v_proj",)], ids=lambda f: "+".join(f)
)
def test_mixed_requires_grad_merges_and_trains_exactly_what_it_did(
    frozen: tuple[str, ...],
) -> None:
    """Regression (freezing before fusing changed what trains: the merged weight took the
    first shard's flag; then such merges were refused): merged projections keep their own
    Parameters, so each keeps its own flag, and one training step changes exactly the
    Parameters it changes unfused, by the same amount."""
    module = hazards.Attention()
    for name in frozen:
        getattr(module, name).weight.requires_grad_(False)
    fused = copy.deepcopy(module)
    assert fusion.fuse(fused).counts() == {"qkv": 1}
    for model in (module, fused):
        assert {n for n, p in model.named_parameters() if not p.requires_grad} == {
            f"{name}.weight" for name in frozen
        }
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model(torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))).sum().backward()
        optimizer.step()
    for key, value in module.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key


def test_agreeing_requires_grad_is_kept_and_training_matches() -> None:
    """All shards frozen: they stay frozen; one SGD step on fused and unfused copies leaves
    identical state."""
    unfused = tiny_model("llama", seed=3).train()
    for layer in unfused.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, name).weight.requires_grad_(False)
    fused = copy.deepcopy(unfused)
    assert fusion.fuse(fused).counts().get("qkv") == 2
    assert not fused.model.layers[0].self_attn.k_proj.weight.requires_grad
    ids = token_ids()
    for model in (unfused, fused):
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    got, want = fused.state_dict(), unfused.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # The frozen projections did not move.
    reference = tiny_model("llama", seed=3)
    assert torch.equal(
        got["model.layers.0.self_attn.k_proj.weight"],
        reference.state_dict()["model.layers.0.self_attn.k_proj.weight"],
    )


def test_parameter_subclass_refuses() -> None:
    module = hazards.Attention()
    module.k_proj.weight = TaggedParameter(module.k_proj.weight.detach().clone())
    report = fusion.fuse(module)
    assert "qkv" not in report.counts()
    assert "TaggedParameter, not a plain nn.Parameter" in _qkv_refusal(report)


def test_attributes_stay_on_each_merged_parameter() -> None:
    """A merge keeps the Parameters, so attributes that differ between shards merge too."""
    module = hazards.Attention()
    module.q_proj.weight.no_decay = True
    assert fusion.fuse(module).counts().get("qkv") == 1
    assert module.q_proj.weight.no_decay is True and not hasattr(module.k_proj.weight, "no_decay")


def test_modulelist_experts_with_one_frozen_expert_keep_it_frozen() -> None:
    """Transformers 4 experts are never packed (`MODULELIST_REFUSAL`): each expert is merged
    on its own, and the frozen projection stays the frozen Parameter it was."""

    block = nn.Sequential(SparseMoeV4())
    frozen = block[0].experts[2].w1.weight.requires_grad_(False)
    report = fusion.fuse(block)
    assert "moe" not in report.counts(), str(report)
    assert any(
        s.reason.startswith("its experts are a Transformers 4 ModuleList") for s in report.skipped
    )
    assert block[0].experts[2].w1.weight is frozen and not frozen.requires_grad


def test_common_state_rules() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    a.tag = b.tag = "x"
    state = common_state({"a": a, "b": b})
    assert state.requires_grad and state.attributes == {"tag": "x"}
    merged = apply_state(nn.Parameter(torch.zeros(4), requires_grad=True), state)
    assert merged.tag == "x"
    b.tag = torch.zeros(1)  # tensors compare by identity only: not provably equal
    with pytest.raises(RewriteRefused, match="attribute 'tag'"):
        common_state({"a": a, "b": b})

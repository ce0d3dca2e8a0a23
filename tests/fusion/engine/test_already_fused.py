"""fusion.plan / fusion.fuse on a model that is already fused: "already fused" per module."""

from __future__ import annotations

import torch

import corpus
import fusion


def _fused(name: str):
    model = corpus.build(name, seed=0, dtype=torch.float32, device="cpu")
    first = fusion.fuse(model)
    assert first.applied
    return model, first


def test_plan_of_a_fused_model_says_already_fused_per_module():
    """Before: refusals with dtype dumps of hundreds of characters per FusedRMSNorm, and the
    rewritten attention and MLP modules not mentioned at all."""
    model, first = _fused("qwen3_moe")
    report = fusion.plan(model)
    assert report.applied == []
    reasons = {record.qualname: record.reason for record in report.skipped}
    assert all(reason.startswith("already fused") for reason in reasons.values()), reasons
    assert all(len(reason) < 80 for reason in reasons.values())
    assert reasons["model.norm"] == "already fused (its forward is a fused norm's)"
    assert reasons["model.layers.0.self_attn.qkv_proj"] == "already fused (MergedLinear)"
    assert reasons["model.layers.0.mlp"] == "already fused (FusedMoE)"
    assert reasons["model.layers.0.self_attn"].startswith("already fused (its forward")
    assert not any(".mlp." in name for name in reasons)  # a fused module's own parts
    # every module the first pass fused (or installed) is accounted for
    for record in first.applied:
        assert record.qualname in reasons, record


def test_fuse_again_reports_what_it_skips_and_changes_nothing():
    model, _ = _fused("llama")
    inputs = corpus.make_inputs(model, seed=0)
    with torch.no_grad():
        before = model(**inputs).logits
    report = fusion.fuse(model)
    assert report.applied == []
    assert {r.qualname for r in report.skipped} >= {
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.layers.0.mlp.gate_up_proj",
        "model.norm",
    }
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)

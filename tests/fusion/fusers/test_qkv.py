"""QKV fuser: real Transformers attention classes, and every hazard it must refuse."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusion
from fusion.runtime.merged import MergedLinear
from tests.fusion.fusers import hazards
from tests.fusion.fusers.helpers import fuse_copy, outputs_match, reasons
from tests.fusion.tiny_models import relative_error, tiny_model, token_ids

PROJECTION_MODELS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "granite",
]


@pytest.mark.parametrize("model_type", PROJECTION_MODELS)
def test_real_attention_fused_with_parity(model_type: str) -> None:
    model = tiny_model(model_type)
    fused, report = fuse_copy(model)
    counts = report.counts()
    assert counts.get("qkv") == 2, str(report)
    assert counts.get("glu") == 2, str(report)
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, MergedLinear)
    assert attn.qkv_proj.shards == (attn.q_proj, attn.k_proj, attn.v_proj)  # kept in place
    assert attn.qkv_proj.views_hold()
    q, k, v = attn.qkv_proj.output_sizes
    assert q == 4 * 16 and k == v == 2 * 16  # GQA: q widest, then k and v
    record = next(r for r in report.applied if r.fuser == "qkv")
    assert record.description == "q_proj + k_proj + v_proj -> qkv_proj"
    assert record.qualname == "model.layers.0.self_attn"
    ids = token_ids()
    with torch.no_grad():
        reference, out = model(ids).logits, fused(ids).logits
    assert not torch.isnan(out).any()
    assert relative_error(reference, out) <= 1e-5


def test_qwen2_biases_are_stacked() -> None:
    fused, _ = fuse_copy(tiny_model("qwen2"))
    merged = fused.model.layers[0].self_attn.qkv_proj
    assert merged.stacked_bias is not None and merged.shard_bias == (True, True, True)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_mha_gqa_mqa(kv_heads: int) -> None:
    model = tiny_model("llama", num_key_value_heads=kv_heads)
    fused, report = fuse_copy(model)
    assert report.counts()["qkv"] == 2
    assert fused.model.layers[1].self_attn.qkv_proj.output_sizes == [
        64,
        16 * kv_heads,
        16 * kv_heads,
    ]
    ids = token_ids()
    with torch.no_grad():
        assert relative_error(model(ids).logits, fused(ids).logits) <= 1e-5


def test_mixed_bias_presence_fuses_with_zero_bias() -> None:
    module = hazards.Attention()
    module.k_proj = nn.Linear(32, 16, bias=True)
    fused, report = fuse_copy(module)
    assert report.counts() == {"qkv": 1}
    merged = fused.qkv_proj
    assert merged.shard_bias == (False, True, False)
    assert torch.equal(merged.stacked_bias[:32], torch.zeros(32))
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (hazards.InplaceMethod, "may change between the projection calls"),
        (hazards.OutKeyword, "may change between the projection calls"),
        (hazards.InplaceKeyword, "may change between the projection calls"),
        (hazards.TorchUnderscore, "may change between the projection calls"),
        (hazards.ItemAssignment, "may change between the projection calls"),
        (hazards.ViewAlias, "may change between the projection calls"),
        (hazards.DiscardedCall, "may change between the projection calls"),
        (hazards.CalledTwice, "called more than once"),
        (hazards.InLoop, "inside a For"),
        (hazards.InGenerator, "inside a"),
        (hazards.WeightRead, "referenced beyond its call"),
        (hazards.PassedOn, "called more than once"),
        (hazards.ComparedEqual, "referenced beyond its call"),
    ],
)
def test_hazards_refused_with_reason(cls: type[nn.Module], reason: str) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert reason in reasons(report), str(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_rebinding_is_not_a_sibling_group() -> None:
    # After `hidden_states = hidden_states * 2.0` k and v read another value: no q/k/v triple,
    # and the remaining pair is separated by a statement that is not a projection assignment.
    module = hazards.Rebinding()
    fused, report = fuse_copy(module)
    assert "qkv" not in report.counts()
    assert outputs_match(module, fused, 2, 5, 32)


def test_different_inputs_never_fused_as_qkv() -> None:
    module = hazards.DifferentInputs()
    fused, report = fuse_copy(module)
    assert "qkv" not in report.counts()
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize("cls", [hazards.Guarded, hazards.Branchy, hazards.ShapeReads])
def test_safe_variants_fuse_with_identical_outputs(cls: type[nn.Module]) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert report.counts() == {"qkv": 1}, str(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_branch_not_taken_still_correct() -> None:
    module = hazards.Branchy()
    module.use_k = False
    fused, report = fuse_copy(module)
    assert report.counts() == {"qkv": 1}
    assert outputs_match(module, fused, 2, 5, 32)


def test_linear_subclass_with_own_forward_refused() -> None:
    module = hazards.Attention()
    module.k_proj = hazards.LinearWithForward(32, 16, bias=False)
    fused, report = fuse_copy(module)
    assert not report.applied
    assert "with its own forward" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize("hook", ["forward", "forward_pre"])
def test_hooked_projection_refused(hook: str) -> None:
    module = hazards.Attention()
    calls: list[int] = []
    if hook == "forward":
        module.v_proj.register_forward_hook(lambda *args: calls.append(1))
    else:
        module.v_proj.register_forward_pre_hook(lambda *args: calls.append(1))
    report = fusion.fuse(module)
    assert not report.applied
    assert "hooks" in reasons(report)
    module(torch.randn(1, 3, 32))
    assert calls == [1]  # the hook still fires: the module was left alone


def test_mixed_dtypes_refused() -> None:
    module = hazards.Attention()
    module.v_proj = module.v_proj.double()
    report = fusion.fuse(module)
    assert not report.applied
    assert "mixed dtypes" in reasons(report)


def test_mixed_devices_refused() -> None:
    module = hazards.Attention()
    module.v_proj = module.v_proj.to("meta")
    report = fusion.fuse(module)
    assert not report.applied
    assert "mixed devices" in reasons(report)


def test_heterogeneous_instances_of_one_class() -> None:
    wide, narrow, hooked = (
        hazards.Attention(q=32, kv=16),
        hazards.Attention(q=16, kv=8),
        hazards.Attention(),
    )
    narrow.o_proj = nn.Linear(8, 32, bias=False)
    hooked.k_proj.register_forward_hook(lambda *args: None)
    model = nn.ModuleList([wide, narrow, hooked])
    reference = copy.deepcopy(model)
    report = fusion.fuse(model)
    assert [r.qualname for r in report.applied] == ["0", "1"]
    assert {r.qualname for r in report.skipped} == {"2"}
    assert model[1].qkv_proj.output_sizes == [16, 8, 8]
    for original, fused in zip(reference, model):
        assert outputs_match(original, fused, 2, 5, 32)


def test_fused_and_unfused_copies_coexist() -> None:
    original = hazards.Attention()
    fused, _ = fuse_copy(original)
    assert "forward" not in original.__dict__
    assert hazards.Attention.forward.__code__.co_name == "forward"
    assert type(fused).forward is hazards.Attention.forward  # the class is untouched
    assert not hasattr(original, "qkv_proj") and isinstance(fused.qkv_proj, MergedLinear)
    assert fused.q_proj is not original.q_proj
    assert outputs_match(original, fused, 2, 5, 32)

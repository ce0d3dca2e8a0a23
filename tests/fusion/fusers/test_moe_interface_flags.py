"""MoE fuser on an older experts interface: Transformers 5.0's `use_experts_implementation`
sets only `has_bias` and `is_transposed`; the flags later releases added (`has_gate`,
`is_concatenated`, `has_post_expert_norm`, `_is_expert_parallel`) are absent because that
interface has no other variant. The fuser reads their absence as that one layout (structure,
not a version check), while a flag that is present and different still refuses."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

import fusion
from fusion.runtime.moe import FusedMoE
from tests.fusion.fusers.helpers import reasons
from tests.fusion.tiny_models import randomize_, relative_error

NEWER_FLAGS = ("has_gate", "is_concatenated", "has_post_expert_norm", "_is_expert_parallel")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*experts_implementation.*")


def _mixtral_with_older_interface() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize_(AutoModelForCausalLM.from_config(config), 0).eval()
    model.set_experts_implementation("eager")  # the eager loop reads none of the flags
    for layer in model.model.layers:
        for flag in NEWER_FLAGS:
            if flag in vars(layer.mlp.experts):
                delattr(layer.mlp.experts, flag)
    return model


def test_absent_newer_flags_read_as_the_only_layout() -> None:
    model = _mixtral_with_older_interface()
    assert not any(hasattr(model.model.layers[0].mlp.experts, f) for f in NEWER_FLAGS)
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert report.counts().get("moe") == 2, str(report)
    assert isinstance(fused.model.layers[0].mlp, FusedMoE)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = model(ids).logits, fused(ids).logits
    assert relative_error(expected, actual) <= 1e-5


@pytest.mark.parametrize(
    ("flag", "value"),
    [("has_gate", False), ("is_concatenated", False), ("has_post_expert_norm", True)],
)
def test_a_present_flag_still_decides(flag, value) -> None:
    model = _mixtral_with_older_interface()
    for layer in model.model.layers:
        setattr(layer.mlp.experts, flag, value)
    report = fusion.plan(model)
    expected = f"experts {flag}={value!r}"
    applied = [r for r in report.applied if r.fuser == "moe"]
    if flag == "is_concatenated":
        # No implementation reads this flag: the experts' own gating (`_apply_gate`, read as
        # a program) decides the split, so the experts are fused alone, the block refused.
        assert len(applied) == 2, str(report)
        assert all("experts alone" in r.description and expected in r.description for r in applied)
    else:  # another experts function: refused as a whole and alone
        assert not applied and expected in reasons(report)

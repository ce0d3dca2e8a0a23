"""harness.speed.bench.guard_cost: every per-call guard check of a fused model is found and timed
on the path it guards (no timing bound is asserted: speed claims come from runs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import corpus
import fusion
from harness.speed.bench import guard_cost


def _fused(arch: str) -> nn.Module:
    model = corpus.build(arch, seed=0, dtype=torch.float32, device="cpu").eval()
    fusion.fuse(model)
    return model


def test_checks_cover_rewritten_forwards_and_moe_blocks() -> None:
    model = _fused("qwen3_moe")
    checks = guard_cost.guard_checks(model)
    classes = {type(check.module).__name__ for check in checks}
    assert {"Qwen3MoeAttention", "FusedMoE"} <= classes
    assert all(check.holds() for check in checks)
    attention = next(c for c in checks if type(c.module).__name__ == "Qwen3MoeAttention")
    assert attention.guards > 0 and attention.globals_watched > 0


def test_a_check_sees_a_replaced_child() -> None:
    model = _fused("llama")
    check = next(c for c in guard_cost.guard_checks(model) if c.name.endswith("self_attn"))
    check.module.q_proj = nn.Linear(
        check.module.q_proj.in_features, check.module.q_proj.out_features
    )
    assert not check.holds()


def test_a_failing_guard_is_not_timed() -> None:
    model = _fused("llama")
    check = next(c for c in guard_cost.guard_checks(model) if c.name.endswith("self_attn"))
    check.module.q_proj.register_forward_hook(lambda *_: None)
    with pytest.raises(RuntimeError, match=check.name):
        guard_cost.module_cost(check, budget_s=0.01)


def test_table_has_a_row_per_class_and_a_step_total() -> None:
    result = guard_cost.arch_cost("llama", budget_s=0.01)
    assert result.modules and result.step_median_us > 0
    table = guard_cost.format_rows([result])
    assert "LlamaAttention" in table and "per decode step" in table
    assert 0 < result.share < 1

"""Sibling merge: the fallback for projections of one input no specific fuser claims
(gated attention's four projections, a cross-attention's k/v pair, a GLU whose activation
`ActAndMul` does not reproduce), with whatever code sits between the calls."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import corpus
import fusion
from fusion.runtime.merged import MergedLinear
from tests.fusion.fusers import hazards
from tests.fusion.fusers.helpers import fuse_copy, outputs_match, reasons


class FourWay(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 4, bias=False)
        self.c = nn.Linear(16, 8)
        self.out = nn.Linear(20, 16)

    def forward(self, x):
        a = self.a(x)
        b = self.b(x)
        c = self.c(x)
        return self.out(_cat(a, b, c))


def _cat(a, b, c):
    import torch

    return torch.cat([a, b, c], dim=-1)


class Interleaved(FourWay):
    def forward(self, x):
        a = self.a(x)
        a = a * 2
        b = self.b(x)
        c = self.c(x)
        return self.out(_cat(a, b, c))


class InterleavedWrite(FourWay):
    def forward(self, x):
        a = self.a(x)
        a = a * 2
        x[..., 0] = a[..., 0]
        b = self.b(x)
        c = self.c(x)
        return self.out(_cat(a, b, c))


def test_plain_assignments_merged() -> None:
    module = FourWay()
    fused, report = fuse_copy(module)
    assert report.counts() == {"sibling": 1}, str(report)
    assert fused.a_b_c_merged.output_sizes == [8, 4, 8]
    assert outputs_match(module, fused, 3, 16)


def test_statement_between_that_cannot_change_the_input_merged() -> None:
    module = Interleaved()
    fused, report = fuse_copy(module)
    assert report.counts() == {"sibling": 1}, str(report)
    assert outputs_match(module, fused, 3, 16)


def test_statement_between_that_writes_the_input_refused() -> None:
    module = InterleavedWrite()
    fused, report = fuse_copy(module)
    assert not report.applied
    assert "may change between the projection calls" in reasons(report)
    assert outputs_match(module, fused, 3, 16)


def test_qkv_preferred_over_sibling() -> None:
    _, report = fuse_copy(hazards.Attention())
    assert report.counts() == {"qkv": 1}


def test_gated_attention_merges_all_four_projections() -> None:
    module = hazards.GatedAttention()
    fused, report = fuse_copy(module)
    assert report.counts() == {"sibling": 1}, str(report)
    merged = fused.q_proj_k_proj_g_proj_v_proj_merged
    assert isinstance(merged, MergedLinear)
    assert merged.output_sizes == [32, 16, 16, 16]
    assert merged.shards == (fused.q_proj, fused.k_proj, fused.g_proj, fused.v_proj)
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (hazards.GatedInplaceBetween, "may change between the projection calls"),
        (hazards.GatedViewWrite, "may change between the projection calls"),
        (hazards.GatedHelperWrite, "may change between the projection calls"),
        (hazards.GatedAugmented, "may change between the projection calls"),
        (hazards.GatedChildWrites, "may change between the projection calls"),
        (hazards.GatedWeightEscapes, "referenced beyond its call"),
        (hazards.GatedProjectionPassedOn, "called more than once"),
    ],
)
def test_gated_hazards_refused_with_reason(cls: type[nn.Module], reason: str) -> None:
    module = cls()
    fused, report = fuse_copy(module)
    assert not report.applied, str(report)
    assert reason in reasons(report), str(report)
    assert outputs_match(module, fused, 2, 5, 32)


@pytest.mark.parametrize("hook", ["forward", "forward_pre"])
def test_gated_hooked_projection_refused(hook: str) -> None:
    module = hazards.GatedAttention()
    calls: list[int] = []
    if hook == "forward":
        module.g_proj.register_forward_hook(lambda *args: calls.append(1))
    else:
        module.g_proj.register_forward_pre_hook(lambda *args: calls.append(1))
    report = fusion.fuse(module)
    assert not report.applied
    assert "hooks" in reasons(report)
    module(torch.randn(1, 3, 32))
    assert calls == [1]


def test_gated_linear_subclass_refused() -> None:
    module = hazards.GatedAttention()
    module.g_proj = hazards.LinearWithForward(32, 16, bias=False)
    fused, report = fuse_copy(module)
    assert not report.applied
    assert "with its own forward" in reasons(report)
    assert outputs_match(module, fused, 2, 5, 32)


def test_cross_attention_pair_merged_on_both_paths() -> None:
    module = hazards.CrossAttentionPair()
    fused, report = fuse_copy(module)
    assert report.counts() == {"sibling": 1}, str(report)
    assert fused.k_proj_v_proj_merged.output_sizes == [16, 16]
    x = torch.randn(2, 5, 32)
    memory = torch.randn(2, 7, 32)
    with torch.no_grad():
        assert torch.allclose(module(x), fused(x), atol=1e-6)
        assert torch.allclose(module(x, memory), fused(x, memory), atol=1e-6)


@pytest.mark.parametrize(
    ("arch", "cls"),
    [
        ("whisper", "WhisperAttention"),  # cross-attention k/v pair, code between
        ("laguna", "LagunaAttention"),  # gated attention: q/k/v + g
        ("qwen3_5_text", "Qwen3_5GatedDeltaNet"),  # four linear-attention input projections
        ("doge", "DogeAttention"),  # norms of the model's own class between the calls
    ],
)
def test_corpus_architectures_fused_with_parity(arch: str, cls: str) -> None:
    model = corpus.build(arch, seed=0, dtype=torch.float32, device="cpu").eval()
    fused = copy.deepcopy(model)
    report = fusion.fuse(fused)
    assert any(r.fuser == "sibling" and r.source_class == cls for r in report.applied), str(report)
    inputs = corpus.make_inputs(model, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(fused(**inputs).logits, model(**inputs).logits)


def freeze_grad():
    torch.set_grad_enabled(False)


class GatedAfterBarrier(nn.Module):
    """Gated attention's shape: q/k/v, then a call not proven to keep global state (a cache
    update of an argument), then the gate read from the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16)
        self.k_proj = nn.Linear(16, 16)
        self.v_proj = nn.Linear(16, 16)
        self.g_proj = nn.Linear(16, 16)
        self.o_proj = nn.Linear(16, 16)

    def forward(self, x, cache=None):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if cache is not None:
            k, v = cache.update(k, v)
        gate = torch.sigmoid(self.g_proj(x))
        return self.o_proj((q + k + v) * gate)


class GatedAfterGradSwitch(GatedAfterBarrier):
    def forward(self, x, cache=None):
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        mixed = q + k + v
        freeze_grad()
        gate = torch.sigmoid(self.g_proj(x))
        torch.set_grad_enabled(True)
        return self.o_proj(mixed * gate)


def _output_and_grad(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    with torch.enable_grad():
        out = module(x)
        out.square().sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("cls", [GatedAfterBarrier, GatedAfterGradSwitch])
def test_a_region_barrier_splits_the_group(cls: type[nn.Module]) -> None:
    # The calls before the barrier merge; the gate after it stays a projection of its own,
    # run in the state it ran in (without gradient, behind `freeze_grad()`).
    module = cls()
    try:
        fused, report = fuse_copy(module)
    finally:
        torch.set_grad_enabled(True)  # tracing runs the forward's `freeze_grad()` too
    assert report.counts() == {"sibling": 1}, str(report)
    assert [r.description for r in report.applied] == [
        "q_proj + k_proj + v_proj -> q_proj_k_proj_v_proj_merged"
    ]
    assert isinstance(fused.g_proj, nn.Linear)
    assert fused.q_proj_k_proj_v_proj_merged.shards == (fused.q_proj, fused.k_proj, fused.v_proj)
    (out, grad), (fused_out, fused_grad) = _output_and_grad(module), _output_and_grad(fused)
    assert torch.allclose(out, fused_out, atol=1e-6)
    assert torch.allclose(grad, fused_grad, rtol=1e-5, atol=1e-6)


def test_a_product_of_two_projections_says_why_it_is_not_merged(load) -> None:
    """Issue 28: `self.a(x) * self.b(x)` used to get no reason at all: `a` makes the
    returned value and is excluded as the output projection, leaving one projection."""
    mods = load(
        "import torch.nn as nn\n"
        "class Product(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.a(x) * self.b(x)\n"
    )
    reasons = [s.reason for s in fusion.plan(mods.Product()).skipped if s.fuser == "sibling"]
    assert reasons == [
        "a and b read one input, but a makes the returned value (taken for the output "
        "projection, never merged): fewer than two remain"
    ]

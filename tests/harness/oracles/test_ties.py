"""harness.oracles.ties: near-tie top-k choices found from the unfused and float64 forwards, and the
logits verdict they make inconclusive (never pass) in harness.runner.arch_check."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from harness.oracles import ties
from harness.runner import arch_check
from tests.harness.fakes import faulty_fuse

FRAGILE_TOKEN = 5
"""The token id whose two router scores the reference separates by about 3 float32 ulps."""


class _Routed(nn.Module):
    """Each token goes to one of two experts by a top-1 router; a running mean over positions
    makes every later position of a row depend on each earlier choice, as attention does."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(8, 4)
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
            embed = self.embed.weight.double()
            # Scores 10 + w.h: float32 spacing near 10 is 9.5e-7. Expert 1 leads by 3e-6 for
            # FRAGILE_TOKEN only (by at least 0.1 elsewhere, checked by the tests).
            u = torch.randn(4, generator=generator, dtype=torch.float64)
            e = embed[FRAGILE_TOKEN]
            u += (3e-6 - u @ e) * e / (e @ e)
            self.router.weight.copy_(torch.stack([torch.zeros(4, dtype=torch.float64), u]))
            self.router.bias.fill_(10.0)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        choice = torch.topk(self.router(h), 1, dim=-1).indices
        out = torch.where(choice == 0, self.experts[0](h), self.experts[1](h))
        positions = torch.arange(1, out.shape[1] + 1, dtype=out.dtype)[:, None]
        return self.head(out.cumsum(1) / positions)


def _inputs() -> dict:
    ids = torch.tensor([[1, 2, 3, FRAGILE_TOKEN, 4, 6], [6, 4, 2, 1, 3, 7]])
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _nudge(by: float):
    """A system that moves expert 1's router score by `by`: -5e-6 is within the router's own
    tolerance (1e-6 of scores near 10, as a rounding difference would be), -1.0 is not."""
    return faulty_fuse("router", change=lambda out: out + torch.tensor([0.0, by]), note="nudge")


def _check(fuse) -> arch_check.ArchResult:
    options = dataclasses.replace(arch_check.CheckOptions(), lifecycle="off")
    return arch_check.check_model("routed", _Routed(), _inputs(), options, fuse=fuse).result


def test_the_model_has_one_near_tie_and_clear_margins_elsewhere():
    model = _Routed()
    with torch.no_grad():
        scores = model.router(model.embed.weight.double().float()).double()
    margins = scores[:, 1] - scores[:, 0]
    assert 0 < margins[FRAGILE_TOKEN] < 1e-5
    assert (margins.abs()[torch.arange(8) != FRAGILE_TOKEN] > 0.1).all()


def test_a_flip_at_a_near_tie_only_is_inconclusive_naming_the_token():
    result = _check(_nudge(-5e-6))
    assert result.status == "inconclusive", result.message
    assert "near-tie top-k choices" in result.message
    assert "token (0, 3)" in result.message  # FRAGILE_TOKEN's place
    assert "the other 7 of 10 tokens pass" in result.message
    assert not [f for f in result.failures if f.kind == "model-parity"]


def test_a_flip_beyond_the_noise_still_fails():
    """A nudge of 1.0 flips tokens whose margin is far above the unfused model's error."""
    result = _check(_nudge(-1.0))
    assert result.status == "fail", result.message
    assert "near-tie" not in result.message


def test_a_fault_elsewhere_still_fails_despite_the_near_tie():
    """The near-tie's tokens leave the mask; the other tokens are still judged (the fault is
    in a module the report does not name, so only the logits can show it)."""
    near_tie = _nudge(-5e-6)

    def both(model):
        report = near_tie(model)
        head = model.head.forward
        model.head.forward = lambda x: head(x) * 1.01
        return report

    result = _check(both)
    assert result.status == "fail", result.message
    assert result.message.startswith("logits: ") and "near-tie" not in result.message
    assert [m.status for m in result.modules] == ["pass"]


def test_fragile_rows_are_those_within_twice_the_unfused_error_or_the_floor():
    exact = ties.TopkCall(
        torch.tensor([[1.0, 0.999, 0.0], [1.0, 0.5, 0.0]], dtype=torch.float64), 1
    )
    mine = ties.TopkCall(torch.tensor([[1.0, 0.9996, 0.0], [1.0, 0.5, 0.0]]), 1)
    rows = ties.fragile_rows([mine], [exact], torch.float32)
    assert [(r.call, r.row) for r in rows] == [(0, 0)]  # margin 1e-3 <= 2 x error 6e-4
    assert rows[0].margin == pytest.approx(1e-3) and rows[0].noise == pytest.approx(
        1.2e-3, rel=1e-3
    )
    floor = ties.fragile_rows([exact], [exact], torch.bfloat16)  # no error: bf16 floor 2e-3
    assert [r.row for r in floor] == [0]
    assert ties.fragile_rows([exact], [exact], torch.float32) == []


def test_calls_that_do_not_pair_up_excuse_nothing():
    call = ties.TopkCall(torch.zeros(2, 3), 1)
    assert ties.fragile_rows([call], [], torch.float32) is None
    assert ties.fragile_rows([call], [ties.TopkCall(torch.zeros(2, 3), 2)], torch.float32) is None
    everything = ties.TopkCall(torch.zeros(2, 3), 3)  # every score chosen: nothing to flip
    assert ties.fragile_rows([everything], [everything], torch.float32) == []


def test_record_topk_sees_both_spellings_and_negates_smallest():
    x = torch.tensor([[3.0, 1.0, 2.0]])
    with ties.record_topk() as calls:
        torch.topk(x, 2)
        x.topk(1, dim=-1, largest=False)
    assert [c.k for c in calls] == [2, 1]
    assert torch.equal(calls[1].scores, -x)


def test_clean_mask_drops_the_token_and_the_rest_of_its_row():
    mask = torch.ones(2, 4, dtype=torch.bool)
    calls = [ties.TopkCall(torch.zeros(8, 2), 1)]
    clean = ties.clean_mask(mask, [ties.FragileRow(0, 5, 0.0, 1.0)], calls)
    assert clean.tolist() == [[True] * 4, [True, False, False, False]]
    elsewhere = [ties.TopkCall(torch.zeros(3, 2), 1)]  # not one row per token: unplaceable
    assert ties.clean_mask(mask, [ties.FragileRow(0, 1, 0.0, 1.0)], elsewhere) is None

"""`fusion.fusers.moe.gate`: gating read as a program and proven equal op for op; the
program replays the module's gating bit for bit on every float dtype; what is not a
replayable program is refused."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.errors import RewriteRefused
from fusion.fusers.moe.gate import canonical, gate_program, proven_gate, trace_gate
from fusion.runtime.experts import run_gate

WIDTH = 16


class Gating(nn.Module):
    """An experts stand-in: only `_apply_gate` (and what it reads) matters here."""

    def __init__(self, fn, **attributes) -> None:
        super().__init__()
        self.fn = fn
        for name, value in attributes.items():
            setattr(self, name, value)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.fn(self, gate_up)


def default(self, x):
    gate, up = x.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def gpt_oss(self, x):
    gate, up = x[..., ::2], x[..., 1::2]
    gate = gate.clamp(min=None, max=self.limit)
    up = up.clamp(min=-self.limit, max=self.limit)
    glu = gate * torch.sigmoid(gate * self.alpha)
    return (up + 1) * glu


def upcast(self, x):
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def softcap(self, x):
    gate, up = x.chunk(2, dim=-1)
    dtype = gate.dtype
    gate, up = gate.float(), up.float()
    return (torch.tanh(gate / 4.0) * 4.0 * torch.sigmoid(gate) * torch.tanh(up / 9) * 9).to(dtype)


CASES = {
    "silu": (default, dict(act_fn=nn.SiLU()), "silu"),
    "gelu_tanh": (default, dict(act_fn=nn.GELU(approximate="tanh")), "gelu_tanh"),
    "gpt_oss": (gpt_oss, dict(limit=7.0, alpha=1.702), None),
    "upcast": (upcast, {}, None),
    "softcap": (softcap, {}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_program_replays_the_gating_bit_for_bit(case: str, dtype: torch.dtype) -> None:
    fn, attributes, activation = CASES[case]
    module = Gating(fn, **attributes)
    program = gate_program(module, WIDTH)
    assert program.activation == activation
    x = (4 * torch.randn(9, WIDTH, generator=torch.Generator().manual_seed(1))).to(dtype)
    expected = module._apply_gate(x)
    actual = run_gate(program, x)
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def test_changed_constant_is_another_program() -> None:
    a = gate_program(Gating(gpt_oss, limit=7.0, alpha=1.702), WIDTH)
    b = gate_program(Gating(gpt_oss, limit=6.0, alpha=1.702), WIDTH)
    assert a != b and a.to_json() != b.to_json()


def test_canonical_form_ignores_operand_order_and_int_constants_only() -> None:
    def f(x):
        return (x + 1) * torch.sigmoid(x)

    def g(x):
        return torch.sigmoid(x) * (1.0 + x)

    def h(x):
        return (x - 1) * torch.sigmoid(x)

    traces = [canonical(trace_gate(fn, WIDTH, torch.bfloat16)) for fn in (f, g, h)]
    assert traces[0] == traces[1] != traces[2]


def fixed_bfloat16(self, x):
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def dropout(self, x):
    gate, up = x.chunk(2, dim=-1)
    return F.dropout(F.silu(gate), 0.1, True) * up


def reads_parameter(self, x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up * self.scale


def in_place(self, x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        # Read at bfloat16 as "back to the input dtype"; at float16 it is not: caught.
        (fixed_bfloat16, "not reproduced op for op"),
        (dropout, "is not one a fused kernel replays"),
        # A CPU parameter does not even trace with meta inputs; either way, refused.
        (reads_parameter, "gating reads module state|gating does not trace"),
        (in_place, "is not one a fused kernel replays"),
    ],
)
def test_gatings_that_are_not_replayable_programs_are_refused(fn, reason: str) -> None:
    module = Gating(fn, scale=nn.Parameter(torch.ones(WIDTH // 2)))
    with pytest.raises(RewriteRefused, match=reason):
        gate_program(module, WIDTH)


# --- one program for every call (issue 24): rows, modes and what the gating reads ------------


def decode_only(self, x):
    gate, up = x.chunk(2, dim=-1)
    if x.shape[0] == 1:
        return F.silu(gate) * up * 2
    return F.silu(gate) * up


def sliced_by_rows(self, x):
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) * up)[: max(1, x.shape[0] // 2)].repeat(2, 1)[: x.shape[0]]


def training_only(self, x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up * (0.5 if self.training else 1.0)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (decode_only, "depends on the row count"),
        (sliced_by_rows, "depends on the row count"),
        (training_only, "depends on training mode"),
    ],
)
def test_gatings_that_are_not_one_program_are_refused(fn, reason: str) -> None:
    for training in (False, True):
        module = Gating(fn).train(training)
        with pytest.raises(RewriteRefused, match=reason):
            gate_program(module, WIDTH)
        assert module.training is training  # the mode is restored


def reads_namespace(self, x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=self.settings.limit)) * up


def test_gating_reading_an_object_a_guard_cannot_see_is_refused() -> None:
    module = Gating(reads_namespace, settings=types.SimpleNamespace(limit=7.0))
    with pytest.raises(RewriteRefused, match=r"settings \(SimpleNamespace\).*cannot see"):
        gate_program(module, WIDTH)


class Softcap(nn.Module):
    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / self.cap) * self.cap


def softcapped(self, x):
    gate, up = x.chunk(2, dim=-1)
    return self.act_fn(gate) * self.capped(up)


def test_what_the_gating_reads_is_recorded_through_its_modules() -> None:
    gpt = Gating(gpt_oss, limit=7.0, alpha=1.702)
    assert {("", "limit"), ("", "alpha"), ("", "fn")} <= set(proven_gate(gpt, WIDTH).reads)
    module = Gating(softcapped, act_fn=nn.SiLU(), capped=Softcap(9.0))
    reads = set(proven_gate(module, WIDTH).reads)
    assert {("", "act_fn"), ("", "capped"), ("capped", "cap")} <= reads
    assert not any(name in ("training", "_forward_hooks", "_call_impl") for _, name in reads)
    assert type(module) is Gating and type(module.capped) is Softcap  # classes restored

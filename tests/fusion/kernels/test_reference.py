"""`fusion.kernels.reference`: the reference kernels compute the functions their docstrings
define, checked against the plainest spelling of each (a per-token loop, the Llama and Gemma
norms written out)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion.kernels import reference as torch_ref
from fusion.kernels.norm_variant import NormVariant


def _loop_experts(hidden, gate_up, down, ids, weights, activation):
    """Transformers' eager expert loop, token by token: each routed product rounded to the
    input dtype, then summed."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            projected = hidden[t] @ gate_up[e].t()
            inter = projected.shape[-1] // 2
            act = torch_ref.ACTIVATIONS[activation](projected[:inter]) * projected[inter:]
            out[t] += (weights[t, k] * (act @ down[e].t())).to(hidden.dtype)
    return out


@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
@pytest.mark.parametrize("grad", [False, True])
def test_moe_experts_is_the_expert_loop(activation: str, grad: bool) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g, dtype=torch.float64)
    gate_up = torch.randn(4, 24, 16, generator=g, dtype=torch.float64, requires_grad=grad)
    down = torch.randn(4, 16, 12, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g, dtype=torch.float64)
    got = torch_ref.moe_experts(hidden, gate_up, down, ids, weights, activation)
    want = _loop_experts(hidden, gate_up, down, ids, weights, activation)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if grad:
        got.sum().backward()
        assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0


def test_moe_experts_with_no_tokens_or_no_choices_is_zeros() -> None:
    gate_up, down = torch.randn(2, 8, 4), torch.randn(2, 4, 4)
    empty = torch_ref.moe_experts(
        torch.randn(0, 4),
        gate_up,
        down,
        torch.zeros(0, 1, dtype=torch.long),
        torch.ones(0, 1),
        "silu",
    )
    assert empty.shape == (0, 4)
    none = torch_ref.moe_experts(
        torch.randn(3, 4),
        gate_up,
        down,
        torch.zeros(3, 0, dtype=torch.long),
        torch.ones(3, 0),
        "silu",
    )
    assert torch.equal(none, torch.zeros(3, 4))


def test_act_and_mul_gate_first() -> None:
    x = torch.randn(3, 10)
    assert torch.equal(torch_ref.act_and_mul(x, "silu"), F.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_llama_and_gemma_orders(dtype: torch.dtype) -> None:
    """`weight_after_cast` is Llama's order; without it Gemma's `(1 + w)` in float32; both
    bit-identical to the modules' own spelling."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 32, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    llama = w * h.to(dtype)
    assert torch.equal(torch_ref.rms_norm(x, w, 1e-6), llama)
    gemma = (h * (1.0 + w.float())).to(dtype)
    got = torch_ref.rms_norm(x, w, 1e-6, variant=NormVariant(offset=1.0, weight_after_cast=False))
    assert torch.equal(got, gemma)
    assert torch.equal(torch_ref.rms_norm(x, None, 1e-6), h.to(dtype))


@pytest.mark.parametrize("after", [False, True])
def test_rms_norm_traces_with_fx_and_dynamo(after: bool) -> None:
    # The RMSNorm fuser compares variants through fx traces of the reference (no branching
    # on dim() or dtypes there), and compiled fused models trace it with Dynamo (the variant
    # a constant attribute of the module, as `FusedRMSNorm` holds it).
    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))
            self.variant = NormVariant(offset=1.0, weight_after_cast=after)

        def forward(self, x):
            return torch_ref.rms_norm(x, self.weight, 1e-6, variant=self.variant)

    norm = Norm()
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    expected = norm(x)
    traced = torch.fx.symbolic_trace(norm)
    assert torch.equal(traced(x), expected)
    compiled = torch.compile(norm, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_llama_order_in_half_precision_is_one_aten_norm_and_a_product(dtype, offset) -> None:
    """The weight-after-cast order in bf16/fp16 (Llama, Qwen3) is `scale * torch.rms_norm(x,
    None)`: the weightless ATen norm is `n.to(x.dtype)`, then the product. Bit for bit."""
    variant = NormVariant(offset, True, True, False)
    generator = torch.Generator().manual_seed(1)
    for shape in ((1, 7), (16, 128), (3, 5, 1024), (2, 4096)):
        x = (3 * torch.randn(*shape, generator=generator)).to(dtype)
        w = (0.3 * torch.randn(shape[-1], generator=generator) + 1).to(dtype)
        norm = torch_ref.aten_norm(x, w, variant)
        assert norm is not None and norm.weight is None and norm.after is not None
        expected = torch_ref.rms_norm(x, w, 1e-6, variant=variant)
        assert torch.equal(torch_ref.aten_rms_norm(x, norm, 1e-6), expected), shape


def test_aten_shortcuts_need_the_composite(monkeypatch) -> None:
    """A torch build that registers a CPU kernel of its own for the norm (its own reduction
    order) gets the plain ops: no shortcut is taken on the strength of an old build."""
    x, w = torch.randn(4, 64), torch.randn(64)
    assert torch_ref.aten_norm(x, w, NormVariant(0.0, True, False, False)) is not None
    monkeypatch.setattr(torch_ref, "ATEN_RMS_NORM_IS_COMPOSITE", False)
    assert torch_ref.aten_norm(x, w, NormVariant(0.0, True, False, False)) is None
    called = []
    monkeypatch.setattr(torch, "rms_norm", lambda *a, **k: called.append(a))
    torch_ref.TorchKernels().rms_norm(x, w, 1e-6)
    assert called == []


def test_cast_to_a_wider_weight_is_not_the_aten_cast() -> None:
    """T5's order casts the normalised value to the weight's dtype: `torch.rms_norm` casts
    to the input's, so no shortcut when the two differ."""
    x, w = torch.randn(4, 64).to(torch.bfloat16), torch.randn(64)
    assert torch_ref.aten_norm(x, w, NormVariant(0.0, True, True, True)) is None
    assert torch_ref.aten_norm(x, w.to(torch.bfloat16), NormVariant(0.0, True, True, True))

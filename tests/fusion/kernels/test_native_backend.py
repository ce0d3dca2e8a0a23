"""Tests for `fusion/kernels/native_backend.py`: the experts on the native kernel compute
the reference's function, fail closed to the reference, keep no weight state, and `auto`
takes the backend where oneDNN is not picked but the kernel is on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusion import kernels, numerics
from fusion.kernels import native_backend, native_gemm, onednn_backend, torch_ref

pytestmark = pytest.mark.skipif(
    native_gemm.status() != "available",
    reason=f"the native kernel is off on this machine: {native_gemm.status()}",
)


@pytest.fixture
def small_weights(monkeypatch):
    """Test-sized experts take the kernel (its size rule is a speed rule)."""
    monkeypatch.setattr(native_gemm, "MIN_ELEMENTS", 0)


def _experts(tokens: int, hidden: int = 128, inter: int = 96, experts: int = 8, top_k: int = 4):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), top_k)
    return x, gate_up, down, ids, weights


def _spy(monkeypatch) -> list[tuple[int, ...]]:
    taken: list[tuple[int, ...]] = []
    real = native_gemm.linear
    monkeypatch.setattr(
        native_gemm, "linear", lambda x, w, b: taken.append(tuple(w.shape)) or real(x, w, b)
    )
    return taken


@pytest.mark.parametrize("activation", sorted(torch_ref.ACTIVATIONS))
@pytest.mark.parametrize("tokens", [1, 3, 16, 60])
def test_experts_compute_the_reference_function(
    small_weights, monkeypatch, activation: str, tokens: int
) -> None:
    """Both GEMMs of every selected expert on the kernel, and the result within 1.5x the
    reference's error against float64 (as every backend's experts)."""
    taken = _spy(monkeypatch)
    backend = native_backend.create()
    x, gate_up, down, ids, weights = _experts(tokens)
    with torch.no_grad():
        got = backend.moe_experts(x, gate_up, down, ids, weights, activation)
        ref = torch_ref.moe_experts(x, gate_up, down, ids, weights, activation)
    exact = torch_ref.moe_experts(
        x.double(), gate_up.double(), down.double(), ids, weights.double(), activation
    )
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert numerics.relative_error(got, exact) <= 1.5 * numerics.relative_error(ref, exact) + 6e-8
    active = len(set(ids.flatten().tolist()))
    assert sorted(taken) == sorted([(192, 128), (128, 96)] * active)


def test_falls_back_to_the_reference(small_weights, monkeypatch) -> None:
    """Autograd recording (weights or routing weights), other dtypes, an expert with more
    rows than the kernel's limit, and no routed tokens all run the reference: the kernel
    is never called, and the values are the reference's bit for bit."""
    taken = _spy(monkeypatch)
    backend = native_backend.create()
    x, gate_up, down, ids, weights = _experts(16)

    def same_as_reference(*args) -> None:
        got = backend.moe_experts(*args, "silu")
        assert torch.equal(got, torch_ref.moe_experts(*args, "silu"))

    same_as_reference(x, gate_up, down, ids, weights.requires_grad_())
    weights = weights.detach()
    same_as_reference(x, gate_up.requires_grad_(), down, ids, weights)
    gate_up = gate_up.detach()
    with torch.no_grad():
        same_as_reference(x.double(), gate_up.double(), down.double(), ids, weights.double())
        same_as_reference(x[:0], gate_up, down, ids[:0], weights[:0])
        state = native_gemm._STATE[0]
        monkeypatch.setattr(
            native_gemm,
            "_STATE",
            [dataclasses.replace(state, limits=native_gemm.RowLimits(3, 1 << 20))],
        )
        same_as_reference(x, gate_up, down, ids, weights)  # some expert has 4+ rows
    assert taken == []


def test_no_weight_state_and_writes_are_seen(small_weights) -> None:
    """Nothing derived from a weight outlives a call: the backend has no attributes, and a
    write through `.data` between calls is seen by the next."""
    backend = native_backend.create()
    x, gate_up, down, ids, weights = _experts(5)
    with torch.no_grad():
        backend.moe_experts(x, gate_up, down, ids, weights, "silu")
        gate_up.data.mul_(-0.5)
        got = backend.moe_experts(x, gate_up, down, ids, weights, "silu")
        torch.testing.assert_close(
            got, torch_ref.moe_experts(x, gate_up, down, ids, weights, "silu")
        )
    assert vars(backend) == {}


def test_auto_takes_it_where_onednn_is_not_picked(monkeypatch) -> None:
    """On a machine where oneDNN's GEMMs are not auto-picked (AVX2), `auto` resolves to
    this backend; where oneDNN is picked it still comes first (it uses the kernel too)."""
    monkeypatch.setattr(kernels, "_INSTANCES", {})
    monkeypatch.setattr(kernels, "_AUTO", {})
    monkeypatch.setattr(onednn_backend, "AUTO_CAPABILITIES", frozenset())
    assert kernels.get("auto", "cpu").name == "native"
    assert "native" in kernels.available_backends("cpu")
    monkeypatch.setattr(kernels, "_INSTANCES", {})
    monkeypatch.setattr(kernels, "_AUTO", {})
    monkeypatch.setattr(onednn_backend, "AUTO_CAPABILITIES", frozenset({"AVX512", "AVX2"}))
    if kernels._instance("onednn") is not None:
        assert kernels.get("auto", "cpu").name == "onednn"


def test_unavailable_where_the_kernel_is_off(monkeypatch) -> None:
    monkeypatch.setattr(native_gemm, "status", lambda: "no C compiler ('cc' is not on PATH)")
    assert native_backend.create() is None

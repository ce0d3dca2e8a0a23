"""Tests for `fusion/kernels/native/backend.py`: the experts on the native kernel compute
the reference's function, fail closed to the reference, keep no weight state, and `auto`
takes the backend where oneDNN is not picked but the kernel is on."""

from __future__ import annotations

import pytest
import torch

from fusion import kernels, numerics
from fusion.kernels import onednn as onednn_backend
from fusion.kernels import ops
from fusion.kernels import reference as torch_ref
from fusion.kernels.calibration import Entry, Ratio, Table
from fusion.kernels.native import backend as native_backend
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.policy import POLICY, row_bucket

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
    real = native_gemm.run
    monkeypatch.setattr(
        native_gemm, "run", lambda f, x, w, *a: taken.append(tuple(w.shape)) or real(f, x, w, *a)
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
        native_gemm.NATIVE.pretend_available(native_gemm.RowLimits(3, 1 << 20))
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


def test_auto_experts_take_it_only_where_the_policy_chooses_it(monkeypatch) -> None:
    """On a CPU `auto` is the reference backend; its experts run on this backend only where
    the kernel policy chooses it: with nothing measured, the reference; in `eligible` mode
    (the static rules) here when oneDNN is not auto-picked (AVX2); with a table that
    measured it faster, here."""
    if native_backend.create() is None:
        pytest.skip(f"native kernel off here: {native_gemm.status()}")
    assert kernels.get("auto", "cpu").name == "torch"
    x, gate_up, down, ids, weights = _experts(1)
    chosen = []
    real = native_backend.NativeKernels.moe_experts
    monkeypatch.setattr(
        native_backend.NativeKernels,
        "moe_experts",
        lambda self, *a: chosen.append("native") or real(self, *a),
    )
    with torch.no_grad():
        ops.moe_experts("auto", x, gate_up, down, ids, weights, "silu")
        assert chosen == []
        monkeypatch.setattr(onednn_backend, "AUTO_CAPABILITIES", frozenset())
        with kernels.REGISTRY.fresh():  # backends constructed as on AVX2, for this block only
            POLICY.use("eligible")
            ops.moe_experts("auto", x, gate_up, down, ids, weights, "silu")
            assert chosen == ["native"]
            POLICY.use("measured")
            shape = (*gate_up.shape, ids.shape[-1])
            POLICY.set_table(_table_preferring("native", "experts", shape, x.shape[0]))
            ops.moe_experts("auto", x, gate_up, down, ids, weights, "silu")
            assert chosen == ["native", "native"]
            ops.moe_experts("torch", x, gate_up, down, ids, weights, "silu")
            assert chosen == ["native", "native"]


def _table_preferring(kernel: str, op: str, shape: tuple[int, ...], rows: int) -> Table:
    """A calibration table in which `kernel` measured 1.5x the reference at this key."""
    table = Table("test")
    table.add(
        Entry(
            op=op,
            shape=tuple(shape),
            dtype="float32",
            rows=row_bucket(rows),
            threads=torch.get_num_threads(),
            median_us={"reference": 150.0, kernel: 100.0},
            ratios={kernel: Ratio(1.5, 1.4, 1.6)},
            rounds=9,
            native_build=native_gemm.build_id(),
        )
    )
    return table


def test_unavailable_where_the_kernel_is_off(monkeypatch) -> None:
    monkeypatch.setattr(native_gemm, "status", lambda: "no C compiler ('cc' is not on PATH)")
    assert native_backend.create() is None

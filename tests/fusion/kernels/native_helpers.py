"""Shared by the tests of the CPU fast paths' users: turn one path on (or off) for
test-sized operands on any machine."""

from __future__ import annotations

import pytest
from torch import nn

from fusion.kernels import onednn as onednn_backend
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.policy import POLICY
from fusion.runtime import linear_forward


def decode_linear(in_features: int, out_features: int, **kwargs) -> nn.Linear:
    """A plain `nn.Linear` with the forward the `decode_linear` fuser installs
    (`fusion.runtime.linear_forward.LinearForward`, backend `auto`), whatever its size."""
    module = nn.Linear(in_features, out_features, **kwargs)
    linear_forward.install(module, "auto")
    return module


def force_native_on(monkeypatch) -> None:
    """Let `native_gemm.applies` answer for small operands on any machine where the kernel
    built (skip where it did not), and the kernel policy run every eligible kernel: its
    size and capability rules are speed rules, tested on their own in test_native_gemm.py,
    and the measured choice is tested in test_policy.py. The suite's autouse fixture ends
    the pretence and restores the policy."""
    machine = native_gemm.NATIVE.machine()
    if machine.function is None:
        pytest.skip(f"native kernel not built here: {machine.reason}")
    monkeypatch.setattr(native_gemm, "MIN_ELEMENTS", 0)
    native_gemm.NATIVE.pretend_available(native_gemm.LIMITS["AVX512"])
    POLICY.use("eligible")


def force_native_off() -> None:
    """`native_gemm.applies` answers False everywhere, as on a machine without a compiler
    (until the suite's autouse fixture ends the pretence)."""
    native_gemm.NATIVE.pretend_off("off for this test")


def force_onednn_row_on(monkeypatch) -> None:
    """Let `onednn_backend.row_linear_applies` answer True for small operands on any machine
    whose torch has the oneDNN ops (skip where it has not): its AVX-512 and size rules are
    speed rules (oneDNN's one-row product computes the same function on AVX2). The suite's
    autouse fixture forgets the pretence and restores the policy."""
    if not onednn_backend._ops_available():
        pytest.skip("oneDNN's linear ops are not in this torch build")
    onednn_backend.ROW_MACHINE.pretend(True)
    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    POLICY.use("eligible")

"""Shared by the tests of the native kernel's users: turn it on for test-sized operands."""

from __future__ import annotations

import pytest

from fusion.kernels import native_gemm


def force_native_on(monkeypatch) -> None:
    """Let `native_gemm.applies` answer for small operands on any machine where the kernel
    built (skip where it did not): its size and capability rules are speed rules, tested on
    their own in test_native_gemm.py."""
    if not native_gemm.built():
        pytest.skip(f"native kernel not built here: {native_gemm._STATE[0].reason}")
    monkeypatch.setattr(native_gemm, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(
        native_gemm,
        "_STATE",
        [
            native_gemm.Resolved(
                native_gemm._STATE[0].function, "built", "available", native_gemm.LIMITS["AVX512"]
            )
        ],
    )

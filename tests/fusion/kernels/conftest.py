"""Fixtures of the kernel tests: the fast paths that ran (`taken`), and the float32 matmul
precision settings restored after a test (`restore_precision`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fusion.kernels import onednn as onednn_backend
from fusion.kernels.native import gemm as native_gemm
from fusion.trace.tracer import FP32_PRECISION_KEYS

_PRECISION_KEYS = FP32_PRECISION_KEYS


def _precision_settings() -> list[str]:
    return [torch._C._get_fp32_precision_getter(b, op) for b, op in _PRECISION_KEYS]


@pytest.fixture
def restore_precision() -> Iterator[None]:
    """Whatever a test sets (the legacy `set_float32_matmul_precision` or the per-backend
    `fp32_precision` settings), every setting is as it was afterwards."""
    saved = _precision_settings()
    yield
    for (b, op), value in zip(_PRECISION_KEYS, saved):
        torch._C._set_fp32_precision_setter(b, op, value)
    assert _precision_settings() == saved


@pytest.fixture
def taken(monkeypatch) -> list[str]:
    """The fast paths that ran, in call order."""
    calls: list[str] = []
    real_native, real_row = native_gemm.run, onednn_backend.row_linear
    monkeypatch.setattr(native_gemm, "run", lambda *a: calls.append("native") or real_native(*a))
    monkeypatch.setattr(
        onednn_backend, "row_linear", lambda *a: calls.append("onednn_row") or real_row(*a)
    )
    return calls

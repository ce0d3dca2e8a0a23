"""Tests for the kernel layer's process state objects: `native_gemm.NATIVE`,
`onednn_backend.ROW_MACHINE` and `fusion.kernels.REGISTRY`. Each is computed at first use,
pretended or installed over by tests through public methods, and put back by `reset`,
`stop_pretending`, `uninstall` or `fresh` without rebuilding what need not be rebuilt."""

from __future__ import annotations

import pytest
import torch

from fusion import kernels
from fusion.kernels import onednn as onednn_backend
from fusion.kernels.native import build as native_build
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.native.gemm import NATIVE
from fusion.kernels.onednn import ROW_MACHINE
from fusion.kernels.reference import TorchKernels


def _no_builds(monkeypatch) -> None:
    """Any build from here on fails the test: what follows must reuse what was resolved."""

    def refuse(*args, **kwargs):
        raise AssertionError("the native kernel was built again")

    monkeypatch.setattr(native_build, "build", refuse)


def test_pretences_end_without_a_rebuild(monkeypatch) -> None:
    """`pretend_off` and `pretend_available` change what every check reads; `stop_pretending`
    goes back to this machine's answer (the same object) without building again."""
    machine = NATIVE.machine()
    _no_builds(monkeypatch)
    NATIVE.pretend_off("off for this test")
    assert not native_gemm.built() and not native_gemm.known_ok()
    assert native_gemm.status() == "off for this test"
    assert not native_gemm.rows_ok(1, 16)
    with pytest.raises(RuntimeError, match="off for this test"):
        native_gemm.linear(torch.randn(1, 16), torch.randn(4, 16), None)
    assert NATIVE.machine() is machine  # a pretence never replaces the machine's answer
    NATIVE.stop_pretending()
    assert NATIVE.current is machine and native_gemm.status() == machine.verdict
    if machine.function is None:
        with pytest.raises(RuntimeError, match="not built here"):
            NATIVE.pretend_available(native_gemm.RowLimits(2, 64))
        return
    NATIVE.pretend_available(native_gemm.RowLimits(2, 64))
    assert native_gemm.known_ok() and native_gemm.status() == "available"
    assert native_gemm.rows_ok(2, 32) and not native_gemm.rows_ok(3, 16)
    assert not native_gemm.rows_ok(2, 48)  # 96 input elements > 64
    assert NATIVE.current.function is machine.function
    assert native_gemm.build_id() == machine.build


def test_known_ok_never_resolves() -> None:
    """Before anything is resolved `known_ok` and `rows_ok` answer False and build nothing
    (they are plain reads, for traced code); the first use resolves."""
    with NATIVE.fresh():
        assert NATIVE.current is None
        assert not native_gemm.known_ok() and not native_gemm.rows_ok(1, 16)
        assert NATIVE.current is None
        native_gemm.resolve()
        assert NATIVE.current is not None
        assert native_gemm.known_ok() == (NATIVE.current.verdict == "available")


def test_fresh_resolves_again_and_puts_back(monkeypatch) -> None:
    """Inside `fresh` the kernel is resolved anew under the block's settings; afterwards the
    answer (and pretence) from before is back, so the block's build serves nothing else."""
    before = NATIVE.machine()
    NATIVE.pretend_off("outside")
    monkeypatch.setenv(native_gemm.DISABLE_ENV, "0")
    with NATIVE.fresh():
        assert NATIVE.current is None
        if before.function is not None:
            assert "FUSION_NATIVE_KERNELS=0" in native_gemm.status()
        assert NATIVE.machine() is not before
    assert NATIVE.machine() is before
    assert native_gemm.status() == "outside"


def test_reset_forgets_everything(monkeypatch) -> None:
    """`reset` drops the machine's answer too: the next use builds (or loads) again."""
    before = NATIVE.machine()
    with NATIVE.fresh():  # keeps this test's build from serving the next test
        NATIVE.pretend_off("pretended")
        NATIVE.reset()
        assert NATIVE.current is None
        _no_builds(monkeypatch)
        with pytest.raises(AssertionError, match="built again"):
            native_gemm.resolve()
    assert NATIVE.machine() is before


def test_row_machine_check_pretend_and_reset(monkeypatch) -> None:
    """The row check is made at first use and kept; `pretend` replaces its answer without
    making it; `reset` forgets both; `row_machine_known_ok` never makes it."""
    ROW_MACHINE.reset()
    assert ROW_MACHINE.ok is None and not onednn_backend.row_machine_known_ok()
    assert ROW_MACHINE.ok is None
    expected = onednn_backend._ops_available() and (
        onednn_backend.cpu_capability() in onednn_backend.ROW_CAPABILITIES
    )
    onednn_backend.resolve_machine()
    assert ROW_MACHINE.ok is expected and onednn_backend.row_machine_known_ok() is expected
    monkeypatch.setattr(onednn_backend, "ROW_CAPABILITIES", frozenset())
    assert ROW_MACHINE.check() is expected  # kept, not made again
    ROW_MACHINE.pretend(True)
    assert onednn_backend.row_machine_known_ok()
    ROW_MACHINE.reset()
    assert ROW_MACHINE.check() is False  # made again, under the patched capabilities


class _Stand(TorchKernels):
    """A stand-in backend: the reference under another identity."""

    name = "stand"


def test_install_and_uninstall() -> None:
    """An installed backend is known, available and served (never constructed); one named
    like a built-in replaces it until `uninstall`, which puts the built-in's constructor back
    and keeps the other constructed backends."""
    names = kernels.known_backends()
    with kernels.REGISTRY.fresh():  # the reference constructed again below stays in here
        reference = kernels.get("torch", "cpu")
        stand = _Stand()
        kernels.REGISTRY.install("stand", stand)
        assert kernels.get("stand", "cpu") is stand
        assert "stand" in kernels.known_backends()
        assert "stand" in kernels.available_backends("cpu")
        other = _Stand()
        kernels.REGISTRY.install("torch", other)
        assert kernels.get("torch", "cpu") is other and kernels.get("auto", "cpu") is other
        kernels.REGISTRY.uninstall()
        assert kernels.known_backends() == names
        with pytest.raises(ValueError, match="unknown kernel backend 'stand'"):
            kernels.get("stand", "cpu")
        again = kernels.get("torch", "cpu")
        assert type(again) is TorchKernels and again is not reference
        assert kernels.get("auto", "cpu") is again
        onednn = kernels.REGISTRY.instance("onednn")
        kernels.REGISTRY.uninstall()  # nothing installed: nothing forgotten
        assert kernels.REGISTRY.instance("onednn") is onednn
        assert kernels.get("torch", "cpu") is again


def test_registry_fresh_constructs_again_and_puts_back() -> None:
    """Inside `fresh` every backend (and `auto`'s choice) is constructed again; afterwards
    the ones from before are served."""
    reference = kernels.get("auto", "cpu")
    with kernels.REGISTRY.fresh():
        inside = kernels.get("auto", "cpu")
        assert inside is not reference and type(inside) is TorchKernels
    assert kernels.get("auto", "cpu") is reference
    assert kernels.get("torch", "cpu") is reference


def test_registry_reset_keeps_registered_constructors() -> None:
    """`reset` forgets constructed backends and installs, never a `register`ed constructor
    (the process's configuration)."""
    stand = _Stand()
    with kernels.REGISTRY.fresh():
        kernels.register("registered", lambda: stand)
        try:
            kernels.REGISTRY.install("marked", _Stand())
            kernels.REGISTRY.reset()
            assert "registered" in kernels.known_backends()
            assert "marked" not in kernels.known_backends()
            assert kernels.get("registered", "cpu") is stand
        finally:  # `register` is for good: only this test's own cleanup takes it back
            del kernels.REGISTRY.factories["registered"]

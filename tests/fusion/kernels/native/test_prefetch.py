"""Tests for `fusion/kernels/native/prefetch.py`: the one-row loop's prefetch hint is pinned,
read back or measured (and saved beside its library), never changes a result, and falls back
to the old hint, with the reason, wherever it cannot be chosen."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from fusion.kernels import memory
from fusion.kernels.native import build as native_build
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.native import prefetch


def _never(*args) -> int:
    raise AssertionError("the kernel was called, but the hint should not be measured")


def _slow_for(slow_hint: int, delay_s: float = 2e-4):
    """A stand-in kernel that takes `delay_s` longer with `slow_hint` than with the other."""

    def kernel(*args) -> int:
        if args[-1] == slow_hint:
            end = time.perf_counter() + delay_s
            while time.perf_counter() < end:
                pass
        return 0

    return kernel


@pytest.fixture
def small_stream(monkeypatch) -> None:
    """A measurement over a few copies of a small weight (the real one fills up to 1 GB)."""
    monkeypatch.setattr(prefetch, "SHAPE", (64, 32))
    monkeypatch.setattr(memory, "stream_bytes", lambda: 64 * 32 * 4 * 8)
    monkeypatch.delenv(prefetch.PREFETCH_ENV, raising=False)


@pytest.mark.parametrize(("value", "hint"), [("l1", prefetch.L1), ("L2", prefetch.L2)])
def test_the_environment_pins_the_hint(monkeypatch, tmp_path, value: str, hint: int) -> None:
    monkeypatch.setenv(prefetch.PREFETCH_ENV, value)
    choice = prefetch.choose((_never, _never), tmp_path / "lib.so")
    assert choice.hint == hint
    assert "pinned" in choice.reason
    assert not (tmp_path / "lib.so.prefetch").exists()


def test_an_unknown_pin_keeps_l1_and_says_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(prefetch.PREFETCH_ENV, "l3")
    choice = prefetch.choose((_never, _never), tmp_path / "lib.so")
    assert choice.hint == prefetch.L1
    assert "'l3'" in choice.reason


@pytest.mark.parametrize("slow", [prefetch.L1, prefetch.L2])
def test_the_faster_hint_is_measured_saved_and_read_back(tmp_path, small_stream, slow) -> None:
    kernel = _slow_for(slow)
    library = tmp_path / "rowmajor_gemm-0123.so"
    choice = prefetch.choose((kernel, kernel), library)
    assert choice.hint == 1 - slow
    assert choice.reason.startswith("measured")
    saved = library.with_name(library.name + ".prefetch")
    assert saved.read_text().strip() == ("l2" if slow == prefetch.L1 else "l1")
    # a later process reads the file and measures nothing
    again = prefetch.choose((_never, _never), library)
    assert again.hint == choice.hint
    assert "cached" in again.reason


def test_a_damaged_cache_file_is_measured_again(tmp_path, small_stream) -> None:
    library = tmp_path / "lib.so"
    library.with_name("lib.so.prefetch").write_text("l7\n")
    kernel = _slow_for(prefetch.L1)
    assert prefetch.choose((kernel, kernel), library).hint == prefetch.L2
    assert library.with_name("lib.so.prefetch").read_text().strip() == "l2"


def test_a_refusing_kernel_keeps_l1(tmp_path, small_stream) -> None:
    choice = prefetch.choose((lambda *a: -1, lambda *a: -1), tmp_path / "lib.so")
    assert choice.hint == prefetch.L1
    assert "not measured" in choice.reason and "-1" in choice.reason
    assert not (tmp_path / "lib.so.prefetch").exists()


def test_an_unwritable_cache_keeps_the_measured_choice(tmp_path, small_stream) -> None:
    kernel = _slow_for(prefetch.L1)
    choice = prefetch.choose((kernel, kernel), tmp_path / "absent" / "lib.so")
    assert choice.hint == prefetch.L2
    assert "not saved" in choice.reason


needs_kernel = pytest.mark.skipif(
    native_build.compiler() is None, reason="no C compiler on this machine: nothing to build"
)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_hints_compute_the_same_bits(dtype: torch.dtype, rows: int) -> None:
    """At a decode width (K across three 256-wide blocks, N not a multiple of either loop's
    block), with a bias: the one-row loop (1 row) and the multi-row loop (a block and a
    remainder; more rows than one pass of 32) through each hint, bit-identical, and the
    dense function."""
    machine = native_gemm.NATIVE.machine()
    if machine.function is None:
        pytest.skip(f"native kernel not built here: {machine.reason}")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 576, generator=generator).to(dtype)
    weight = torch.randn(1003, 576, generator=generator).mul_(0.05).to(dtype)
    bias = torch.randn(1003, generator=generator).to(dtype)
    function = native_gemm._function(machine, dtype)
    outs = [native_gemm.run(function, x, weight, bias, hint) for hint in prefetch.HINTS.values()]
    assert torch.equal(outs[0], outs[1])
    expected = F.linear(x.double(), weight.double(), bias.double())
    bound = 1e-4 if dtype == torch.float32 else 2.0**-7
    assert ((outs[0].double() - expected).abs() / expected.abs().clamp(min=1)).max() <= bound


@needs_kernel
def test_the_machine_answer_names_its_hint() -> None:
    machine = native_gemm.NATIVE.machine()
    if machine.function is None:
        pytest.skip(f"native kernel not built here: {machine.reason}")
    assert machine.prefetch in prefetch.HINTS.values()
    assert machine.prefetch_reason

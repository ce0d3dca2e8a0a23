"""harness.peers.triton_interpreter: each gap of Triton's interpreter shown (without the shims)
and handled (with them), on tiny kernels run interpreted; the bfloat16 cast bit for bit
against torch's own `.to(torch.bfloat16)`; installing and resetting puts back every original.
Skipped, with the reason, only where Triton does not import."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.peers import triton_interpreter
from harness.peers.triton_interpreter import SHIMS, bf16_round, bf16_truncate, bf16_widen

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
tl = pytest.importorskip("triton.language")
libdevice = pytest.importorskip("triton.language.extra.libdevice")
interpreter = pytest.importorskip("triton.runtime.interpreter")

ld_rsqrt = libdevice.rsqrt  # bound under the kernel module's own name, as Liger's kernels do


@pytest.fixture
def interpret(monkeypatch):
    """Kernels decorated inside the test are interpreted; shims reset after, whatever happens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
    SHIMS.reset()


def _scale_by_eps(x_ptr, out_ptr, eps, n: tl.constexpr):
    offsets = tl.arange(0, n)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, x * eps.to(tl.float32))


def _libdevice_rsqrt(x_ptr, out_ptr, n: tl.constexpr):
    offsets = tl.arange(0, n)
    tl.store(out_ptr + offsets, ld_rsqrt(tl.load(x_ptr + offsets)))


def _to_bf16(x_ptr, out_ptr, n: tl.constexpr):
    offsets = tl.arange(0, n)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets).to(tl.bfloat16))


def _bf16_math(a_ptr, b_ptr, out_ptr, n: tl.constexpr):
    offsets = tl.arange(0, n)
    a = tl.load(a_ptr + offsets)
    b = tl.load(b_ptr + offsets)
    tl.store(out_ptr + offsets, a * b - a)


def _bf16_dot(a_ptr, b_ptr, out_ptr, n: tl.constexpr):
    rows = tl.arange(0, n)[:, None] * n + tl.arange(0, n)[None, :]
    acc = tl.dot(tl.load(a_ptr + rows), tl.load(b_ptr + rows), out_dtype=tl.float32)
    tl.store(out_ptr + rows, acc)


def _bf16_reduce(x_ptr, out_ptr, n: tl.constexpr):
    # tl.reduce with the standard combine functions is what tl.sum / tl.max / tl.min run (the
    # jitted wrappers themselves are compiled ones here: Triton was imported before the
    # test set TRITON_INTERPRET)
    x = tl.load(x_ptr + tl.arange(0, n)[None, :])
    one = tl.arange(0, 1)
    tl.store(out_ptr + one, tl.reduce(x, 1, tl.standard._sum_combine))
    tl.store(out_ptr + 1 + one, tl.reduce(x, 1, tl.standard._elementwise_max))
    tl.store(out_ptr + 2 + one, tl.reduce(x, 1, tl.standard._elementwise_min))


def _bf16_atomic_add(x_ptr, out_ptr, n: tl.constexpr):
    offsets = tl.arange(0, n)
    tl.atomic_add(out_ptr + offsets % 2, tl.load(x_ptr + offsets))


def _copy_block(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


def _launch(fn, *args):
    kernel = triton.jit(fn)
    kernel[(1,)](*args)


def test_interpreter_on_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_interpreter.interpreter_on()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_interpreter.interpreter_on()
    with triton_interpreter.shims() as on:  # off the interpreter nothing is installed
        assert on is False
    assert not SHIMS.installed


def test_gap_1_float_arguments(interpret):
    x, out = torch.arange(4, dtype=torch.float32), torch.zeros(4)
    with pytest.raises(Exception, match="'float' object has no attribute 'to'"):
        _launch(_scale_by_eps, x, out, 0.5, 4)
    with triton_interpreter.shims() as on:
        assert on
        _launch(_scale_by_eps, x, out, 0.5, 4)
    assert torch.equal(out, x * 0.5)


def test_gap_2_libdevice_stubs(interpret):
    x, out = torch.tensor([1.0, 4.0, 16.0, 0.25]), torch.zeros(4)
    with pytest.raises(Exception, match="cannot convert None"):  # the stub returned None
        _launch(_libdevice_rsqrt, x, out, 4)
    with triton_interpreter.shims():
        _launch(_libdevice_rsqrt, x, out, 4)
    assert torch.allclose(out, torch.rsqrt(x))
    assert globals()["ld_rsqrt"] is libdevice.rsqrt  # the stub is put back after the launch


def test_gap_3_autotune_runs_one_config_without_benchmarking(interpret):
    configs = [triton.Config({"BLOCK": 8}), triton.Config({"BLOCK": 16})]
    x, out = torch.arange(5, dtype=torch.float32), torch.zeros(5)
    kernel = triton.autotune(configs=configs, key=["n"])(triton.jit(_copy_block))
    with pytest.raises(RuntimeError, match="active drivers"):  # benchmarking needs a GPU driver
        kernel[(1,)](x, out, 5)
    with triton_interpreter.shims():
        kernel = triton.autotune(configs=configs, key=["n"])(triton.jit(_copy_block))
        kernel[(1,)](x, out, 5)
    assert torch.equal(out, x)
    assert kernel.cache and next(iter(kernel.cache.values())).kwargs == {"BLOCK": 8}


def _cast_cases() -> torch.Tensor:
    """float32 values whose bfloat16 rounding is delicate: ties to even either way, the
    largest finite values, subnormals, signed zeros, infinities, NaN, and random bits."""
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000])
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), float("-inf"), float("nan")])
    rng = np.random.default_rng(0)
    bits = torch.from_numpy(rng.integers(0, 2**32, 4096, dtype=np.uint32).view(np.int32))
    return torch.cat([ties.to(torch.int32).view(torch.float32), special, bits.view(torch.float32)])


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bfloat16 tensors bit for bit, except that a NaN need only be a NaN: its payload is not
    one value across torch's own CPU paths (0x7FC0 scalar, 0xFFFF vectorised) or GPUs."""
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    return torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_gap_4_float32_to_bfloat16_cast_is_torchs_bit_for_bit(interpret):
    values = _cast_cases()
    want = values.to(torch.bfloat16)
    n = values.numel()
    padded = 1 << (n - 1).bit_length()
    x = torch.cat([values, torch.zeros(padded - n)])
    out = torch.zeros(padded, dtype=torch.bfloat16)
    _launch(_to_bf16, x, out, padded)
    assert not _same_bits(out[:n], want)  # the gap: truncation, not rounding
    with triton_interpreter.shims():
        _launch(_to_bf16, x, out, padded)
    assert _same_bits(out[:n], want)
    assert torch.isfinite(values).sum() > 4000  # most cases are finite: compared bit for bit


def test_gap_4_bfloat16_arithmetic_on_values(interpret):
    a = torch.tensor([1.5, -2.25, 3.0, 0.1], dtype=torch.bfloat16)
    b = torch.tensor([2.0, 0.5, -1.25, 7.0], dtype=torch.bfloat16)
    want = a * b - a  # torch: each op in float32, rounded to bfloat16
    out = torch.zeros(4, dtype=torch.bfloat16)
    _launch(_bf16_math, a, b, out, 4)
    assert not torch.equal(out, want)  # the gap: arithmetic on raw bit patterns
    with triton_interpreter.shims():
        _launch(_bf16_math, a, b, out, 4)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_bf16_helpers_match_torch():
    values = _cast_cases()
    ours = torch.from_numpy(bf16_round(values.numpy()).view(np.int16)).view(torch.bfloat16)
    assert _same_bits(ours, values.to(torch.bfloat16))
    finite = values[torch.isfinite(values)]
    widened = bf16_widen(bf16_truncate(finite.numpy()))
    assert np.all(np.abs(widened) <= np.abs(finite.numpy()))  # toward zero
    exact = torch.tensor([1.5, -3.0, 0.0], dtype=torch.bfloat16)
    as_bits = exact.view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_widen(as_bits), exact.float().numpy())


def test_install_and_reset_put_back_every_original(interpret):
    originals = {
        "cvt": interpreter._implicit_cvt,
        "call": interpreter.GridExecutor.__dict__["__call__"],
        "binary": interpreter.InterpreterBuilder.__dict__["binary_op"],
        "cast": interpreter.InterpreterBuilder.__dict__["cast_impl"],
    }
    with triton_interpreter.shims():
        with triton_interpreter.shims():  # reentrant: the inner exit keeps them
            pass
        assert SHIMS.installed
        assert interpreter._implicit_cvt is not originals["cvt"]
    assert not SHIMS.installed
    assert interpreter._implicit_cvt is originals["cvt"]
    assert interpreter.GridExecutor.__dict__["__call__"] is originals["call"]
    assert interpreter.InterpreterBuilder.__dict__["binary_op"] is originals["binary"]
    assert interpreter.InterpreterBuilder.__dict__["cast_impl"] is originals["cast"]


def test_gap_4_bfloat16_dot_and_reductions_on_values(interpret):
    torch.manual_seed(0)
    a, b = (torch.randn(16, 16).to(torch.bfloat16) for _ in range(2))
    want = a.float() @ b.float()  # exact products, float32 accumulation, as an MMA
    out = torch.zeros(16, 16)
    _launch(_bf16_dot, a, b, out, 16)
    assert not torch.allclose(out, want, atol=1e-2)  # the gap: bit patterns multiplied
    with triton_interpreter.shims():
        _launch(_bf16_dot, a, b, out, 16)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)
    x = torch.tensor([-3.5, 1.25, -0.5, 2.0, -7.0, 0.75, 4.0, -1.0], dtype=torch.bfloat16)
    got = torch.zeros(3, dtype=torch.bfloat16)
    _launch(_bf16_reduce, x, got, 8)
    assert got[1] != x.max()  # the gap: -7.0's bit pattern is the largest
    with triton_interpreter.shims():
        _launch(_bf16_reduce, x, got, 8)
    assert got[0] == x.float().sum().to(torch.bfloat16)
    assert got[1] == x.max() and got[2] == x.min()


def test_gap_4_bfloat16_atomic_add(interpret):
    x = torch.tensor([1.0, 0.5, 0.00390625, -2.0, 3.0, 0.25, 1e-3, 7.0], dtype=torch.bfloat16)
    want = torch.zeros(2, dtype=torch.bfloat16)
    for i, value in enumerate(x):  # in order, each sum rounded to bfloat16
        want[i % 2] = (want[i % 2].float() + value.float()).to(torch.bfloat16)
    out = torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="Unsupported data type"):
        _launch(_bf16_atomic_add, x, out, 8)
    out.zero_()
    with triton_interpreter.shims():
        _launch(_bf16_atomic_add, x, out, 8)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))

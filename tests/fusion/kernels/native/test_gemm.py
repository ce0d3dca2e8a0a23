"""Tests for `fusion/kernels/native/gemm.py` (and the C kernel it builds): the same function
as `F.linear`, no less accurate, batch- and thread-invariant, coherent with every weight
write, and taken only where its rules allow."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fusion.kernels import ops
from fusion.kernels.native import build as native_build
from fusion.kernels.native import gemm as native_gemm
from fusion.runtime.merged import MergedLinear
from tests.fusion.dynamo_graphs import compiled_call_targets
from tests.fusion.kernels.native_helpers import decode_linear, force_native_on

needs_kernel = pytest.mark.skipif(
    native_build.compiler() is None, reason="no C compiler on this machine: nothing to build"
)


@pytest.fixture
def fresh_native() -> Iterator[None]:
    """The native kernel resolved anew in the test, under the settings it patched (a
    `-march`, a capability, a default device), and the answer from before the test back
    afterwards, so a build made for one test never serves the next (`NATIVE.fresh`)."""
    with native_gemm.NATIVE.fresh():
        yield


def test_the_kernel_builds_where_a_compiler_exists() -> None:
    """With a C compiler the kernel builds and passes its probe (CI would otherwise run
    without it, silently); without one, the reason names the compiler. `status()` is
    'available' exactly where the machine rule allows."""
    if native_build.compiler() is None:
        assert not native_gemm.built()
        assert "no C compiler" in native_gemm.status()
        return
    assert native_gemm.built(), native_gemm.NATIVE.machine().reason
    capability = native_gemm.capability()
    if capability in native_gemm.LIMITS:
        assert native_gemm.status() == "available"
    else:
        assert capability in native_gemm.status()


def _products(max_rows: int) -> dict[str, st.SearchStrategy]:
    """The products the property tests draw: any rows up to `max_rows` (the 4-row blocks and
    their remainders), any N up to 37 (the 4-column blocks and the short last one), K across
    several 256-wide blocks, padded row strides of the input and the weight, with or without
    a bias."""
    return {
        "rows": st.integers(1, max_rows),
        "n": st.integers(1, 37),
        "k_blocks": st.integers(1, 40),
        "bias": st.booleans(),
        "x_pad": st.integers(0, 3),
        "w_pad": st.integers(0, 3),
        "seed": st.integers(0, 2**16),
    }


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = max(ref.abs().max().item(), 1e-30)
    return (got.double() - ref).abs().max().item() / scale


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(**_products(max_rows=70))
def test_linear_equals_f_linear_and_errs_no_more(rows, n, k_blocks, bias, x_pad, w_pad, seed):
    """Any rows (the 4-row blocks and their remainders), any N (the 4-column blocks and the
    short last block), K across several 256-wide blocks, padded row strides of `x` and the
    weight (row views of a wider tensor): the result matches `F.linear` and its error
    against float64 stays within MKL's, plus two float32 ulps of rounding noise."""
    k = 16 * k_blocks
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 16 * x_pad, generator=g)[:, :k]
    weight = torch.randn(n, k + 16 * w_pad, generator=g)[:, :k] / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    got = native_gemm.linear(x, weight, b)
    mkl = F.linear(x, weight, b)
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # errors in units of each dot product's condition scale (sum of |terms|): the natural
    # yardstick of a float32 sum, so a result that cancels to near zero is judged fairly
    scale = F.linear(
        x.abs().double(), weight.abs().double(), None if b is None else b.abs().double()
    )
    floor = 2 * torch.finfo(torch.float32).eps
    err_got = ((got.double() - ref).abs() / scale).max().item()
    err_mkl = ((mkl.double() - ref).abs() / scale).max().item()
    assert err_got <= max(1.5 * err_mkl, floor)
    assert ((got.double() - mkl.double()).abs() <= 4 * floor * scale).all()


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(1024, 1024), (512, 4096), (256, 8192)])
def test_error_at_model_widths_is_below_mkls(n: int, k: int) -> None:
    """At real widths (16 rows, the reductions of Qwen3 / Llama projections) the kernel's
    max error against float64 is at most MKL's, over four seeds."""
    worst = 0.0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x, weight = torch.randn(16, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
        ref = x.double() @ weight.double().t()
        worst = max(
            worst,
            _relative_error(native_gemm.linear(x, weight, None), ref)
            / _relative_error(F.linear(x, weight), ref),
        )
    assert worst <= 1.0


BF16_HALF_ULP = 2.0**-8
"""bfloat16's unit roundoff: 8 significand bits, so rounding to nearest errs by at most
2^-8 of the value. Each output of a bf16 linear is rounded once, by either kernel."""


def _bf16_bound(x: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """How far a bf16 linear with float32 accumulation may lie from the float64 result of
    the same bf16 operands, per output: the output's one rounding (`BF16_HALF_ULP` of the
    exact value) plus a float32 sum's error over K terms (K * eps32 * sum |terms|), derived
    from the reduction length and the dtypes, not from any machine's results."""
    bias = None if b is None else b.double()
    exact = F.linear(x.double(), weight.double(), bias)
    terms = F.linear(x.abs().double(), weight.abs().double(), None if b is None else bias.abs())
    k = weight.shape[-1]
    return BF16_HALF_ULP * exact.abs() + (k + 2) * torch.finfo(torch.float32).eps * terms


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(**_products(max_rows=40))
def test_bfloat16_linear_is_the_dense_function(rows, n, k_blocks, bias, x_pad, w_pad, seed):
    """bfloat16 operands (the weight read as bf16 in place, padded row strides of both):
    a bf16 result of `F.linear`'s shape within one bf16 rounding plus a float32 sum's error
    of the exact product, the same bound PyTorch's own bf16 linear meets (checked beside
    it), so the two can differ only by the order of a float32 sum before one rounding."""
    k = 16 * k_blocks
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 16 * x_pad, generator=g).bfloat16()[:, :k]
    weight = (torch.randn(n, k + 16 * w_pad, generator=g) / k**0.5).bfloat16()[:, :k]
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = native_gemm.linear(x, weight, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    bound = _bf16_bound(x, weight, b)
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((F.linear(x, weight, b).double() - exact).abs() <= bound).all()


@needs_kernel
def test_bfloat16_results_round_the_float32_sum_once() -> None:
    """Each bf16 output is the float32 kernel's output on the same (exactly widened)
    operands, rounded once to bf16: the bf16 entry point only changes what is streamed, and
    a 3-D input keeps its leading dimensions."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 1024, generator=g).bfloat16()
    weight = torch.randn(96, 1024, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    got = native_gemm.linear(x, weight, b)
    wide = native_gemm.linear(x.float(), weight.float(), b.float())
    assert got.shape == (2, 3, 96)
    assert torch.equal(got, wide.bfloat16())


@needs_kernel
def test_results_do_not_depend_on_threads_or_on_the_other_rows() -> None:
    """Each output is one thread's fixed-order sum: bit-identical at 1, 2 and 3 threads,
    and a row's result is the same alone as inside a batch of 37 (batch invariance)."""
    g = torch.Generator().manual_seed(1)
    x, weight, b = torch.randn(37, 512, generator=g), torch.randn(203, 512, generator=g), None
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(native_gemm.linear(x, weight, b))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for r in (0, 5, 36):
        assert torch.equal(native_gemm.linear(x[r : r + 1], weight, b), outs[0][r : r + 1])


@needs_kernel
def test_shapes_and_non_finite_values_pass_through() -> None:
    """3-D inputs keep their leading dimensions; a NaN or infinity in a row reaches exactly
    that row's outputs, as in `F.linear`."""
    x, weight = torch.randn(2, 3, 64), torch.randn(9, 64)
    x[1, 2, 5] = float("nan")
    x[0, 1, 7] = float("inf")
    got, want = native_gemm.linear(x, weight, None), F.linear(x, weight)
    assert got.shape == (2, 3, 9)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_operands_outside_the_contract_raise() -> None:
    """The C side re-checks what it relies on: a K that is not a multiple of 16 raises
    instead of reading past the rows."""
    with pytest.raises(RuntimeError, match="refused its operands"):
        native_gemm.linear(torch.randn(2, 24), torch.randn(8, 24), None)


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march values")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_narrower_vector_builds_compute_the_same_function(
    monkeypatch, fresh_native: None, march: str
) -> None:
    """The AVX2 (8 lanes, 2 x 4 blocks) and SSE (4 lanes, 4 x 2 blocks) code paths, built on
    this machine: they pass the probe and match `F.linear` within MKL's error over row
    counts that exercise every block remainder, and their bf16 entry point rounds their
    float32 sums once."""
    monkeypatch.setenv(native_build.MARCH_ENV, march)
    assert native_gemm.built(), native_gemm.NATIVE.machine().reason
    g = torch.Generator().manual_seed(2)
    for rows, n, k in [(1, 7, 16), (3, 5, 272), (16, 33, 1024), (37, 10, 528)]:
        x, weight = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g)
        got, mkl = native_gemm.linear(x, weight, b), F.linear(x, weight, b)
        ref = F.linear(x.double(), weight.double(), b.double())
        scale = F.linear(x.abs().double(), weight.abs().double(), b.abs().double())
        floor = 2 * torch.finfo(torch.float32).eps
        err_got = ((got.double() - ref).abs() / scale).max().item()
        err_mkl = ((mkl.double() - ref).abs() / scale).max().item()
        assert err_got <= max(1.5 * err_mkl, floor), (rows, n, k)
        # the bf16-weight entry point of the same build: the float32 sums, rounded once
        xb, wb, bb = x.bfloat16(), weight.bfloat16(), b.bfloat16()
        wide = native_gemm.linear(xb.float(), wb.float(), bb.float())
        assert torch.equal(native_gemm.linear(xb, wb, bb), wide.bfloat16()), (rows, n, k)


class _Subclass(torch.Tensor):
    pass


@needs_kernel
def test_applies_only_to_what_the_kernel_computes(monkeypatch) -> None:
    """Taken in float32 and bfloat16 (operands of one dtype). Refused: gradients recorded,
    other dtypes and mixed ones, K not a multiple of 16, more than
    the machine's row limits (`LIMITS`), a weight not unit-stride along K, a bias of the wrong shape, tensor
    subclasses, and everything below the size rule or off the machine rule."""
    x, weight, b = torch.randn(3, 64), torch.randn(32, 64), torch.randn(32)
    with torch.no_grad():
        assert not native_gemm.applies(x, weight, b)  # size rule: 2,048 < MIN_ELEMENTS
    force_native_on(monkeypatch)
    with torch.no_grad():
        assert native_gemm.applies(x, weight, b)
        assert native_gemm.applies(x[0], weight, None)
        assert not native_gemm.applies(x.double(), weight.double(), None)
        assert native_gemm.applies(x.bfloat16(), weight.bfloat16(), b.bfloat16())
        assert not native_gemm.applies(x.bfloat16(), weight.bfloat16(), b)  # float32 bias
        assert not native_gemm.applies(x, weight.bfloat16(), None)
        assert not native_gemm.applies(x.half(), weight.half(), None)
        assert not native_gemm.applies(x[:, :56], weight[:, :56], None)
        many = torch.randn(native_gemm.LIMITS["AVX512"].max_rows + 1, 64)
        assert not native_gemm.applies(many, weight, None)
        assert native_gemm.applies(many[1:], weight, None)
        # at most 4 x 64 input elements (input in cache)
        native_gemm.NATIVE.pretend_available(native_gemm.RowLimits(1000, 4 * 64))
        assert native_gemm.applies(many[:4], weight, None)
        assert not native_gemm.applies(many[:5], weight, None)
        assert not native_gemm.applies(x, torch.randn(64, 32).t(), None)
        assert not native_gemm.applies(x, weight, torch.randn(31))
        assert not native_gemm.applies(x.as_subclass(_Subclass), weight, None)
        native_gemm.NATIVE.pretend_off("no C compiler")
        assert not native_gemm.applies(x, weight, b)
    monkeypatch.undo()
    force_native_on(monkeypatch)
    assert not native_gemm.applies(x, weight.requires_grad_(), b)  # autograd records


@needs_kernel
def test_machine_rule_and_switch(monkeypatch) -> None:
    """The machine rule answers 'available' only for listed capabilities and without
    FUSION_NATIVE_KERNELS=0, and says which one failed."""
    monkeypatch.setattr(native_gemm, "capability", lambda: "AVX512")
    assert native_gemm._machine_rule() == "available"
    monkeypatch.setattr(native_gemm, "capability", lambda: "DEFAULT")
    assert "DEFAULT" in native_gemm._machine_rule()
    monkeypatch.setenv(native_gemm.DISABLE_ENV, "0")
    assert "FUSION_NATIVE_KERNELS=0" in native_gemm._machine_rule()


@needs_kernel
@pytest.mark.parametrize("capability", ["AVX512", "AVX2", "DEFAULT"])
def test_row_limits_follow_the_capability(monkeypatch, fresh_native: None, capability: str) -> None:
    """`resolve` takes the row limits of the machine's capability: AVX2 stops at 64 rows and
    256K input elements, AVX-512 at 256 rows and 1M; elsewhere nothing is taken."""
    monkeypatch.setattr(native_gemm, "capability", lambda: capability)
    native_gemm.resolve()
    limits = native_gemm.LIMITS.get(capability)
    if limits is None:
        assert not native_gemm.rows_ok(1, 16) and not native_gemm.known_ok()
        return
    assert native_gemm.known_ok()
    assert native_gemm.rows_ok(limits.max_rows, 16)
    assert not native_gemm.rows_ok(limits.max_rows + 1, 16)
    assert native_gemm.rows_ok(1, limits.max_input_elements)
    assert not native_gemm.rows_ok(2, limits.max_input_elements // 2 + 16)
    assert native_gemm.rows_ok(16, 2048)  # decode widths are taken on both


def _merged(
    sizes: tuple[int, ...], k: int, bias: bool, dtype: torch.dtype = torch.float32
) -> MergedLinear:
    torch.manual_seed(0)
    return MergedLinear.from_linears(
        {f"p{i}": nn.Linear(k, n, bias=bias, dtype=dtype) for i, n in enumerate(sizes)}
    )


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_merged_and_row_linears_take_it_at_decode_sizes(monkeypatch, rows: int) -> None:
    """MergedLinear (one stacked product) and a fused linear run the native kernel at 1 to
    the machine's row limit, before oneDNN's one-row product; the result equals `F.linear` on the
    same parameters. More rows keep their PyTorch path."""
    force_native_on(monkeypatch)
    calls: list[tuple[int, ...]] = []
    real = native_gemm.run
    monkeypatch.setattr(
        native_gemm, "run", lambda f, x, w, *a: calls.append(tuple(w.shape)) or real(f, x, w, *a)
    )
    merged = _merged((64, 16, 16), 32, bias=True)
    row = decode_linear(32, 48)
    with torch.no_grad():
        x = torch.randn(1, rows, 32)
        want = F.linear(x, merged.stacked_weight, merged.stacked_bias)
        torch.testing.assert_close(merged(x), want)
        torch.testing.assert_close(row(x), F.linear(x, row.weight, row.bias))
        assert calls == [(96, 32), (48, 32)]
        merged(torch.randn(native_gemm.LIMITS["AVX512"].max_rows + 1, 32))
        row(torch.randn(native_gemm.LIMITS["AVX512"].max_rows + 1, 32))
    assert calls == [(96, 32), (48, 32)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_weight_write_is_seen(monkeypatch, dtype: torch.dtype) -> None:
    """Nothing is cached: writes through `.data`, `copy_`, `set_`, numpy (float32: numpy has
    no bf16) and an optimiser step after a first forward all show in the next forward, at 1
    and 16 rows, in float32 and in bfloat16 (whose weight the kernel reads in place too)."""
    force_native_on(monkeypatch)
    ran: list[torch.dtype] = []
    real = native_gemm.run
    monkeypatch.setattr(native_gemm, "run", lambda f, x, *a: ran.append(x.dtype) or real(f, x, *a))
    merged = _merged((48, 16), 32, bias=False, dtype=dtype)
    optimiser = torch.optim.SGD([s.weight for s in merged.shards], lr=0.5)
    # float32: the kernel's error is MKL's; bf16: one bf16 rounding of the same sums
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-6}

    def unfused(x):
        return torch.cat([x @ s.weight.t() for s in merged.shards], dim=-1)

    writes = [
        lambda w, new: w.data.copy_(new),
        lambda w, new: w.data.mul_(2.0),
        lambda w, new: w.set_(new.clone()),  # breaks the view: shards apart
    ]
    if dtype == torch.float32:
        writes.insert(2, lambda w, new: np.copyto(w.detach().numpy()[:, 0], 3.0))
    for rows in (1, 16):
        x = torch.randn(rows, 32).to(dtype)
        with torch.no_grad():
            merged(x)
        for shard in merged.shards:
            new = torch.randn_like(shard.weight)
            for write in writes:
                with torch.no_grad():
                    write(shard.weight, new)
                    torch.testing.assert_close(merged(x), unfused(x), **tol)
        merged(x).sum().backward()  # records a gradient: each shard's own F.linear
        optimiser.step()
        optimiser.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(merged(x), unfused(x), **tol)
    assert dtype in ran  # the kernel itself computed some of these, in this dtype


@needs_kernel
def test_decode_product_prefers_native_then_onednn(monkeypatch) -> None:
    """`ops.product` runs the native kernel where it applies; where it does not
    (here: unavailable), oneDNN's one-row product where that applies, else None."""
    from fusion.kernels import onednn as onednn_backend

    force_native_on(monkeypatch)
    monkeypatch.setattr(onednn_backend, "ROW_MIN_ELEMENTS", 0)
    taken: list[str] = []
    real_native, real_onednn = native_gemm.run, onednn_backend.row_linear
    monkeypatch.setattr(native_gemm, "run", lambda *a: taken.append("native") or real_native(*a))
    monkeypatch.setattr(
        onednn_backend, "row_linear", lambda *a: taken.append("onednn") or real_onednn(*a)
    )
    x, weight = torch.randn(1, 64), torch.randn(32, 64)
    with torch.no_grad():
        assert ops.product("linear", tuple(weight.shape), "auto", x, weight, None) is not None
        native_gemm.NATIVE.pretend_off("no C compiler")
        fallback = ops.product("linear", tuple(weight.shape), "auto", x, weight, None)
        assert (
            ops.product("linear", tuple(weight.shape), "auto", torch.randn(3, 64), weight, None)
            is None
        )
    onednn_row = onednn_backend.row_linear_applies(x, weight, None)
    assert taken == ["native"] + (["onednn"] if onednn_row else [])
    assert (fallback is not None) == onednn_row


@needs_kernel
def test_compiled_modules_trace_the_decode_operator(monkeypatch) -> None:
    """Under torch.compile (fullgraph) a fused linear at 16 rows becomes one
    `fusion::linear_product` node and MergedLinear one `fusion::stacked_product` node (its
    shards not computed apart: the node checks the views when it runs), whose eager choice
    (the native kernel, on the stacked weight) runs when the compiled code runs; values
    equal the eager modules'."""
    force_native_on(monkeypatch)
    calls: list[int] = []
    real = native_gemm.run
    monkeypatch.setattr(native_gemm, "run", lambda *a: calls.append(1) or real(*a))
    for module, op in (
        (_merged((64, 16, 16), 32, bias=True).eval(), "fusion.stacked_product"),
        (decode_linear(32, 48).eval(), "fusion.linear_product"),
    ):
        x = torch.randn(1, 16, 32)
        out, targets = compiled_call_targets(module, x)
        assert targets == [op], targets
        with torch.no_grad():
            torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 + 1 + 1 + 1  # compiled, then eager: one product per module


@needs_kernel
@pytest.mark.parametrize("context", ["meta", "float64"])
def test_first_use_under_a_default_device_or_dtype(fresh_native: None, context: str) -> None:
    """The kernel may first be asked for while a model is built under `with
    torch.device("meta")` or another default dtype (Transformers' own tests fuse such a
    model): the probe still runs on real float32 CPU memory (it once handed the kernel a meta
    pointer and crashed the process), and products made under such a context return CPU
    float32 tensors."""
    x, weight = torch.randn(3, 64), torch.randn(8, 64)
    want = F.linear(x, weight)
    if context == "meta":
        with torch.device("meta"):
            assert native_gemm.built(), native_gemm.NATIVE.machine().reason
            got = native_gemm.linear(x, weight, None)
    else:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            assert native_gemm.built(), native_gemm.NATIVE.machine().reason
            got = native_gemm.linear(x, weight, None)
        finally:
            torch.set_default_dtype(previous)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_linear_refuses_memory_it_cannot_read() -> None:
    """`linear` checks what the kernel will read on every call, whatever its caller checked:
    meta tensors, other dtypes, column-major weights, mismatched widths and biases raise
    ValueError instead of handing C a bad pointer."""
    x, weight = torch.randn(2, 32), torch.randn(4, 32)
    bad = [
        (x.to("meta"), weight, None),
        (x, weight.to("meta"), None),
        (x.double(), weight.double(), None),
        (x, torch.randn(32, 4).t(), None),
        (torch.randn(2, 48), weight, None),
        (x, weight, torch.randn(5)),
        (x, weight, torch.randn(4, device="meta")),
    ]
    for args in bad:
        with pytest.raises(ValueError, match="native linear"):
            native_gemm.linear(*args)


@needs_kernel
@pytest.mark.parametrize("which", ["weight", "x", "bias"])
def test_a_storage_freed_after_the_tensor_was_made_is_not_read(monkeypatch, which: str) -> None:
    """A storage shrunk under its tensor (sharded training frees parameters' storages this
    way) raises ValueError from `linear` and `try_linear` alike, instead of a read past its
    end; the same operands with their storage whole compute `F.linear`."""
    force_native_on(monkeypatch)
    operands = {"x": torch.randn(1, 64), "weight": torch.randn(48, 64), "bias": torch.randn(48)}
    with torch.no_grad():
        want = F.linear(operands["x"], operands["weight"], operands["bias"])
        torch.testing.assert_close(native_gemm.try_linear(**_args(operands)), want)
        operands[which].untyped_storage().resize_(operands[which].element_size() * 8)
        for call in (native_gemm.linear, native_gemm.try_linear):
            with pytest.raises(ValueError, match="native linear"):
                call(**_args(operands))


def _args(operands: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"x": operands["x"], "weight": operands["weight"], "bias": operands["bias"]}


@needs_kernel
def test_try_linear_is_linear_where_it_applies_and_none_elsewhere(monkeypatch) -> None:
    """`try_linear` (the product path's one check) answers exactly where `applies` does, and
    then the tensor `linear` computes, bit for bit."""
    force_native_on(monkeypatch)
    x, weight = torch.randn(3, 64), torch.randn(48, 64)
    with torch.no_grad():
        assert native_gemm.applies(x, weight, None)
        assert torch.equal(
            native_gemm.try_linear(x, weight, None), native_gemm.linear(x, weight, None)
        )
        for args in [(x.double(), weight.double(), None), (x, torch.randn(64, 48).t(), None)]:
            assert not native_gemm.applies(*args)
            assert native_gemm.try_linear(*args) is None
    assert native_gemm.try_linear(x, weight.requires_grad_(True), None) is None  # records grad


@needs_kernel
def test_a_second_openmp_runtime_keeps_the_kernel_off(monkeypatch, fresh_native: None) -> None:
    """Fail closed: with two OpenMP runtimes in the process the kernel's threads would not be
    torch's, so it is not run (the reason says which runtimes)."""
    reason = "2 OpenMP runtimes loaded (/a/libgomp.so.1, /b/libiomp5.so)"
    monkeypatch.setattr(native_build, "one_openmp_runtime", lambda: reason)
    assert not native_gemm.built()
    assert reason in native_gemm.status()

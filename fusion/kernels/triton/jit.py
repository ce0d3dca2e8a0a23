"""The Triton kernels (`@triton.jit`) of the Triton backend, and the Triton modules they need.

Every kernel computes the function its torch reference (`fusion.kernels.reference`) defines,
including where the reference rounds: a statistic the reference computes in bf16 is rounded
to bf16 here at the same step, so the two differ only by the order of a reduction and the
last bit of a transcendental. The host code that checks inputs and launches them is
`fusion.kernels.triton.host`.

`INTERPRETED` is decided when this module is imported, because that is when `triton.jit`
decides whether a kernel is compiled or interpreted (see `fusion.kernels.triton`). `triton`
and `tl` are None where Triton is not installed; no kernel is defined then.
"""

from __future__ import annotations

import os

import torch

try:  # triton is optional: without it this backend is simply unavailable
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether the kernels below were defined in interpreter mode (CPU tensors) or compiled (CUDA)."""

MAX_SINGLE_PASS = 16384
"""Longest row the RMSNorm kernel keeps in registers; longer rows take the two-pass loop."""

ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
"""Activation name -> the constexpr code the act-and-mul kernel switches on."""


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype for a torch floating dtype the kernels handle, else None."""
    return {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
    }.get(dtype)


if triton is not None:

    @triton.jit
    def _to(v, DT: tl.constexpr):
        """`v` rounded to nearest-even in DT, as a DT tensor.

        fp32 -> bf16 is done on the bits: Triton's interpreter truncates that conversion,
        and the same integer rounding on the GPU keeps both paths bit-identical. NaN stays NaN.
        """
        if DT == tl.bfloat16:  # noqa: SIM300 (DT is a constexpr parameter, not a constant)
            v32 = v.to(tl.float32)
            bits = v32.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            return tl.where(v32 != v32, v32.to(tl.bfloat16), rounded)
        else:
            return v.to(DT)

    @triton.jit
    def _rnd(v, DT: tl.constexpr):
        """`v` rounded to DT and back to its own dtype (where a reference op would round)."""
        return _to(v, DT).to(v.dtype)

    @triton.jit
    def _inv_rms(total, n_cols, eps, RND: tl.constexpr):
        """`rsqrt(mean + eps)` of a row's sum of squares, rounded to RND after each op
        exactly where the reference rounds (mean, the sum with eps, the inverse root)."""
        mean = _rnd(total / n_cols, RND)
        return _rnd(1.0 / tl.sqrt(_rnd(mean + eps, RND)), RND)

    @triton.jit
    def rms_norm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        n_rows,
        n_cols,
        x_row_stride,
        out_row_stride,
        eps,
        offset,
        OUT_DT: tl.constexpr,
        ACC: tl.constexpr,
        RND: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        WEIGHT_AFTER_CAST: tl.constexpr,
        CAST_DT: tl.constexpr,
        PROD_DT: tl.constexpr,
        PROD_ACC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SINGLE_PASS: tl.constexpr,
    ):
        """RMSNorm of BLOCK_M rows per program (see `TritonKernels.rms_norm`).

        ACC: arithmetic dtype of the statistics (fp32, or fp64 for an fp64 input without
        upcast). RND: the compute dtype the reference holds them in (fp32 with upcast, else
        the input's): every intermediate is rounded to it exactly where the reference's ops
        round. The weight's constexprs are described on `_rms_norm_store`.
        """
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * x_row_stride
        out_rows = out_ptr + rows64[:, None] * out_row_stride
        cols = tl.arange(0, BLOCK_N)
        if SINGLE_PASS:
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            h = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(ACC)
            sq = _rnd(h * h, RND)
            total = tl.sum(sq, axis=1)
        else:
            total = tl.zeros([BLOCK_M], dtype=ACC)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < n_cols)
                h = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(ACC)
                total += tl.sum(_rnd(h * h, RND), axis=1)
        inv = _inv_rms(total, n_cols, eps, RND)
        if SINGLE_PASS:
            _rms_norm_store(
                h, inv, w_ptr, out_rows, cols, mask, n_cols, offset,
                OUT_DT, RND, HAS_WEIGHT, HAS_OFFSET, WEIGHT_AFTER_CAST, CAST_DT, PROD_DT, PROD_ACC,
            )  # fmt: skip
        else:
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < n_cols)
                h = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(ACC)
                _rms_norm_store(
                    h, inv, w_ptr, out_rows, c, mask, n_cols, offset,
                    OUT_DT, RND, HAS_WEIGHT, HAS_OFFSET, WEIGHT_AFTER_CAST, CAST_DT, PROD_DT, PROD_ACC,
                )  # fmt: skip

    @triton.jit
    def _rms_norm_store(
        h,
        inv,
        w_ptr,
        out_rows,
        cols,
        mask,
        n_cols,
        offset,
        OUT_DT: tl.constexpr,
        RND: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        WEIGHT_AFTER_CAST: tl.constexpr,
        CAST_DT: tl.constexpr,
        PROD_DT: tl.constexpr,
        PROD_ACC: tl.constexpr,
    ):
        """Normalise the loaded block `h` (rows x cols) by `inv`, scale it and store it.

        After the cast (Llama, T5): `(weight + offset)` in the weight's dtype times the
        normalised value cast to CAST_DT (the input's or the weight's dtype), in PROD_DT (their
        promotion, also OUT_DT). Before it (Gemma): the weight cast to PROD_DT (= promotion of
        weight and compute dtype), plus offset, times the normalised value, all in PROD_DT,
        then cast to OUT_DT (the input's dtype).
        """
        normed = _rnd(h * inv[:, None], RND)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
            w_dtype: tl.constexpr = w_ptr.dtype.element_ty
            if WEIGHT_AFTER_CAST:
                scale = w.to(PROD_ACC)
                if HAS_OFFSET:
                    scale = _rnd(scale + offset, w_dtype)
                value = _rnd(normed, CAST_DT).to(PROD_ACC) * scale[None, :]
            else:
                scale = w.to(PROD_ACC)
                if HAS_OFFSET:
                    scale = _rnd(scale + offset, PROD_DT)
                value = _rnd(normed.to(PROD_ACC) * scale[None, :], PROD_DT)
        else:
            value = normed
        tl.store(out_rows + cols[None, :], _to(value, OUT_DT), mask=mask)

    @triton.jit
    def act_and_mul_kernel(
        x_ptr,
        out_ptr,
        n_cols,
        x_row_stride,
        out_row_stride,
        XDT: tl.constexpr,
        ACC: tl.constexpr,
        ACTIVATION: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """`act(x[r, :d]) * x[r, d:]` for one row r and one block of d columns.

        The activation is computed in ACC and rounded to the input dtype, then the product
        computed in ACC and rounded again: exactly where the reference's two ops round.
        """
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(ACC)
        up = tl.load(x_ptr + row * x_row_stride + n_cols + cols, mask=mask, other=0.0).to(ACC)
        value = _rnd(_activation(gate, ACTIVATION), XDT) * up
        tl.store(out_ptr + row * out_row_stride + cols, _to(value, XDT), mask=mask)

    @triton.jit
    def _activation(gate, ACTIVATION: tl.constexpr):
        """silu (0), gelu with erf (1) or gelu's tanh approximation (2) of `gate`, in its dtype."""
        if ACTIVATION == 0:
            return gate / (1.0 + tl.exp(-gate))
        elif ACTIVATION == 1:
            return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        else:  # 0.5 * (1 + tanh(y)) == sigmoid(2y): the same function without cancellation
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            return gate / (1.0 + tl.exp(-2.0 * inner))

    @triton.jit
    def moe_up_kernel(
        hidden_ptr,
        w_ptr,
        out_ptr,
        token_ptr,
        blocks_ptr,
        hidden_size,
        inter,
        stride_ht,
        stride_hk,
        stride_we,
        stride_wn,
        stride_wk,
        stride_or,
        XDT: tl.constexpr,
        ACTIVATION: tl.constexpr,
        DOT_FP32: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One expert's gate_up GEMM for one block of its (sorted) rows, with act-and-mul in
        the epilogue: `out[r] = act(g) * u` with `[g, u] = gate_up[e] @ hidden[token[r]]`.

        `blocks_ptr` holds (expert, first row, end row) per program along axis 0; rows are
        positions in the expert-sorted order and `token_ptr` maps them to hidden's rows (the
        gather happens in the load). Gate and up are accumulated in fp32 and each rounded to
        XDT (the reference's GEMM output), then the activation and the product are rounded
        to XDT where the reference's `act_and_mul` rounds. DOT_FP32: feed `tl.dot` float32
        copies of the tiles (exact for half inputs; needed by the interpreter, whose dot
        cannot multiply bfloat16). DOT_PRECISION: "ieee" for float32 tiles (no TF32, as
        torch.mm by default), "tf32" (the default; unused by half-precision MMA) otherwise.
        """
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(blocks_ptr + 3 * pid_m).to(tl.int64)
        row_start = tl.load(blocks_ptr + 3 * pid_m + 1)
        row_end = tl.load(blocks_ptr + 3 * pid_m + 2)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        tokens = tl.load(token_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < inter
        w_expert = w_ptr + expert * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < hidden_size
            a = tl.load(
                hidden_ptr + tokens[:, None] * stride_ht + ks[None, :] * stride_hk,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b_mask = k_mask[:, None] & col_mask[None, :]
            b_gate = tl.load(
                w_expert + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                mask=b_mask,
                other=0.0,
            )
            b_up = tl.load(
                w_expert + (cols[None, :] + inter) * stride_wn + ks[:, None] * stride_wk,
                mask=b_mask,
                other=0.0,
            )
            if DOT_FP32:
                a, b_gate, b_up = a.to(tl.float32), b_gate.to(tl.float32), b_up.to(tl.float32)
            acc_gate = tl.dot(a, b_gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        gate = _rnd(acc_gate, XDT)
        up = _rnd(acc_up, XDT)
        value = _rnd(_activation(gate, ACTIVATION), XDT) * up
        tl.store(
            out_ptr + rows[:, None].to(tl.int64) * stride_or + cols[None, :],
            _to(value, XDT),
            mask=row_mask[:, None] & col_mask[None, :],
        )

    @triton.jit
    def moe_down_kernel(
        act_ptr,
        w_ptr,
        out_ptr,
        route_w_ptr,
        blocks_ptr,
        hidden_size,
        inter,
        stride_ar,
        stride_we,
        stride_wn,
        stride_wk,
        stride_or,
        XDT: tl.constexpr,
        PROD_DT: tl.constexpr,
        PROD_ACC: tl.constexpr,
        DOT_FP32: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One expert's down GEMM for one block of its sorted rows, with the routing weight
        in the epilogue: `out[r] = ((down[e] @ act[r]).to(XDT) * w[r]).to(XDT)`, the product
        in PROD_DT (promotion of XDT and the routing weights' dtype), as the reference."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(blocks_ptr + 3 * pid_m).to(tl.int64)
        row_start = tl.load(blocks_ptr + 3 * pid_m + 1)
        row_end = tl.load(blocks_ptr + 3 * pid_m + 2)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        rows64 = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < hidden_size
        w_expert = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < inter
            a = tl.load(
                act_ptr + rows64[:, None] * stride_ar + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                w_expert + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if DOT_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        route = tl.load(route_w_ptr + rows, mask=row_mask, other=0.0).to(PROD_ACC)
        value = _rnd(_rnd(acc, XDT).to(PROD_ACC) * route[:, None], PROD_DT)
        tl.store(
            out_ptr + rows64[:, None] * stride_or + cols[None, :],
            _to(value, XDT),
            mask=row_mask[:, None] & col_mask[None, :],
        )

    @triton.jit
    def add_rms_norm_kernel(
        a_ptr,
        b_ptr,
        w_ptr,
        sum_ptr,
        out_ptr,
        n_rows,
        n_cols,
        a_row_stride,
        b_row_stride,
        sum_row_stride,
        out_row_stride,
        eps,
        offset,
        SUM_DT: tl.constexpr,
        ADD_ACC: tl.constexpr,
        OUT_DT: tl.constexpr,
        ACC: tl.constexpr,
        RND: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        WEIGHT_AFTER_CAST: tl.constexpr,
        CAST_DT: tl.constexpr,
        PROD_DT: tl.constexpr,
        PROD_ACC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SINGLE_PASS: tl.constexpr,
    ):
        """`s = a + b` stored, then the RMSNorm of `s` (as `rms_norm_kernel`) for BLOCK_M rows.

        The sum is formed in ADD_ACC (fp32, fp64 for fp64) and rounded once to SUM_DT, as
        PyTorch's add does; the norm reads that rounded `s`, so the pair is the two ops run
        apart. A single-pass row reads `a` and `b` once and keeps `s` in registers; a longer
        row recomputes `s` (the same bits) in its second pass instead of reading it back.
        """
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        a_rows = a_ptr + rows64[:, None] * a_row_stride
        b_rows = b_ptr + rows64[:, None] * b_row_stride
        sum_rows = sum_ptr + rows64[:, None] * sum_row_stride
        out_rows = out_ptr + rows64[:, None] * out_row_stride
        cols = tl.arange(0, BLOCK_N)
        if SINGLE_PASS:
            mask = row_mask[:, None] & (cols[None, :] < n_cols)
            s = _add_rows(a_rows, b_rows, cols, mask, SUM_DT, ADD_ACC)
            tl.store(sum_rows + cols[None, :], s, mask=mask)
            h = s.to(ACC)
            total = tl.sum(_rnd(h * h, RND), axis=1)
        else:
            total = tl.zeros([BLOCK_M], dtype=ACC)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < n_cols)
                s = _add_rows(a_rows, b_rows, c, mask, SUM_DT, ADD_ACC)
                tl.store(sum_rows + c[None, :], s, mask=mask)
                h = s.to(ACC)
                total += tl.sum(_rnd(h * h, RND), axis=1)
        inv = _inv_rms(total, n_cols, eps, RND)
        if SINGLE_PASS:
            _rms_norm_store(
                h, inv, w_ptr, out_rows, cols, mask, n_cols, offset,
                OUT_DT, RND, HAS_WEIGHT, HAS_OFFSET, WEIGHT_AFTER_CAST, CAST_DT, PROD_DT, PROD_ACC,
            )  # fmt: skip
        else:
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < n_cols)
                h = _add_rows(a_rows, b_rows, c, mask, SUM_DT, ADD_ACC).to(ACC)
                _rms_norm_store(
                    h, inv, w_ptr, out_rows, c, mask, n_cols, offset,
                    OUT_DT, RND, HAS_WEIGHT, HAS_OFFSET, WEIGHT_AFTER_CAST, CAST_DT, PROD_DT, PROD_ACC,
                )  # fmt: skip

    @triton.jit
    def _add_rows(a_rows, b_rows, cols, mask, SUM_DT: tl.constexpr, ADD_ACC: tl.constexpr):
        """`a + b` over one block, formed in ADD_ACC and rounded once to SUM_DT (masked
        lanes are 0, which adds nothing to the sum of squares)."""
        a = tl.load(a_rows + cols[None, :], mask=mask, other=0.0).to(ADD_ACC)
        b = tl.load(b_rows + cols[None, :], mask=mask, other=0.0).to(ADD_ACC)
        return _to(a + b, SUM_DT)

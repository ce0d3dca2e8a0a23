"""Triton kernels for the fused modules (GPU; CPU only under Triton's interpreter).

Every kernel computes the function its torch reference (`fusion.kernels.torch_ref`) defines,
including where the reference rounds: a statistic the reference computes in bf16 is rounded
to bf16 here at the same step, so the two differ only by the order of a reduction and the
last bit of a transcendental. Inputs the kernels do not cover (an unsupported dtype, an empty
tensor) are computed by the torch reference itself, so a call never returns a different
function.

Device support is decided when this module is imported, because that is when `triton.jit`
decides whether a kernel is compiled or interpreted: with `TRITON_INTERPRET=1` in the
environment at that moment the kernels run in Triton's interpreter on CPU tensors (this is
how CI tests them without a GPU) and the backend `supports()` only CPU; otherwise they are
compiled for CUDA and the backend supports only CUDA devices. The interpreted backend is
never chosen by `auto` (it is `interpreted`, not fast); it runs only when named.
"""

from __future__ import annotations

import contextlib
import os

import torch

from fusion.kernels import torch_ref

try:  # triton is optional: without it this backend is simply unavailable
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether the kernels below were defined in interpreter mode (CPU tensors) or compiled (CUDA)."""

_MAX_SINGLE_PASS = 16384
"""Longest row the RMSNorm kernel keeps in registers; longer rows take the two-pass loop."""

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
"""Activation name -> the constexpr code the act-and-mul kernel switches on."""


def _tl_dtype(dtype: torch.dtype):
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
    def _rms_norm_kernel(
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
        mean = _rnd(total / n_cols, RND)
        inv = _rnd(1.0 / tl.sqrt(_rnd(mean + eps, RND)), RND)
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
    def _act_and_mul_kernel(
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
    def _moe_up_kernel(
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
    def _moe_down_kernel(
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


def _launch_context() -> contextlib.AbstractContextManager:
    """Around a kernel launch: in interpreter mode, numpy's overflow warnings silenced (an
    `exp` overflowing to inf is intended: the formulas saturate correctly; NaN inputs give
    NaN outputs, as in the reference); else nothing."""
    if INTERPRETED:
        import numpy as np

        return np.errstate(over="ignore", under="ignore", invalid="ignore")
    return contextlib.nullcontext()


def _num_warps(elements: int) -> int:
    """Warps for a program touching `elements` values: enough lanes to keep 4-16 values each."""
    return max(1, min(16, elements // 512))


def _acc(dtype: torch.dtype):
    """Arithmetic dtype for values held in `dtype`: fp64 for fp64, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _moe_block_m(rows_per_expert: float) -> int:
    """Rows per MoE GEMM block: the smallest of 16/32/64 that holds an average expert's
    rows (decode routes a handful of rows per expert; tl.dot needs at least 16)."""
    if rows_per_expert <= 16:
        return 16
    return 32 if rows_per_expert <= 32 else 64


def _expert_blocks(
    counts: torch.Tensor, per_expert: torch.Tensor, n_blocks: int, block_m: int
) -> torch.Tensor:
    """`[n_blocks, 3]` int32 (expert, first row, end row) covering each expert's slice of
    the expert-sorted rows in blocks of at most `block_m` rows (`per_expert` blocks for an
    expert with `counts` rows; none for an expert without rows). Computed on the device,
    without a host synchronisation (`n_blocks` is already known)."""
    counts, per_expert = counts.to(torch.int64), per_expert.to(torch.int64)
    experts = torch.arange(counts.numel(), device=counts.device)
    expert_of_block = torch.repeat_interleave(experts, per_expert, output_size=n_blocks)
    first_block = torch.cumsum(per_expert, 0) - per_expert
    first_row = torch.cumsum(counts, 0) - counts
    index = torch.arange(n_blocks, device=counts.device) - first_block[expert_of_block]
    start = first_row[expert_of_block] + index * block_m
    end = torch.minimum(start + block_m, (first_row + counts)[expert_of_block])
    return torch.stack([expert_of_block, start, end], dim=1).to(torch.int32).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D (rows, last dim) tensor with unit stride in the last dimension; a view
    when the layout allows, else a contiguous copy (never written to)."""
    if x.dim() == 0:
        raise ValueError("expected at least one dimension")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


class TritonKernels:
    """The Triton backend: every `Kernels` method as a Triton kernel.

    Construct it with `create()`, which returns None where Triton cannot run (not installed,
    or neither a CUDA device nor interpreter mode), so the registry lists it only where it
    works.
    """

    name = "triton"
    interpreted = INTERPRETED

    @classmethod
    def create(cls) -> TritonKernels | None:
        """The backend, or None when Triton is missing or has no device to run on here."""
        if triton is None:
            return None
        if not INTERPRETED and not torch.cuda.is_available():
            return None
        return cls()

    def supports(self, device: torch.device) -> bool:
        """True for CPU in interpreter mode, for CUDA otherwise (never both)."""
        device = torch.device(device)
        if INTERPRETED:
            return device.type == "cpu"
        return device.type == "cuda"

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        offset: float = 0.0,
        upcast: bool = True,
        weight_after_cast: bool = True,
        cast_to_weight: bool = False,
    ) -> torch.Tensor:
        """`torch_ref.rms_norm` in one kernel: one read of `x`, one write of the result.

        Returns a new contiguous tensor of `x`'s shape and of the reference's dtype
        (`promote(W, T)` when the weight is applied after the cast, `T` being `x`'s dtype or,
        with `cast_to_weight`, the weight's; else `x`'s dtype). Never writes to `x` or
        `weight`. Unsupported dtypes, a weight that does not match the last dimension, a
        scalar or an empty input are computed by the reference (which also raises where it
        would).
        """
        x_tl = _tl_dtype(x.dtype)
        w_tl = _tl_dtype(weight.dtype) if weight is not None else x_tl
        n_cols = x.shape[-1] if x.dim() else 0
        if (
            x_tl is None
            or w_tl is None
            or x.dim() == 0
            or x.numel() == 0
            or (weight is not None and (weight.dim() != 1 or weight.shape[0] != n_cols))
        ):
            return torch_ref.rms_norm(
                x,
                weight,
                eps,
                offset=offset,
                upcast=upcast,
                weight_after_cast=weight_after_cast,
                cast_to_weight=cast_to_weight,
            )
        compute = torch.float32 if upcast else x.dtype
        w_dtype = weight.dtype if weight is not None else x.dtype
        cast_dtype = w_dtype if cast_to_weight else x.dtype
        if weight is not None and weight_after_cast:
            prod_dtype = out_dtype = torch.promote_types(w_dtype, cast_dtype)
        else:
            prod_dtype, out_dtype = torch.promote_types(w_dtype, compute), x.dtype
        x2 = _rows(x)
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        out2 = out.view(-1, n_cols)
        w = weight.contiguous() if weight is not None else x2  # dummy pointer when weightless
        block_n = triton.next_power_of_2(n_cols)
        single = block_n <= _MAX_SINGLE_PASS
        if not single:
            block_n = 4096
        block_m = max(1, min(64, 4096 // block_n)) if single else 1
        n_rows = x2.shape[0]
        grid = (triton.cdiv(n_rows, block_m),)
        with _launch_context():
            _rms_norm_kernel[grid](
                x2,
                w,
                out2,
                n_rows,
                n_cols,
                x2.stride(0),
                out2.stride(0),
                float(eps),
                float(offset),
                OUT_DT=_tl_dtype(out_dtype),
                ACC=_acc(compute),
                RND=_tl_dtype(compute),
                HAS_WEIGHT=weight is not None,
                HAS_OFFSET=bool(offset),
                WEIGHT_AFTER_CAST=bool(weight_after_cast),
                CAST_DT=_tl_dtype(cast_dtype),
                PROD_DT=_tl_dtype(prod_dtype),
                PROD_ACC=_acc(prod_dtype),
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                SINGLE_PASS=single,
                num_warps=_num_warps(block_m * block_n),
            )
        return out

    def moe_experts(
        self,
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """`torch_ref.moe_experts` as two grouped-GEMM kernels over expert-sorted rows.

        The T*K (token, choice) rows are sorted by expert (stable, as the reference), and
        cut into blocks of at most BLOCK_M rows of one expert. Kernel 1 gathers each block's
        hidden rows, multiplies by the expert's gate and up rows and applies act-and-mul in
        its epilogue (no `[T*K, 2I]` intermediate); kernel 2 multiplies by the expert's down
        rows and applies the routing weight in its epilogue. The weighted rows go back with
        the reference's own `index_add_`, so the sum over the K choices is the reference's.
        Every GEMM output and product is rounded to the reference's dtype at its step.

        Returns a new `[T, H]` tensor of `hidden`'s dtype; reads its inputs only. Inputs the
        kernels do not cover (float64, mixed dtypes, an unknown activation, expert ids out
        of range) are computed (or refused with its exception) by the reference.
        """
        x_tl = _tl_dtype(hidden.dtype)
        w_tl = _tl_dtype(topk_weights.dtype)
        num_tokens = hidden.shape[0] if hidden.dim() == 2 else 0
        top_k = topk_ids.shape[-1] if topk_ids.dim() else 0
        if (
            x_tl is None
            or x_tl is tl.float64
            or w_tl is None
            or activation not in _ACTIVATION_CODES
            or hidden.dim() != 2
            or gate_up.dim() != 3
            or down.dim() != 3
            or gate_up.dtype != hidden.dtype
            or down.dtype != hidden.dtype
            or topk_ids.shape != topk_weights.shape
            or topk_ids.dim() != 2
            or topk_ids.shape[0] != num_tokens
            or topk_ids.dtype.is_floating_point
            or num_tokens == 0
            or top_k == 0
            or gate_up.shape[1] % 2
            or gate_up.shape[2] != hidden.shape[1]
            or down.shape[0] != gate_up.shape[0]
            or down.shape[1] != hidden.shape[1]
            or 2 * down.shape[2] != gate_up.shape[1]
        ):
            return torch_ref.moe_experts(hidden, gate_up, down, topk_ids, topk_weights, activation)
        num_experts, hidden_size, inter = down.shape[0], hidden.shape[1], down.shape[2]
        flat_ids = topk_ids.reshape(-1)
        rows_total = flat_ids.numel()
        block_m = _moe_block_m(rows_total / num_experts)
        low, high = torch.aminmax(flat_ids)
        counts = torch.bincount(flat_ids.clamp(min=0), minlength=num_experts)[:num_experts]
        per_expert = (counts + block_m - 1) // block_m
        low, high, n_blocks = torch.stack([low.long(), high.long(), per_expert.sum()]).tolist()
        if low < 0 or high >= num_experts:  # the reference raises for these
            return torch_ref.moe_experts(hidden, gate_up, down, topk_ids, topk_weights, activation)
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // top_k
        route = topk_weights.reshape(-1).index_select(0, order).contiguous()
        blocks = _expert_blocks(counts, per_expert, n_blocks, block_m)
        activated = hidden.new_empty(rows_total, inter)
        weighted = hidden.new_empty(rows_total, hidden_size)
        prod_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
        block_n, block_k = 64, (32 if hidden.dtype == torch.float32 else 64)
        extra = {} if INTERPRETED else {"num_warps": 4, "num_stages": 3}
        dot_fp32 = INTERPRETED and hidden.dtype != torch.float32
        # float32 GEMMs in full precision (as torch.mm without TF32); half inputs use MMA
        dot_precision = "ieee" if (dot_fp32 or hidden.dtype == torch.float32) else "tf32"
        with _launch_context():
            _moe_up_kernel[(n_blocks, triton.cdiv(inter, block_n))](
                hidden,
                gate_up,
                activated,
                token_of_row,
                blocks,
                hidden_size,
                inter,
                hidden.stride(0),
                hidden.stride(1),
                gate_up.stride(0),
                gate_up.stride(1),
                gate_up.stride(2),
                activated.stride(0),
                XDT=x_tl,
                ACTIVATION=_ACTIVATION_CODES[activation],
                DOT_FP32=dot_fp32,
                DOT_PRECISION=dot_precision,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                **extra,
            )
            _moe_down_kernel[(n_blocks, triton.cdiv(hidden_size, block_n))](
                activated,
                down,
                weighted,
                route,
                blocks,
                hidden_size,
                inter,
                activated.stride(0),
                down.stride(0),
                down.stride(1),
                down.stride(2),
                weighted.stride(0),
                XDT=x_tl,
                PROD_DT=_tl_dtype(prod_dtype),
                PROD_ACC=_acc(prod_dtype),
                DOT_FP32=dot_fp32,
                DOT_PRECISION=dot_precision,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                **extra,
            )
        out = hidden.new_zeros(num_tokens, hidden_size)
        out.index_add_(0, token_of_row, weighted)
        return out

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """`torch_ref.act_and_mul` in one kernel: reads gate and up once, writes the product.

        Returns a new contiguous tensor of shape `x.shape[:-1] + (x.shape[-1] // 2,)` and
        `x`'s dtype; never writes to `x`. An odd last dimension, an unknown activation name,
        an unsupported dtype or an empty input goes to the reference (which raises or
        computes exactly what the unfused module would).
        """
        x_tl = _tl_dtype(x.dtype)
        if (
            x_tl is None
            or activation not in _ACTIVATION_CODES
            or x.dim() == 0
            or x.shape[-1] % 2
            or x.numel() == 0
        ):
            return torch_ref.act_and_mul(x, activation)
        d = x.shape[-1] // 2
        x2 = _rows(x)
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
        out2 = out.view(-1, d)
        block = min(1024, triton.next_power_of_2(d))
        grid = (x2.shape[0], triton.cdiv(d, block))
        with _launch_context():
            _act_and_mul_kernel[grid](
                x2,
                out2,
                d,
                x2.stride(0),
                out2.stride(0),
                XDT=x_tl,
                ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
                ACTIVATION=_ACTIVATION_CODES[activation],
                BLOCK=block,
                num_warps=_num_warps(block) if block >= 512 else 1,
            )
        return out


def create() -> TritonKernels | None:
    """Registry factory: the Triton backend, or None where it cannot run."""
    return TritonKernels.create()


__all__ = ["INTERPRETED", "TritonKernels", "create"]

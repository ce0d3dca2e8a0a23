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
        XDT: tl.constexpr,
        OUT_DT: tl.constexpr,
        ACC: tl.constexpr,
        RND: tl.constexpr,
        OUT_ACC: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        WEIGHT_AFTER_CAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SINGLE_PASS: tl.constexpr,
    ):
        """RMSNorm of BLOCK_M rows per program (see `TritonKernels.rms_norm`).

        XDT: the input's dtype. ACC: arithmetic dtype (fp32, or fp64 for fp64 input without upcast). RND: the dtype the
        reference holds intermediates in (fp32 with upcast, else the input dtype): every
        intermediate is rounded to it exactly where the reference's ops would round.
        OUT_ACC: arithmetic dtype of the final product with a weight applied after the cast.
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
                XDT, OUT_DT, ACC, RND, OUT_ACC, HAS_WEIGHT, WEIGHT_AFTER_CAST,
            )  # fmt: skip
        else:
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < n_cols)
                h = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(ACC)
                _rms_norm_store(
                    h, inv, w_ptr, out_rows, c, mask, n_cols, offset,
                    XDT, OUT_DT, ACC, RND, OUT_ACC, HAS_WEIGHT, WEIGHT_AFTER_CAST,
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
        XDT: tl.constexpr,
        OUT_DT: tl.constexpr,
        ACC: tl.constexpr,
        RND: tl.constexpr,
        OUT_ACC: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        WEIGHT_AFTER_CAST: tl.constexpr,
    ):
        """Normalise the loaded block `h` (rows x cols) by `inv`, scale it and store it."""
        normed = _rnd(h * inv[:, None], RND)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
            if WEIGHT_AFTER_CAST:
                # scale = weight + offset in the weight's dtype; product in the promoted dtype
                w_dtype = w_ptr.dtype.element_ty
                scale = _rnd(w.to(OUT_ACC) + offset, w_dtype)
                value = _rnd(normed, XDT).to(OUT_ACC) * scale[None, :]
            else:
                # scale = weight.to(h.dtype) + offset; product in h's dtype, then cast back
                scale = _rnd(_rnd(w.to(ACC), RND) + offset, RND)
                value = _rnd(normed * scale[None, :], RND)
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
        if ACTIVATION == 0:  # silu
            act = gate / (1.0 + tl.exp(-gate))
        elif ACTIVATION == 1:  # gelu (erf)
            act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        else:  # gelu, tanh approximation: 0.5 * (1 + tanh(y)) == sigmoid(2y), no cancellation
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = gate / (1.0 + tl.exp(-2.0 * inner))
        value = _rnd(act, XDT) * up
        tl.store(out_ptr + row * out_row_stride + cols, _to(value, XDT), mask=mask)


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

        Returns a new contiguous tensor of `x`'s shape and of the reference's dtype (the
        promotion of the weight's and `x`'s dtype when the weight is applied after the cast,
        else `x`'s dtype). Never writes to `x` or `weight`. Unsupported dtypes and empty
        inputs are computed by the reference.
        """
        x_tl = _tl_dtype(x.dtype)
        w_tl = _tl_dtype(weight.dtype) if weight is not None else tl.float32 if tl else None
        n_cols = x.shape[-1] if x.dim() else 0
        if (
            x_tl is None
            or w_tl is None
            or x.dim() == 0
            or x.numel() == 0
            or (weight is not None and (weight.dim() != 1 or weight.shape[0] != n_cols))
            # T5's cast to the weight's dtype is not a kernel variant yet (added to the
            # reference later); with equal dtypes it is Llama's, which the kernel covers.
            or (cast_to_weight and weight is not None and weight.dtype != x.dtype)
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
        if weight is not None and weight_after_cast:
            out_dtype = torch.promote_types(weight.dtype, x.dtype)
        else:
            out_dtype = x.dtype
        x2 = _rows(x)
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        out2 = out.view(-1, n_cols)
        w = weight.contiguous() if weight is not None else x2  # dummy pointer when weightless
        rnd = tl.float32 if upcast else x_tl
        acc = tl.float64 if rnd is tl.float64 else tl.float32
        out_acc = tl.float64 if out_dtype == torch.float64 else tl.float32
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
                XDT=x_tl,
                OUT_DT=_tl_dtype(out_dtype),
                ACC=acc,
                RND=rnd,
                OUT_ACC=out_acc,
                HAS_WEIGHT=weight is not None,
                WEIGHT_AFTER_CAST=bool(weight_after_cast),
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
        """`torch_ref.moe_experts` (no Triton kernel yet: the grouped reference runs on any
        device, with this backend's `act_and_mul` not used so the function stays the reference's)."""
        return torch_ref.moe_experts(hidden, gate_up, down, topk_ids, topk_weights, activation)

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

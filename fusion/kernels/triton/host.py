"""Host code of the Triton backend: input checks (anything the kernels do not cover goes to
the torch reference), launch parameters, and the `TritonKernels` backend object."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from fusion.kernels import reference
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.kernels.triton.jit import (
    ACTIVATION_CODES,
    INTERPRETED,
    MAX_SINGLE_PASS,
    act_and_mul_kernel,
    add_rms_norm_kernel,
    moe_down_kernel,
    moe_up_kernel,
    rms_norm_kernel,
    tl,
    tl_dtype,
    triton,
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


def _max_blocks(rows_total: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the expert blocks of `rows_total` routed rows, known on the host
    without reading the routing: an expert with `c > 0` rows takes `ceil(c / block_m) <=
    c // block_m + 1` blocks, so all take at most `rows_total // block_m` plus one per
    expert that has rows (at most `min(num_experts, rows_total)` of them)."""
    return rows_total // block_m + min(num_experts, rows_total)


def _expert_blocks(counts: torch.Tensor, max_blocks: int, block_m: int) -> torch.Tensor:
    """`[max_blocks, 3]` int32 (expert, first row, end row) covering each expert's slice of
    the expert-sorted rows in blocks of at most `block_m` rows (`ceil(count / block_m)`
    blocks per expert, none for an expert without rows), then empty blocks `(0, 0, 0)` up
    to `max_blocks` (`_max_blocks`): a kernel program on an empty block masks every row, so
    it loads nothing it uses and stores nothing. Computed on the device without a host
    synchronisation (no `.item()`/`.tolist()`: the launch grid is `max_blocks`, known from
    shapes alone), so a CUDA graph can capture it."""
    counts = counts.to(torch.int64)
    per_expert = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(per_expert, 0)
    first_block = block_end - per_expert
    first_row = torch.cumsum(counts, 0) - counts
    block = torch.arange(max_blocks, device=counts.device)
    # The expert of block b: the first expert whose blocks end after b (clamped for the
    # padding blocks past the last one, which are emptied below).
    expert = torch.searchsorted(block_end, block, right=True).clamp(max=counts.numel() - 1)
    start = first_row[expert] + (block - first_block[expert]) * block_m
    end = torch.minimum(start + block_m, (first_row + counts)[expert])
    used = block < block_end[-1]
    table = torch.stack([expert, start, end], dim=1) * used.unsqueeze(1)
    return table.to(torch.int32).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D (rows, last dim) tensor with unit stride in the last dimension; a view
    when the layout allows, else a contiguous copy (never written to)."""
    if x.dim() == 0:
        raise ValueError("expected at least one dimension")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


@dataclass(frozen=True)
class _NormPlan:
    """The dtypes and block shape one RMSNorm-variant launch uses (plain and add + norm
    share it): `out_dtype` of the result, and `constants`, the kernels' shared constexprs."""

    out_dtype: torch.dtype
    block_m: int
    block_n: int
    constants: dict[str, Any]


def _norm_plan(
    dtype: torch.dtype,
    n_cols: int,
    weight: torch.Tensor | None,
    variant: NormVariant,
) -> _NormPlan:
    """`variant`'s dtypes as the reference forms them (statistics in float32 when
    `upcast`, the weight product in the promoted dtype of its operands) and the block shape:
    one pass over rows up to MAX_SINGLE_PASS wide, several rows per program when narrow."""
    compute = torch.float32 if variant.upcast else dtype
    w_dtype = weight.dtype if weight is not None else dtype
    cast_dtype = w_dtype if variant.cast_to_weight else dtype
    if weight is not None and variant.weight_after_cast:
        prod_dtype = out_dtype = torch.promote_types(w_dtype, cast_dtype)
    else:
        prod_dtype, out_dtype = torch.promote_types(w_dtype, compute), dtype
    block_n = triton.next_power_of_2(n_cols)
    single = block_n <= MAX_SINGLE_PASS
    if not single:
        block_n = 4096
    block_m = max(1, min(64, 4096 // block_n)) if single else 1
    constants = {
        "OUT_DT": tl_dtype(out_dtype),
        "ACC": _acc(compute),
        "RND": tl_dtype(compute),
        "HAS_WEIGHT": weight is not None,
        "HAS_OFFSET": bool(variant.offset),
        "WEIGHT_AFTER_CAST": variant.weight_after_cast,
        "CAST_DT": tl_dtype(cast_dtype),
        "PROD_DT": tl_dtype(prod_dtype),
        "PROD_ACC": _acc(prod_dtype),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "SINGLE_PASS": single,
        "num_warps": _num_warps(block_m * block_n),
    }
    return _NormPlan(out_dtype, block_m, block_n, constants)


def _launch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    variant: NormVariant,
) -> torch.Tensor:
    """Launch the RMSNorm kernel on inputs `TritonKernels.rms_norm` checked it covers."""
    n_cols = x.shape[-1]
    plan = _norm_plan(x.dtype, n_cols, weight, variant)
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=plan.out_dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    w = weight.contiguous() if weight is not None else x2  # dummy pointer when weightless
    n_rows = x2.shape[0]
    grid = (triton.cdiv(n_rows, plan.block_m),)
    with _launch_context():
        rms_norm_kernel[grid](
            x2,
            w,
            out2,
            n_rows,
            n_cols,
            x2.stride(0),
            out2.stride(0),
            float(eps),
            variant.offset,
            **plan.constants,
        )
    return out


def _add_covered(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the add + RMSNorm kernel computes exactly `a + b` and its norm: plain
    contiguous tensors of one supported dtype, shape and device (no promotion, broadcasting
    or strided layout for the kernel to imitate), not empty, and a weight matching the last
    dimension. Everything else goes to the reference."""
    return (
        type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.device == b.device
        and tl_dtype(a.dtype) is not None
        and a.dim() > 0
        and a.numel() > 0
        and a.is_contiguous()
        and b.is_contiguous()
        and (
            weight is None
            or (
                tl_dtype(weight.dtype) is not None
                and weight.dim() == 1
                and weight.shape[0] == a.shape[-1]
                and weight.device == a.device
            )
        )
    )


def _launch_add_rms_norm(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    variant: NormVariant,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the add + RMSNorm kernel on inputs `_add_covered` accepted; returns the new
    (sum, normalised) pair, both contiguous, as `a + b` and the norm of it would be."""
    n_cols = a.shape[-1]
    plan = _norm_plan(a.dtype, n_cols, weight, variant)
    total = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    out = torch.empty(a.shape, dtype=plan.out_dtype, device=a.device)
    a2, b2 = a.view(-1, n_cols), b.view(-1, n_cols)
    total2, out2 = total.view(-1, n_cols), out.view(-1, n_cols)
    w = weight.contiguous() if weight is not None else a2  # dummy pointer when weightless
    n_rows = a2.shape[0]
    with _launch_context():
        add_rms_norm_kernel[(triton.cdiv(n_rows, plan.block_m),)](
            a2,
            b2,
            w,
            total2,
            out2,
            n_rows,
            n_cols,
            a2.stride(0),
            b2.stride(0),
            total2.stride(0),
            out2.stride(0),
            float(eps),
            variant.offset,
            SUM_DT=tl_dtype(a.dtype),
            ADD_ACC=_acc(a.dtype),
            **plan.constants,
        )
    return total, out


def _moe_covered(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
) -> bool:
    """Whether the MoE kernels cover these inputs (dtypes, shapes, activation); the rest goes
    to the reference."""
    x_tl = tl_dtype(hidden.dtype)
    w_tl = tl_dtype(topk_weights.dtype)
    num_tokens = hidden.shape[0] if hidden.dim() == 2 else 0
    top_k = topk_ids.shape[-1] if topk_ids.dim() else 0
    return not (
        x_tl is None
        or x_tl is tl.float64
        or w_tl is None
        or activation not in ACTIVATION_CODES
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
    )


def _launch_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Sort the (token, choice) rows by expert, run the two grouped GEMMs and sum the weighted
    rows back per token; inputs `_moe_covered` accepted (ids out of range: the reference)."""
    num_tokens, top_k = hidden.shape[0], topk_ids.shape[-1]
    num_experts, hidden_size, inter = down.shape[0], hidden.shape[1], down.shape[2]
    flat_ids = topk_ids.reshape(-1)
    rows_total = flat_ids.numel()
    block_m = _moe_block_m(rows_total / num_experts)
    # Ids outside [0, E) make the reference raise; here a device-side assertion raises
    # instead (asynchronously on a GPU: no host synchronisation, so CUDA graphs capture it).
    low, high = torch.aminmax(flat_ids)
    torch._assert_async(
        (low >= 0) & (high < num_experts), "moe_experts: expert ids out of range [0, E)"
    )
    counts = torch.bincount(flat_ids.clamp(min=0, max=num_experts - 1), minlength=num_experts)
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // top_k
    route = topk_weights.reshape(-1).index_select(0, order).contiguous()
    n_blocks = _max_blocks(rows_total, num_experts, block_m)
    blocks = _expert_blocks(counts, n_blocks, block_m)
    activated = hidden.new_empty(rows_total, inter)
    weighted = hidden.new_empty(rows_total, hidden_size)
    prod_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    _moe_gemms(
        hidden,
        gate_up,
        down,
        activated,
        weighted,
        route,
        token_of_row,
        blocks,
        activation=activation,
        prod_dtype=prod_dtype,
        n_blocks=n_blocks,
        block_m=block_m,
    )
    out = hidden.new_zeros(num_tokens, hidden_size)
    out.index_add_(0, token_of_row, weighted)
    return out


def _moe_gemms(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activated: torch.Tensor,
    weighted: torch.Tensor,
    route: torch.Tensor,
    token_of_row: torch.Tensor,
    blocks: torch.Tensor,
    *,
    activation: str,
    prod_dtype: torch.dtype,
    n_blocks: int,
    block_m: int,
) -> None:
    """Kernel 1 (gate/up GEMM + act-and-mul into `activated`), then kernel 2 (down GEMM times
    the routing weight into `weighted`), over the expert blocks."""
    x_tl = tl_dtype(hidden.dtype)
    hidden_size, inter = hidden.shape[1], down.shape[2]
    block_n, block_k = 64, (32 if hidden.dtype == torch.float32 else 64)
    extra = {} if INTERPRETED else {"num_warps": 4, "num_stages": 3}
    dot_fp32 = INTERPRETED and hidden.dtype != torch.float32
    # float32 GEMMs in full precision (as torch.mm without TF32); half inputs use MMA
    dot_precision = "ieee" if (dot_fp32 or hidden.dtype == torch.float32) else "tf32"
    with _launch_context():
        moe_up_kernel[(n_blocks, triton.cdiv(inter, block_n))](
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
            ACTIVATION=ACTIVATION_CODES[activation],
            DOT_FP32=dot_fp32,
            DOT_PRECISION=dot_precision,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            **extra,
        )
        moe_down_kernel[(n_blocks, triton.cdiv(hidden_size, block_n))](
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
            PROD_DT=tl_dtype(prod_dtype),
            PROD_ACC=_acc(prod_dtype),
            DOT_FP32=dot_fp32,
            DOT_PRECISION=dot_precision,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            **extra,
        )


class TritonKernels:
    """The Triton backend: every `Kernels` method as a Triton kernel.

    Construct it with `create()`, which returns None where Triton cannot run (not installed,
    or neither a CUDA device nor interpreter mode), so the registry lists it only where it
    works.
    """

    name = "triton"
    interpreted = INTERPRETED
    delegated: frozenset[str] = frozenset()
    auto_pick = True

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
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> torch.Tensor:
        """`reference.rms_norm` in one kernel: one read of `x`, one write of the result.

        Returns a new contiguous tensor of `x`'s shape and of the reference's dtype
        (`promote(W, T)` when the weight is applied after the cast, `T` being `x`'s dtype or,
        with `cast_to_weight`, the weight's; else `x`'s dtype). Never writes to `x` or
        `weight`. Unsupported dtypes, a weight that does not match the last dimension, a
        scalar or an empty input are computed by the reference (which also raises where it
        would).
        """
        x_tl = tl_dtype(x.dtype)
        w_tl = tl_dtype(weight.dtype) if weight is not None else x_tl
        n_cols = x.shape[-1] if x.dim() else 0
        if (
            not variant.fast  # another root spelling: the reference's rounding
            or x_tl is None
            or w_tl is None
            or x.dim() == 0
            or x.numel() == 0
            or (weight is not None and (weight.dim() != 1 or weight.shape[0] != n_cols))
        ):
            return reference.rms_norm(x, weight, eps, variant=variant)
        return _launch_rms_norm(x, weight, eps, variant)

    def add_rms_norm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        *,
        variant: NormVariant = DEFAULT_VARIANT,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`reference.add_rms_norm` in one kernel: reads `a` and `b` once, writes the sum
        and the normalised value (a row longer than 16384 reads them twice).

        Returns new contiguous tensors: the sum in `a`'s dtype and the norm in the
        reference's dtype; never writes `a`, `b` or `weight`. Inputs the kernel does not
        imitate exactly (mixed dtypes, broadcasting, strided layouts, tensor subclasses,
        empty or unsupported tensors, see `_add_covered`) go to the reference.
        """
        if not variant.fast or not _add_covered(a, b, weight):
            return reference.add_rms_norm(a, b, weight, eps, variant=variant)
        return _launch_add_rms_norm(a, b, weight, eps, variant)

    def moe_experts(
        self,
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """`reference.moe_experts` as two grouped-GEMM kernels over expert-sorted rows.

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
        if not _moe_covered(hidden, gate_up, down, topk_ids, topk_weights, activation):
            return reference.moe_experts(hidden, gate_up, down, topk_ids, topk_weights, activation)
        return _launch_moe(hidden, gate_up, down, topk_ids, topk_weights, activation)

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """`reference.act_and_mul` in one kernel: reads gate and up once, writes the product.

        Returns a new contiguous tensor of shape `x.shape[:-1] + (x.shape[-1] // 2,)` and
        `x`'s dtype; never writes to `x`. An odd last dimension, an unknown activation name,
        an unsupported dtype or an empty input goes to the reference (which raises or
        computes exactly what the unfused module would).
        """
        x_tl = tl_dtype(x.dtype)
        if (
            x_tl is None
            or activation not in ACTIVATION_CODES
            or x.dim() == 0
            or x.shape[-1] % 2
            or x.numel() == 0
        ):
            return reference.act_and_mul(x, activation)
        d = x.shape[-1] // 2
        x2 = _rows(x)
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
        out2 = out.view(-1, d)
        block = min(1024, triton.next_power_of_2(d))
        grid = (x2.shape[0], triton.cdiv(d, block))
        with _launch_context():
            act_and_mul_kernel[grid](
                x2,
                out2,
                d,
                x2.stride(0),
                out2.stride(0),
                XDT=x_tl,
                ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
                ACTIVATION=ACTIVATION_CODES[activation],
                BLOCK=block,
                num_warps=_num_warps(block) if block >= 512 else 1,
            )
        return out


def create() -> TritonKernels | None:
    """Registry factory: the Triton backend, or None where it cannot run."""
    return TritonKernels.create()

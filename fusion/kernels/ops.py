"""The fused kernels as PyTorch operators (`torch.ops.fusion.*`), for `torch.compile`.

Fused modules call their kernels through the functions here. In eager mode these call the
backend directly (`kernels.get(backend, device).<op>`): a registered operator costs ~7 us of
dispatch per call on CPU, a visible share of a decode step. While Dynamo traces, they call
the registered operator instead: Dynamo records one opaque node (its fake implementation
gives the output's shape and dtype), so nothing inside a kernel (backend choice, Python
state such as `torch.backends` settings, the MoE kernel's data-dependent per-expert row
counts) can break the graph. A compiled fused model therefore traces fullgraph wherever its
unfused twin does, and at run time the operator dispatches to the same backend eager mode
would use.

Autograd: every operator has a derivative (`register_autograd`, formulas in
`fusion.kernels.autograd`: the reference's derivative, checked by gradcheck), so a compiled
fused model that trains keeps each kernel one operator. Eager calls that record a gradient
call the backend's Python code, which autograd differentiates directly.

The dispatcher's contract: a backend's own kernel (not the torch reference's ops, which
PyTorch dispatches one by one) runs only where `contract.plain_dense` says PyTorch itself would
run the plain dense kernel; elsewhere (autocast, a tensor subclass or mode, a functorch
transform, a reduced matmul precision) the torch reference runs, eager or traced
(`_reference_for`). The CPU decode products and experts ask it where they choose a kernel
(`native_gemm`, `onednn_backend`, `native_backend`).

Recompiles: the backend name, activation and variant flags are constants of the module that
calls an operator (Dynamo guards on them once), and `kernels.get` is a dict lookup after
`fusion.fuse` resolved `auto` ahead, so repeated calls of a compiled fused model with the same
shapes never recompile (tested with `torch._dynamo.config.error_on_recompile`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fusion import kernels
from fusion.kernels import autograd, contract, native_gemm, onednn_backend, torch_ref
from fusion.kernels.torch_ref import TorchKernels


def _use_operator() -> bool:
    """Call the registered operator (rather than the backend's Python code): only while
    Dynamo traces. The operators are differentiable, so this holds when training too."""
    return torch.compiler.is_compiling()


_MATMUL_OPS = frozenset({"moe_experts"})
"""The ops whose kernels are matrix products (the matmul precision settings apply to them)."""


def _reference_for(backend: str, device: torch.device, op: str, *tensors: Tensor | None) -> bool:
    """Does `op` on `backend` compute with the torch reference for these operands now? Where
    the backend is the reference or delegates `op` to it (as the CPU backends do for the
    norms and act-and-mul), or where its own kernel would run but the dispatcher's contract
    refuses one (`contract.plain_dense`: autocast, a subclass or mode, ...): the reference's
    plain torch ops are what PyTorch then dispatches, with all of that state applied.

    While Dynamo traces, the reference's code is traced in place of the opaque operator, so
    Inductor fuses it with its neighbours exactly as it fuses the unfused model's
    elementwise chains (an opaque operator would cost the fused model that fusion), and
    autocast and modes apply to it as to the unfused ops. Same function, same backend as
    eager; the reference has no Python state that could break the graph. `kernels.get` is a
    dict lookup once `fusion.fuse` resolved `auto` ahead."""
    backend_kernels = kernels.get(backend, device)
    if type(backend_kernels) is TorchKernels or op in backend_kernels.delegated:
        return True
    matmul = op in _MATMUL_OPS
    return contract.plain_dense(device.type, *tensors, matmul=matmul) is not None


def _kernels(
    backend: str, device: torch.device, op: str, *tensors: Tensor | None
) -> kernels.Kernels:
    """The backend that computes `op` on these operands in eager mode: `backend`'s own, or
    the torch reference where `_reference_for` says so."""
    if _reference_for(backend, device, op, *tensors):
        return kernels.get("torch", device)
    return kernels.get(backend, device)


def _rms(
    kernel: Callable[..., Tensor],
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float,
    upcast: bool,
    weight_after_cast: bool,
    cast_to_weight: bool,
) -> Tensor:
    """`kernel` (a `Kernels.rms_norm`) called with the variant flags as keywords."""
    return kernel(
        x,
        weight,
        eps,
        offset=offset,
        upcast=upcast,
        weight_after_cast=weight_after_cast,
        cast_to_weight=cast_to_weight,
    )


@torch.library.custom_op("fusion::rms_norm", mutates_args=())
def _rms_norm_op(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float,
    upcast: bool,
    weight_after_cast: bool,
    cast_to_weight: bool,
    backend: str,
) -> Tensor:
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    return _rms(kernels.get(backend, x.device).rms_norm, x, weight, eps, *flags)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, offset, upcast, weight_after_cast, cast_to_weight, backend):
    # The reference traces on fake tensors: its output dtype is the variant's, by definition.
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    return _rms(torch_ref.rms_norm, x, weight, eps, *flags)


def rms_norm(
    backend: str,
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    upcast: bool = True,
    weight_after_cast: bool = True,
    cast_to_weight: bool = False,
) -> Tensor:
    """`Kernels.rms_norm` on `backend` (see `fusion.kernels.Kernels`)."""
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    if _use_operator():
        if _reference_for(backend, x.device, "rms_norm", x, weight):
            return _rms(torch_ref.rms_norm, x, weight, eps, *flags)
        return torch.ops.fusion.rms_norm(x, weight, eps, *flags, backend)
    return _rms(_kernels(backend, x.device, "rms_norm", x, weight).rms_norm, x, weight, eps, *flags)


def _add_rms(
    kernel: Callable[..., tuple[Tensor, Tensor]],
    a: Tensor,
    b: Tensor,
    weight: Tensor | None,
    eps: float,
    flags: tuple[float, bool, bool, bool],
) -> tuple[Tensor, Tensor]:
    """`kernel` (a `Kernels.add_rms_norm`) called with the variant `flags` (offset, upcast,
    weight_after_cast, cast_to_weight) as keywords."""
    offset, upcast, weight_after_cast, cast_to_weight = flags
    return kernel(
        a,
        b,
        weight,
        eps,
        offset=offset,
        upcast=upcast,
        weight_after_cast=weight_after_cast,
        cast_to_weight=cast_to_weight,
    )


@torch.library.custom_op("fusion::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    a: Tensor,
    b: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float,
    upcast: bool,
    weight_after_cast: bool,
    cast_to_weight: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    return _add_rms(kernels.get(backend, a.device).add_rms_norm, a, b, weight, eps, flags)


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(
    a, b, weight, eps, offset, upcast, weight_after_cast, cast_to_weight, backend
):
    # The reference on fake tensors: the sum's promotion and broadcast, the variant's dtype.
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    return _add_rms(torch_ref.add_rms_norm, a, b, weight, eps, flags)


def add_rms_norm(
    backend: str,
    a: Tensor,
    b: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    offset: float = 0.0,
    upcast: bool = True,
    weight_after_cast: bool = True,
    cast_to_weight: bool = False,
) -> tuple[Tensor, Tensor]:
    """`Kernels.add_rms_norm` on `backend`: `(a + b, rms_norm(a + b))`, two new tensors."""
    flags = (offset, upcast, weight_after_cast, cast_to_weight)
    if _use_operator():
        if _reference_for(backend, a.device, "add_rms_norm", a, b, weight):
            return _add_rms(torch_ref.add_rms_norm, a, b, weight, eps, flags)
        return torch.ops.fusion.add_rms_norm(a, b, weight, eps, *flags, backend)
    chosen = _kernels(backend, a.device, "add_rms_norm", a, b, weight)
    return _add_rms(chosen.add_rms_norm, a, b, weight, eps, flags)


@torch.library.custom_op("fusion::act_and_mul", mutates_args=())
def _act_and_mul_op(x: Tensor, activation: str, backend: str) -> Tensor:
    return kernels.get(backend, x.device).act_and_mul(x, activation)


@_act_and_mul_op.register_fake
def _act_and_mul_fake(x, activation, backend):
    return torch_ref.act_and_mul(x, activation)


def act_and_mul(backend: str, x: Tensor, activation: str) -> Tensor:
    """`Kernels.act_and_mul` on `backend`."""
    if _use_operator():
        if _reference_for(backend, x.device, "act_and_mul", x):
            return torch_ref.act_and_mul(x, activation)
        return torch.ops.fusion.act_and_mul(x, activation, backend)
    return _kernels(backend, x.device, "act_and_mul", x).act_and_mul(x, activation)


@torch.library.custom_op("fusion::decode_linear", mutates_args=())
def _decode_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)` at decode sizes, by the choice eager code makes at this
    call (`_eager_decode_product`; settings read now), else by `F.linear`: what eager
    `MergedLinear` and `RowLinear` run, made one node of a compiled graph (Inductor cannot
    lower either kernel itself). Inference only: callers route here only when no gradient
    is recorded (`native_gemm.traced`, `onednn_backend.row_linear_traced`)."""
    out = _eager_decode_product(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias) if out is None else out


@_decode_linear_op.register_fake
def _decode_linear_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def decode_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear` at decode sizes through `fusion::decode_linear` (see there)."""
    return torch.ops.fusion.decode_linear(x, weight, bias)


def _eager_decode_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """The eager choice of `decode_product`: each kernel's `applies` asks the dispatcher's
    contract (`contract.plain_dense`) with its own rules, so neither runs where PyTorch
    would not run its plain dense kernel."""
    if native_gemm.applies(x, weight, bias):
        return native_gemm.linear(x, weight, bias)
    if onednn_backend.row_linear_applies(x, weight, bias):
        return onednn_backend.row_linear(x, weight, bias)
    return None


def resolve_decode_kernels() -> None:
    """Make the machine checks behind `decode_product` now (building the native kernel if
    needed), outside any trace: compiled code only reads their results."""
    onednn_backend.resolve_machine()
    native_gemm.resolve()


def decode_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """`F.linear(x, weight, bias)` by a decode-sized CPU kernel where one applies, else None
    (the caller computes it its own way). Eager: the native kernel (`native_gemm`, at the
    rows `native_gemm.rows_ok` allows) first, else oneDNN's one-row product
    (`onednn_backend.row_linear`, when the native kernel is unavailable); neither where
    PyTorch itself would not run its plain dense kernel (`contract.plain_dense`: under
    autocast, a tensor subclass or mode, a functorch transform, a reduced matmul precision).
    While Dynamo traces: the `fusion::decode_linear` operator when either would apply by the
    rules a trace can ask (no autocast, subclass or mode: else the caller traces `F.linear`,
    which Dynamo handles under all three), which makes the eager choice, settings included,
    when the compiled code runs. Both read the live weight and cache nothing."""
    out = _eager_decode_product(x, weight, bias)
    if out is not None:
        return out
    if torch.compiler.is_compiling() and (
        native_gemm.traced(x, weight, bias) or onednn_backend.row_linear_traced(x, weight, bias)
    ):
        return decode_linear(x, weight, bias)
    return None


@torch.library.custom_op("fusion::moe_experts", mutates_args=())
def _moe_experts_op(
    hidden: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    activation: str,
    backend: str,
) -> Tensor:
    return kernels.get(backend, hidden.device).moe_experts(
        hidden, gate_up, down, topk_ids, topk_weights, activation
    )


@_moe_experts_op.register_fake
def _moe_experts_fake(hidden, gate_up, down, topk_ids, topk_weights, activation, backend):
    return hidden.new_empty(hidden.shape)


def moe_experts(
    backend: str,
    hidden: Tensor,
    gate_up: Tensor,
    down: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    activation: str,
) -> Tensor:
    """`Kernels.moe_experts` on `backend`; the torch reference where the dispatcher's
    contract refuses the backend's kernels (`_reference_for`). While Dynamo traces, that
    reference is traced in place of the operator: it reads the per-expert row counts, a
    graph break (as the unfused experts' own loop has), but autocast then applies to its
    GEMMs as to the unfused ones'; the operator's fake output could not follow autocast."""
    operands = (hidden, gate_up, down, topk_ids, topk_weights)
    if _use_operator():
        if contract.plain_dense(hidden.device.type, *operands) is not None:
            return torch_ref.moe_experts(*operands, activation)
        return torch.ops.fusion.moe_experts(*operands, activation, backend)
    return _kernels(backend, hidden.device, "moe_experts", *operands).moe_experts(
        *operands, activation
    )


# --------------------------------------------------------------------------------------------
# Autograd of the operators (formulas in `fusion.kernels.autograd`). `setup_context` keeps
# the inputs; each backward returns one gradient per operator argument (None for the
# non-tensor ones and the integer expert ids).


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, *rest = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = tuple(rest[:5])  # eps, offset, upcast, weight_after_cast, cast_to_weight


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    d_x, d_weight = autograd.rms_norm_backward(grad, x, weight, *ctx.args)
    return d_x, d_weight, None, None, None, None, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def _act_and_mul_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.activation = inputs[1]


def _act_and_mul_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return autograd.act_and_mul_backward(grad, x, ctx.activation), None, None


_act_and_mul_op.register_autograd(_act_and_mul_backward, setup_context=_act_and_mul_setup)


def _moe_setup(ctx, inputs, output) -> None:
    hidden, gate_up, down, topk_ids, topk_weights, activation, _backend = inputs
    ctx.save_for_backward(hidden, gate_up, down, topk_ids, topk_weights)
    ctx.activation = activation


def _moe_backward(ctx, grad):
    hidden, gate_up, down, topk_ids, topk_weights = ctx.saved_tensors
    grads = torch.ops.fusion.moe_experts_backward(
        grad, hidden, gate_up, down, topk_ids, topk_weights, ctx.activation
    )
    d_hidden, d_gate_up, d_down, d_weights = grads
    return d_hidden, d_gate_up, d_down, None, d_weights, None, None


_moe_experts_op.register_autograd(_moe_backward, setup_context=_moe_setup)


def _add_rms_norm_setup(ctx, inputs, output) -> None:
    a, b, weight, *rest = inputs
    ctx.save_for_backward(a, b, weight)
    ctx.eps, ctx.flags = rest[0], tuple(rest[1:5])


def _add_rms_norm_backward(ctx, grad_sum, grad_norm):
    a, b, weight = ctx.saved_tensors
    d_a, d_b, d_weight = autograd.add_rms_norm_backward(
        grad_sum, grad_norm, a, b, weight, ctx.eps, ctx.flags
    )
    return d_a, d_b, d_weight, None, None, None, None, None, None


_add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)

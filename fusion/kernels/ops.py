"""The fused kernels as PyTorch operators (`torch.ops.fusion.*`), for `torch.compile`.

Fused modules call their kernels through the functions here. In eager mode these call the
backend directly (`kernels.get(backend, device).<op>`): a registered operator's dispatch
costs a visible share of a decode step on CPU. While Dynamo traces, they call
the registered operator instead: Dynamo records one opaque node (its fake implementation
gives the output's shape and dtype), so nothing inside a kernel (backend choice, Python
state such as `torch.backends` settings, the MoE kernel's data-dependent per-expert row
counts) can break the graph. A compiled fused model therefore traces fullgraph wherever its
unfused twin does, and at run time the operator dispatches to the same backend eager mode
would use.

Autograd: every operator but the two products has a derivative (`register_autograd`,
formulas in `fusion.kernels.autograd`: the reference's derivative, checked by gradcheck), so
a compiled fused model that trains keeps each kernel one operator. The products
(`fusion::linear_product`, `fusion::stacked_product`) are inference-only, traced only where
no gradient is recorded, and registered without custom_op's per-call autograd layer
(`_product_operator`). Eager calls that record a gradient call the backend's Python code,
which autograd differentiates directly.

The dispatcher's contract: a backend's own kernel (not the torch reference's ops, which
PyTorch dispatches one by one) runs only where `contract.plain_dense` says PyTorch itself would
run the plain dense kernel; elsewhere (autocast, a tensor subclass or mode, a functorch
transform, a reduced matmul precision) the torch reference runs, eager or traced
(`_reference_for`). The CPU decode products and experts ask it where they choose a kernel
(`native_gemm`, `onednn_backend`, `native_backend`).

Norm variants: fused modules and kernels pass one frozen `NormVariant`; the norm operators'
schemas cannot take a dataclass, so `_operator_args` unpacks it where an operator is called
and `_variant_of` rebuilds it in the operator's implementation, fake and autograd context
(the only two places its fields are spelled out as scalars).

Recompiles: the backend name, activation and norm variant are constants of the module that
calls an operator (Dynamo guards on them once), and `kernels.get` is a dict lookup after
`fusion.fuse` resolved `auto` ahead, so repeated calls of a compiled fused model with the same
shapes never recompile (tested with `torch._dynamo.config.error_on_recompile`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from fusion import kernels
from fusion.kernels import autograd, contract, policy, reference
from fusion.kernels import onednn as onednn_backend
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.kernels.reference import TorchKernels


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


_REFERENCE = TorchKernels()
"""The reference backend's kernels (stateless), called directly by `eager_reference`."""


def eager_reference(backend: str, x: Tensor) -> bool:
    """Is this an eager call that the reference computes whatever the operands: `backend`
    `torch`, or `auto` on a CPU tensor (`kernels.get` resolves CPU `auto` to the reference
    backend, `fusion.kernels`)? Then the caller goes straight to the reference kernel:
    the fewest Python frames, which on a decode step run from caches a weight-streaming
    GEMV has just emptied. Never while Dynamo traces (the operators' own rules apply)."""
    # compiling first: while Dynamo traces, `is_cpu` would be a node of the graph
    return not torch.compiler.is_compiling() and (
        backend == "torch" or (backend == "auto" and x.is_cpu)
    )


def _kernels(
    backend: str, device: torch.device, op: str, *tensors: Tensor | None
) -> kernels.Kernels:
    """The backend that computes `op` on these operands in eager mode: `backend`'s own, or
    the torch reference where `_reference_for` says so."""
    if _reference_for(backend, device, op, *tensors):
        return kernels.get("torch", device)
    return kernels.get(backend, device)


def _operator_args(variant: NormVariant) -> tuple[float, bool, bool, bool]:
    """`variant` as the norm operators' schemas spell it (`offset, upcast, weight_after_cast,
    cast_to_weight`: a `torch.library` schema takes tensors and scalars, not a dataclass).
    The one place a variant is unpacked; `_variant_of` is the one place it is rebuilt.
    ValueError for a variant without fast paths (`NormVariant.fast`): the schemas carry no
    root, so the operator would compute another rounding (`rms_norm` never calls it so)."""
    if not variant.fast:
        raise ValueError(f"norm operators compute the rsqrt spelling only, not {variant.root}")
    return (variant.offset, variant.upcast, variant.weight_after_cast, variant.cast_to_weight)


@functools.lru_cache(maxsize=256)
def _variant_of(
    offset: float, upcast: bool, weight_after_cast: bool, cast_to_weight: bool
) -> NormVariant:
    """The `NormVariant` a norm operator was called with, rebuilt from the schema's scalars
    (`_operator_args`) by its implementation, fake and autograd context. Cached: a compiled
    model calls the operator with a handful of distinct variants, and the cache's lookup is
    cheaper than building one per call; a frozen value is safe to share."""
    return NormVariant(offset, upcast, weight_after_cast, cast_to_weight)


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
    variant = _variant_of(offset, upcast, weight_after_cast, cast_to_weight)
    return kernels.get(backend, x.device).rms_norm(x, weight, eps, variant=variant)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, offset, upcast, weight_after_cast, cast_to_weight, backend):
    # The reference traces on fake tensors: its output dtype is the variant's, by definition.
    variant = _variant_of(offset, upcast, weight_after_cast, cast_to_weight)
    return reference.rms_norm(x, weight, eps, variant=variant)


def rms_norm(
    backend: str,
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    variant: NormVariant = DEFAULT_VARIANT,
) -> Tensor:
    """`Kernels.rms_norm` on `backend` (see `fusion.kernels.Kernels`): a new tensor, `x`
    normalised in `variant`; `reference.rms_norm`'s plain ops, whatever the backend, for a
    variant no kernel computes (`NormVariant.fast`: a root spelled other than `rsqrt`)."""
    if not variant.fast:
        return reference.rms_norm(x, weight, eps, variant=variant)
    if eager_reference(backend, x):
        return _REFERENCE.rms_norm(x, weight, eps, variant=variant)
    if _use_operator():
        if _reference_for(backend, x.device, "rms_norm", x, weight):
            return reference.rms_norm(x, weight, eps, variant=variant)
        return torch.ops.fusion.rms_norm(x, weight, eps, *_operator_args(variant), backend)
    chosen = _kernels(backend, x.device, "rms_norm", x, weight)
    return chosen.rms_norm(x, weight, eps, variant=variant)


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
    variant = _variant_of(offset, upcast, weight_after_cast, cast_to_weight)
    return kernels.get(backend, a.device).add_rms_norm(a, b, weight, eps, variant=variant)


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(
    a, b, weight, eps, offset, upcast, weight_after_cast, cast_to_weight, backend
):
    # The reference on fake tensors: the sum's promotion and broadcast, the variant's dtype.
    variant = _variant_of(offset, upcast, weight_after_cast, cast_to_weight)
    return reference.add_rms_norm(a, b, weight, eps, variant=variant)


def add_rms_norm(
    backend: str,
    a: Tensor,
    b: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    variant: NormVariant = DEFAULT_VARIANT,
) -> tuple[Tensor, Tensor]:
    """`Kernels.add_rms_norm` on `backend`: `(a + b, rms_norm(a + b))` in `variant`, two
    new tensors; `reference`'s plain ops for a variant no kernel computes (as `rms_norm`)."""
    if not variant.fast:
        return reference.add_rms_norm(a, b, weight, eps, variant=variant)
    if eager_reference(backend, a):
        return _REFERENCE.add_rms_norm(a, b, weight, eps, variant=variant)
    if _use_operator():
        if _reference_for(backend, a.device, "add_rms_norm", a, b, weight):
            return reference.add_rms_norm(a, b, weight, eps, variant=variant)
        return torch.ops.fusion.add_rms_norm(a, b, weight, eps, *_operator_args(variant), backend)
    chosen = _kernels(backend, a.device, "add_rms_norm", a, b, weight)
    return chosen.add_rms_norm(a, b, weight, eps, variant=variant)


@torch.library.custom_op("fusion::act_and_mul", mutates_args=())
def _act_and_mul_op(x: Tensor, activation: str, backend: str) -> Tensor:
    return kernels.get(backend, x.device).act_and_mul(x, activation)


@_act_and_mul_op.register_fake
def _act_and_mul_fake(x, activation, backend):
    return reference.act_and_mul(x, activation)


def act_and_mul(backend: str, x: Tensor, activation: str) -> Tensor:
    """`Kernels.act_and_mul` on `backend`."""
    if eager_reference(backend, x):
        return reference.act_and_mul(x, activation)
    if _use_operator():
        if _reference_for(backend, x.device, "act_and_mul", x):
            return reference.act_and_mul(x, activation)
        return torch.ops.fusion.act_and_mul(x, activation, backend)
    return _kernels(backend, x.device, "act_and_mul", x).act_and_mul(x, activation)


def act_and_mul_pair(backend: str, gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """`act(gate) * up`, as `act_and_mul(backend, cat((gate, up), -1), activation)`: the
    reference's elementwise ops on the two tensors where `backend` computes act-and-mul
    with the reference for these operands (every CPU backend; any backend under autocast or
    a mode), else the backend's kernel on their concatenation (its one-input contract)."""
    if eager_reference(backend, gate) or _reference_for(
        backend, gate.device, "act_and_mul", gate, up
    ):
        return reference.act_and_mul_pair(gate, up, activation)
    return act_and_mul(backend, torch.cat((gate, up), -1), activation)


_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64
)}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    return str(dtype).removeprefix("torch.") if name is None else name


def _fast_product(kernel: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """`F.linear(x, weight, bias)` by `kernel` where it is eligible for this call (each
    kernel's `applies` asks the dispatcher's contract, `contract.plain_dense`, with its own
    operand rules), else None."""
    if kernel == "native":
        return native_gemm.try_linear(x, weight, bias)
    if kernel == "onednn-row":
        if onednn_backend.row_linear_applies(x, weight, bias):
            return onednn_backend.row_linear(x, weight, bias)
        return None
    if kernel == "stacked":
        return torch.nn.functional.linear(x, weight, bias)
    return None


def _chosen_product(
    op: str, shape: tuple[int, ...], backend: str, x: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor | None:
    """The eager choice of `product`: the kernels the policy names for this call, the first
    eligible one; None for the reference."""
    return first_eligible(chosen(op, shape, backend, x, weight.shape[-1]), x, weight, bias)


def first_eligible(
    kernels: tuple[str, ...], x: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor | None:
    """Eager: `F.linear(x, weight, bias)` by the first of `kernels` (what `chosen` named for
    this call) eligible for these operands, else None (the caller computes its reference)."""
    for kernel in kernels:
        out = _fast_product(kernel, x, weight, bias)
        if out is not None:
            return out
    return None


def chosen(op: str, shape: tuple[int, ...], backend: str, x: Tensor, width: int) -> tuple[str, ...]:
    """The kernels `policy.POLICY` names for `op` at this shape, `x`'s dtype, its row count
    (`x.numel() // width`), the thread count and `backend`, in the order to try them; empty:
    the reference. Eager: an empty answer means `product` would answer None for any
    operands, so the caller may compute its reference at once, without checking anything a
    kernel would need (a merged projection's views, the operands' eligibility), since only a
    chosen kernel reads them; otherwise it hands the answer to `first_eligible` (one
    memoised lookup, not two)."""
    rows = x.numel() // width if width else 0
    return policy.POLICY.choose(op, shape, dtype_name(x.dtype), rows, backend)


def chosen_for(
    memo: tuple | None, op: str, shape: tuple[int, ...], backend: str, x: Tensor, width: int
) -> tuple[tuple, tuple[str, ...]]:
    """Eager: `(memo, kernels)`, where `kernels` is `chosen(op, shape, backend, x, width)`
    and `memo` what the caller keeps for its next call (one product site: its op, shape and
    backend never change). A memo made in this policy epoch (`KernelPolicy.epoch`) for this
    dtype, row count and thread count answers without asking the policy, whose answer it is:
    any change of mode or table starts a new epoch, and the thread count is read now. Not
    while the policy records asks (each must reach `choose`). On a decode step this saves
    the policy's frames at every product, each from caches the last GEMV emptied."""
    rows = x.numel() // width if width else 0
    chooser = policy.POLICY
    key = (chooser.epoch, x.dtype, rows, torch.get_num_threads())
    if memo is not None and memo[0] == key and not chooser.recording:
        return memo, memo[1]
    kernels = chosen(op, shape, backend, x, width)
    return (key, kernels), kernels


_PRODUCTS = torch.library.Library("fusion", "FRAGMENT")
"""The library of the two product operators, which compiled decode code calls once per
projection (`_product_operator`)."""


def _product_operator(schema: str, impl: Any, fake: Any) -> None:
    """Define `fusion::<name>` by `schema`, with `impl` its one kernel
    (CompositeExplicitAutograd: every device, below autograd) and `fake` its fake
    implementation; no autograd kernel of ours.

    Why not `torch.library.custom_op`, as every other operator here: its Python autograd
    kernel runs on every call, gradient or not, and costs about three times this
    registration's dispatch, on the path where a one-row kernel exists to save a few tens of
    microseconds, once per projection of every compiled decode step (docs/benchmarks.md,
    "fusion/kernels/ops.py"). Why it is safe without one: both are inference-only by their
    callers, which trace them only where no gradient is recorded (`reference.records_grad`,
    checked in `native_gemm.traced`, `onednn_backend.row_linear_traced` and
    `traced_stacked_product`), and Dynamo guards the grad mode the trace saw. A direct call
    that records a gradient gets PyTorch's autograd fallback, which warns at backward: not
    a path fusion takes."""
    name = schema.split("(", 1)[0]
    _PRODUCTS.define(schema)
    _PRODUCTS.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fusion::{name}", fake, lib=_PRODUCTS)


def _linear_product_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, op: str, shape: list[int], backend: str
) -> Tensor:
    """`F.linear(x, weight, bias)` by the kernel the policy chooses when the compiled code
    runs (`_chosen_product`; settings read then), else by `F.linear`: what eager
    `LinearForward` and `MergedLinear` run, made one node of a compiled graph (Inductor cannot
    lower the kernels itself). Inference only (`_product_operator`)."""
    out = _chosen_product(op, tuple(shape), backend, x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias) if out is None else out


def _linear_product_fake(x, weight, bias, op, shape, backend):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_product_operator(
    "linear_product(Tensor x, Tensor weight, Tensor? bias, str op, int[] shape, str backend)"
    " -> Tensor",
    _linear_product_op,
    _linear_product_fake,
)


def product(
    op: str, shape: tuple[int, ...], backend: str, x: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor | None:
    """`F.linear(x, weight, bias)` by the kernel `policy.POLICY` chooses for `op` ('linear'
    or 'stacked') at this shape, dtype, row count, thread count and `backend`, where that
    kernel is eligible for the call; None where the reference is chosen or nothing chosen
    is eligible (the caller computes its reference: `F.linear`, or a merged module's shards
    apart). Eager: the choice is made now. While Dynamo traces: the `fusion::linear_product`
    operator where a fast kernel could be eligible by the rules a trace can ask (no
    autocast, subclass or mode; the operator makes the policy's choice, settings included,
    when the compiled code runs), else None; `backend="torch"` traces nothing of ours. None
    too where the product is watched and nothing was measured to win for this call
    (`KernelPolicy.traced_reference`): Inductor then sees `F.linear`.
    Every kernel reads the live weight and caches nothing."""
    if not torch.compiler.is_compiling():
        return _chosen_product(op, shape, backend, x, weight, bias)
    width = weight.shape[-1]
    rows = x.numel() // width if width else 0
    if policy.POLICY.traced_reference((op, shape, backend), dtype_name(x.dtype), rows):
        return None
    if backend != "torch" and (
        native_gemm.traced(x, weight, bias) or onednn_backend.row_linear_traced(x, weight, bias)
    ):
        return torch.ops.fusion.linear_product(x, weight, bias, op, list(shape), backend)
    return None


def stacked_views_hold(
    weight: Tensor,
    bias: Tensor | None,
    shard_weights: list[Tensor],
    shard_biases: list[Tensor | None],
    stacked_bias: list[bool],
) -> bool:
    """Does one product on `weight` (`bias`) compute exactly what each shard's `F.linear` on
    its `(shard_weights[i], shard_biases[i])` computes, row block by row block? Each shard
    weight must *be* its rows of `weight`: the same dtype, a contiguous `(N_i, K)` block at
    its byte offset (rows stacked in order), no negative bit; each shard bias likewise in
    `bias`, and a shard without one must have been stacked without one
    (`stacked_bias[i]` False: its rows of `bias` are zeros). Memory and metadata only, so
    it holds for the tensors a compiled graph is handed at run time, whatever Dynamo
    guarded (it guards neither `.data` nor an address): `p.data = other`, a replaced
    Parameter, a restacked model all make it False."""
    if weight.dim() != 2 or not weight.is_contiguous() or weight.is_neg():
        return False
    width = weight.shape[1]
    item = weight.element_size()
    dtype = weight.dtype
    base = weight.data_ptr()
    bias_base = 0 if bias is None else bias.data_ptr()
    row = 0
    for w, b, had_bias in zip(shard_weights, shard_biases, stacked_bias, strict=True):
        if (
            w.dtype != dtype
            or w.dim() != 2
            or w.shape[1] != width
            or not w.is_contiguous()
            or w.is_neg()
            or w.data_ptr() != base + row * width * item
        ):
            return False
        size = w.shape[0]
        if b is None:
            if had_bias:  # its rows of the stacked bias still hold the bias it had
                return False
        elif (
            bias is None
            or not had_bias
            or b.dtype != dtype
            or b.shape != (size,)
            or not b.is_contiguous()
            or b.is_neg()
            or b.data_ptr() != bias_base + row * item
        ):
            return False
        row += size
    return row == weight.shape[0] and (bias is None or bias.shape == (row,))


def _shards_concatenated(
    x: Tensor, shard_weights: list[Tensor], shard_biases: list[Tensor | None]
) -> Tensor:
    """Each shard's `F.linear` (the unfused calls), concatenated along the last dimension."""
    return torch.cat(
        [torch.nn.functional.linear(x, w, b) for w, b in zip(shard_weights, shard_biases)], -1
    )


def _stacked_product_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    shard_weights: list[Tensor],
    shard_biases: list[Tensor | None],
    stacked_bias: list[bool],
    shape: list[int],
    backend: str,
) -> Tensor:
    """A merged projection's outputs, concatenated: one product on the stacked `weight` by
    the kernel the policy chooses when the compiled code runs, where the shards' tensors
    are still its rows (`stacked_views_hold`, checked at every call); else, and where the
    policy names no kernel or none is eligible, each shard's own `F.linear` (the unfused
    calls), concatenated. What eager `MergedLinear.outputs` runs, made one node of a
    compiled graph, so the shards are not computed apart under compile. Inference only
    (`_product_operator`): `traced_stacked_product` calls it only where no gradient is
    recorded."""
    if stacked_views_hold(weight, bias, shard_weights, shard_biases, stacked_bias):
        out = _chosen_product("stacked", tuple(shape), backend, x, weight, bias)
        if out is not None:
            return out
    return _shards_concatenated(x, shard_weights, shard_biases)


def _stacked_product_fake(
    x, weight, bias, shard_weights, shard_biases, stacked_bias, shape, backend
):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in shard_weights))


_product_operator(
    "stacked_product(Tensor x, Tensor weight, Tensor? bias, Tensor[] shard_weights,"
    " Tensor?[] shard_biases, bool[] stacked_bias, int[] shape, str backend) -> Tensor",
    _stacked_product_op,
    _stacked_product_fake,
)


def traced_stacked_product(
    shape: tuple[int, ...],
    backend: str,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    current: list[tuple[Tensor, Tensor | None]],
    stacked_bias: tuple[bool, ...],
) -> Tensor | None:
    """While Dynamo traces a merged projection (stacked weight `weight`, `bias`; its shards'
    current `(weight, bias)` pairs `current`; `shape` its policy key): the
    `fusion::stacked_product` operator, which checks the views and makes the policy's
    stacked choice when the compiled code runs; else None (the caller traces the shards
    apart: the unfused calls, which Inductor compiles best). The operator is traced unless
    the product computes its reference for this call whatever the thread count
    (`KernelPolicy.traced_reference`: nothing measured to win for this shape, dtype and row
    bucket under `backend`, so it would compute the shards apart anyway; an unanswered key
    or a dynamic row count traces it, and it decides when it runs), where PyTorch would run the
    plain dense product (`contract.plain_dense` as far as a trace can ask: no autocast,
    subclass or mode) and no gradient is recorded (the operator has no derivative of its
    own). `backend="torch"` traces nothing of ours."""
    if weight is None or backend == "torch":
        return None
    rows = x.numel() // shape[-1] if shape[-1] else 0
    if policy.POLICY.traced_reference(("stacked", shape, backend), dtype_name(x.dtype), rows):
        return None
    tensors = [x, weight, *(t for pair in current for t in pair if t is not None)]
    if bias is not None:
        tensors.append(bias)
    if reference.records_grad(*tensors):
        return None
    if contract.plain_dense(x.device.type, x, weight, bias) is not None:
        return None
    return torch.ops.fusion.stacked_product(
        x,
        weight,
        bias,
        [w for w, _ in current],
        [b for _, b in current],
        list(stacked_bias),
        list(shape),
        backend,
    )


def prepare(backend: str) -> None:
    """Make the machine checks behind `product` for `backend` now (building the native
    kernel only where `backend` may run it, loading the policy's table, answering the quiet
    lane), outside any trace: compiled code only reads their results (a fused model
    compiled before any eager call would otherwise find the lane unanswered and trace the
    rewrites, `KernelPolicy.traced_lane`). `fusion.fuse` calls it once; no module
    constructor does."""
    kernels_allowed = set(policy.allowed("linear", backend) + policy.allowed("stacked", backend))
    if "onednn-row" in kernels_allowed:
        onednn_backend.resolve_machine()
    if "native" in kernels_allowed:
        native_gemm.resolve()
    policy.POLICY.table  # noqa: B018  (loads this machine's calibration table)
    policy.POLICY.quiet()
    policy.POLICY.answer_lanes()


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
    chosen = _experts_backend(backend, hidden, gate_up, topk_ids)
    return kernels.get(chosen, hidden.device).moe_experts(
        hidden, gate_up, down, topk_ids, topk_weights, activation
    )


def _experts_backend(backend: str, hidden: Tensor, gate_up: Tensor, topk_ids: Tensor) -> str:
    """The backend whose `moe_experts` computes this call: `backend` itself when it names
    one or the device is not a CPU; for `auto` on a CPU, the kernel the policy chooses for
    these experts' shape, dtype, token count and threads (`policy.POLICY`: measured on this
    machine; 'torch', the reference, where nothing was measured or nothing chosen is
    available here). `eligible` mode skips a backend `auto` may not pick on this machine
    (`Kernels.auto_pick`), as `auto` did before the policy measured."""
    if backend != "auto" or hidden.device.type != "cpu" or gate_up.dim() != 3:
        return backend
    shape = (*gate_up.shape, topk_ids.shape[-1])
    rows = hidden.shape[0] if hidden.dim() == 2 else 0
    for kernel in policy.POLICY.choose("experts", shape, dtype_name(hidden.dtype), rows, "auto"):
        try:
            candidate = kernels.get(kernel, "cpu")  # builds or probes only this backend
        except ValueError:  # not available on this machine
            continue
        if policy.POLICY.mode != "eligible" or candidate.auto_pick:
            return kernel
    return "torch"


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
            return reference.moe_experts(*operands, activation)
        return torch.ops.fusion.moe_experts(*operands, activation, backend)
    chosen = _experts_backend(backend, hidden, gate_up, topk_ids)
    return _kernels(chosen, hidden.device, "moe_experts", *operands).moe_experts(
        *operands, activation
    )


# --------------------------------------------------------------------------------------------
# Autograd of the operators (formulas in `fusion.kernels.autograd`). `setup_context` keeps
# the inputs; each backward returns one gradient per operator argument (None for the
# non-tensor ones and the integer expert ids).


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps, *flags, _backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.variant = eps, _variant_of(*flags)


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    d_x, d_weight = autograd.rms_norm_backward(grad, x, weight, ctx.eps, ctx.variant)
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
    a, b, weight, eps, *flags, _backend = inputs
    ctx.save_for_backward(a, b, weight)
    ctx.eps, ctx.variant = eps, _variant_of(*flags)


def _add_rms_norm_backward(ctx, grad_sum, grad_norm):
    a, b, weight = ctx.saved_tensors
    d_a, d_b, d_weight = autograd.add_rms_norm_backward(
        grad_sum, grad_norm, a, b, weight, ctx.eps, ctx.variant
    )
    return d_a, d_b, d_weight, None, None, None, None, None, None


_add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)

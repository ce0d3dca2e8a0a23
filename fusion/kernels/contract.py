"""The dispatcher's contract: where a fast path may stand in for PyTorch's dense kernel.

A fast path (the native C kernel, oneDNN's one-row product and expert GEMMs, MergedLinear's
per-shard products, the GPU backends' kernels) computes what PyTorch's plain dense kernel
computes for the same tensors, and nothing more: it does not know about autocast, tensor
subclasses, `__torch_function__` / `__torch_dispatch__` modes, functorch transforms or
numerics settings, all of which make PyTorch run something else for the same call. So a fast
path may run only where PyTorch itself would run the plain dense kernel; `plain_dense` is
the one predicate that says so, and every fast path asks it (`ops`, `native_gemm`,
`onednn_backend`, `native_backend`, `MergedLinear`). Anything it refuses runs the reference
op (`F.linear`, `reference`), which PyTorch dispatches with all of that state applied.

Invariant (why a fast path is then safe): with no autocast for the device, no
`__torch_function__` override (plain `torch.Tensor` / `nn.Parameter` operands, no mode but
the factory-only `torch.device` context), no `__torch_dispatch__` mode or subclass, no
functorch transform, plain strided operands on the device, and the float32 matmul precision
strict ('ieee' or 'none', i.e. 'highest'), `F.linear` (and `mm`) dispatches straight to the
device's dense kernel on the given operands: the call's result dtype and function are the
operands' own, which is what every fast path computes (its rounding is its own business,
bounded by its tests). Fail closed: a setting that cannot be read, a device type without
known settings, or any state not listed here is "not plain".

Under `torch.compile` (while Dynamo traces) only the rules Dynamo can trace and guards on are
asked: autocast (guarded as global state; an autocast region inside the compiled function is
seen too), `__torch_function__` modes (Dynamo traces them and guards on the mode stack),
operand types and layouts (guarded on the inputs). A refusal traces the reference, so the
compiled graph calls `F.linear` (whose autocast and mode handling Dynamo and AOTAutograd
apply). The rest is not traceable, and needs no trace-time answer: the precision settings
change rounding, never an output's dtype or shape, and the operators a fast path is traced
as (`fusion::linear_product`, `fusion::moe_experts`) ask this predicate again, whole, each
time the compiled code runs them (Dynamo guards on the legacy
`set_float32_matmul_precision` through its CUDA TF32 flag, but not on the oneDNN settings:
the run-time check covers both, tested); dispatch modes and functorch transforms see the
operator as one op.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._device import DeviceContext

STRICT_FP32 = frozenset({"none", "ieee"})
"""float32 precision settings under which a device's dense matmul computes in float32
('none' is the default, 'ieee' what `set_float32_matmul_precision("highest")` sets)."""

MATMUL_PRECISION: dict[str, tuple[str, str]] = {
    "cpu": ("mkldnn", "matmul"),
    "cuda": ("cuda", "matmul"),
}
"""Per device type, the (backend, op) float32 precision setting its dense matmul follows.
Setting a parent ('generic' / 'all', e.g. `torch.backends.fp32_precision` or
`torch.backends.mkldnn.fp32_precision`) writes it through to this leaf, and
`set_float32_matmul_precision` writes both leaves ('medium' -> oneDNN 'bf16', CUDA 'tf32';
'highest' -> 'ieee'), so the leaf is the value ATen reads. Other device types have no known
settings: refused."""

DETERMINISM_MATTERS = frozenset({"cuda"})
"""Device types whose dense kernels change with `torch.use_deterministic_algorithms` (cuBLAS
workspace and split-K choices): refused there while it is on. On CPU the dense GEMMs are
unaffected and the fast paths here are deterministic by construction (the native kernel's
order depends only on K), so the setting does not matter."""


def plain_dense(device_type: str, *tensors: Tensor | None, matmul: bool = True) -> str | None:
    """None where PyTorch itself would run the plain dense kernel on `tensors` (the operands
    of one call; None entries, e.g. an absent bias, are skipped) on `device_type` now, so a
    fast path computing the dense function may stand in for it; else why not (the first
    rule that fails, for reports and tests). `matmul`: the op is a matrix product, so the
    matmul numerics settings apply (False for norms and elementwise ops, which no precision
    setting changes). The rules and why they suffice are in the module docstring.

    Cost, eager: one autocast probe, two mode probes, a functorch probe, a type, layout and
    device test per tensor, one settings read: a few microseconds (see the issue 24 report
    for the figure measured), against tens of microseconds or more for the products it
    guards."""
    if torch.compiler.is_compiling():
        return _traced_reason(device_type, tensors)
    if torch._C._is_any_autocast_enabled():  # one cheap probe for the common case
        reason = _autocast_reason(device_type)
        if reason is not None:
            return reason
    if torch._C._is_torch_function_mode_enabled() and not _only_device_context():
        return "a __torch_function__ mode is active"
    if torch._C._len_torch_dispatch_stack():
        return "a __torch_dispatch__ mode is active"
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "a functorch transform (vmap, grad, jvp, ...) is active"
    reason = _operands_reason(device_type, tensors, traced=False)
    if reason is not None or not matmul:
        return reason
    return _settings_reason(device_type)


def mode_reason() -> str | None:
    """Why an active mode would see a fast path's ops instead of the original's, or None:
    `plain_dense`'s mode rules alone, asked before touching any tensor (under a
    `__torch_function__` mode even `x.dim()` is an op the mode records). Eager only."""
    if torch._C._is_torch_function_mode_enabled() and not _only_device_context():
        return "a __torch_function__ mode is active"
    if torch._C._len_torch_dispatch_stack():
        return "a __torch_dispatch__ mode is active"
    return None


def _traced_reason(device_type: str, tensors: tuple[Tensor | None, ...]) -> str | None:
    """`plain_dense` while Dynamo traces: the rules it can trace and guards on (module
    docstring); the operators a fast path is traced as ask the rest when they run."""
    reason = _autocast_reason(device_type)
    if reason is not None:
        return reason
    if torch._C._is_torch_function_mode_enabled() and not _only_device_context():
        return "a __torch_function__ mode is active"
    return _operands_reason(device_type, tensors, traced=True)


def _autocast_reason(device_type: str) -> str | None:
    """Why autocast may change what the dense kernel computes on `device_type`, or None: it
    is enabled there, or the device type is not one whose rules this module knows
    (`MATMUL_PRECISION`; autocast's state cannot even be read for some, e.g. 'meta')."""
    if device_type not in MATMUL_PRECISION:
        return f"autocast state unknown for device type {device_type}"
    if torch.is_autocast_enabled(device_type):
        return f"autocast is enabled for {device_type}"
    return None


def _only_device_context() -> bool:
    """Whether the one active `__torch_function__` mode is `torch.device(...)`'s (also what
    `torch.set_default_device` pushes): it only fills in the device of factory calls, which
    neither a dense product nor a fast path's explicitly placed outputs are, so it changes
    nothing here. It sits at the bottom of the stack and at most once (`DeviceContext`)."""
    stack = torch.overrides._get_current_function_mode_stack()
    return len(stack) == 1 and type(stack[0]) is DeviceContext


def _operands_reason(
    device_type: str, tensors: tuple[Tensor | None, ...], *, traced: bool
) -> str | None:
    """Why these operands are not plain strided tensors on `device_type`, or None. `traced`:
    Dynamo is tracing (which folds `t.device.type` to a constant, but records `t.is_cpu`
    in the graph)."""
    for t in tensors:
        if t is None:
            continue
        # exactly these classes: `nn.Parameter` disables `__torch_function__`, so either
        # dispatches straight to the kernel; any subclass may override what runs
        if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
            return f"an operand is a tensor subclass ({type(t).__name__})"
        if t.layout is not torch.strided or t.is_nested:
            return f"an operand has layout {t.layout}"
        if not (t.device.type == device_type if traced else _on_device(t, device_type)):
            return f"an operand is on device {t.device}, not {device_type}"
    return None


def _on_device(t: Tensor, device_type: str) -> bool:
    """Whether `t` lies on a device of `device_type`; the flags first, as `t.device` builds
    a device object (microseconds a tensor)."""
    if device_type == "cpu":
        return t.is_cpu
    if device_type == "cuda":
        return t.is_cuda
    return t.device.type == device_type


def _settings_reason(device_type: str) -> str | None:
    """Why the device's numerics settings are not the strict defaults, or None (module
    docstring: `MATMUL_PRECISION`, `DETERMINISM_MATTERS`). A setting that cannot be read
    (a renamed API, a state torch refuses to report) is not strict."""
    setting = MATMUL_PRECISION.get(device_type)
    if setting is None:
        return f"no known numerics settings for device type {device_type}"
    try:
        precision = torch._C._get_fp32_precision_getter(*setting)
    except (AttributeError, RuntimeError, TypeError) as exc:
        return f"the float32 matmul precision cannot be read: {exc}"
    if precision not in STRICT_FP32:
        return f"the float32 matmul precision of {device_type} is {precision!r}"
    if device_type in DETERMINISM_MATTERS and torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms are enabled"
    return None

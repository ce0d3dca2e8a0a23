"""Triton's interpreter (`TRITON_INTERPRET=1`) made to run real kernels faithfully on a CPU.

A system under test whose kernels are Triton (Liger Kernel, `harness.peers.liger_apply`) runs
on a GPU-less machine only through Triton's interpreter, which executes each kernel program by
program with numpy. Triton 3.9's interpreter has four gaps that make correct kernels fail or
look wrong; this module is the one place that handles them, each with a shim installed only
while `shims()` is entered and only when the interpreter is on (`interpreter_on()`):

1. Python float kernel arguments stay Python floats (`_implicit_cvt` converts ints, bools
   and tensors, not floats), so `eps.to(tl.float32)` raises. Compiled Triton passes a float
   as an fp32 scalar; the shim does the same.
2. libdevice functions (`triton.language.extra.libdevice.rsqrt`, `tanh`, ...) are empty stubs
   that the compiler resolves; interpreted, they return None. The shim swaps the stubs a
   kernel's module bound for numpy implementations while that kernel runs.
3. `@triton.autotune` benchmarks every config, which needs a GPU driver. The shim keeps the
   first config that survives the kernel's own pruning (no benchmark; one config).
4. bfloat16 is stored as uint16 and arithmetic runs on the raw bit patterns (NaN logits), and
   float32 -> bfloat16 casts truncate where compiled Triton rounds to nearest even (a correct
   kernel looks 1.3-2.2x less accurate). The shim computes bfloat16 arithmetic in float32
   (exact for + - * /, then one rounding, as the hardware's rounding of the exact result) and
   rounds float32 -> bfloat16 to nearest even, bit for bit torch's `.to(torch.bfloat16)`;
   `tl.dot` of bfloat16 operands (the interpreter multiplies bit patterns) is computed on
   their values with the accumulator's float32, as a GPU's MMA accumulates; reductions and
   `tl.atomic_add` of bfloat16 (the interpreter's atomics refuse it) likewise on values.

What a CPU run still cannot show (docs/systems.md): programs run one at a time (no races, no
atomics contention), one autotune config, GPU-only backends never run. On a GPU none of this
is installed: the same system runs the compiled kernels.

Fail closed: every shim wraps the interpreter's own function and defers to it for anything
it does not handle; `uninstall` puts back exactly what `install` replaced, also after an
error; nothing is installed where Triton does not import or the interpreter is off.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LIBDEVICE_MODULES = ("triton.language.extra.libdevice", "triton.language.extra.cuda.libdevice")
"""Where libdevice stubs live; a kernel's module binds them under their own names."""

LIBDEVICE_NUMPY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "tanh": np.tanh,
    "sqrt": np.sqrt,
    "exp": np.exp,
    "log": np.log,
    "erf": np.vectorize(math.erf, otypes=[np.float64]),
}
"""The libdevice functions given an interpreted implementation (what Liger's kernels call)."""


def interpreter_on() -> bool:
    """True when Triton would build interpreted kernels (`TRITON_INTERPRET=1`); read from the
    environment as Triton reads it, so it holds for kernels decorated from now on."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}


# ------------------------------------------------------------------ bfloat16, bit for bit


def bf16_round(values: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest even: torch's
    `c10::BFloat16` conversion (NaN -> 0x7FC0), which compiled Triton's RTNE cast matches."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_truncate(values: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns rounded toward zero (Triton's RTZ cast)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return (bits >> 16).astype(np.uint16)


def bf16_widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> their exact float32 values."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


# ------------------------------------------------------------------ the resettable state


@dataclass
class InterpreterShims:
    """The installed shims: what was replaced, to be put back. The module's one state
    object (`SHIMS`); `reset()` uninstalls whatever is installed."""

    saved: list[tuple[Any, str, Any]] = field(default_factory=list)
    depth: int = 0

    @property
    def installed(self) -> bool:
        """Whether the shims are installed now."""
        return bool(self.saved)

    def install(self) -> None:
        """Install every shim (no-op when installed, Triton absent or the interpreter off)."""
        if self.saved or not interpreter_on():
            return
        try:
            interp = importlib.import_module("triton.runtime.interpreter")
            autotuner = importlib.import_module("triton.runtime.autotuner")
        except ImportError:
            return
        try:
            self._replace(interp, "_implicit_cvt", _float_args(interp))
            grid = interp.GridExecutor
            self._replace(grid, "__call__", _with_libdevice(grid.__call__))
            tuner = autotuner.Autotuner
            self._replace(tuner, "prune_configs", _one_config(tuner.prune_configs))
            builder = interp.InterpreterBuilder
            for name, wrap in _BF16_WRAPS.items():
                self._replace(builder, name, wrap(interp, getattr(builder, name)))
            reduce = interp.ReduceOps
            for name, wrap in _REDUCE_WRAPS.items():
                self._replace(reduce, name, wrap(getattr(reduce, name)))
        except Exception:
            self.reset()
            raise

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name` to `value`, keeping the value it had for `reset`."""
        self.saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def reset(self) -> None:
        """Put back everything `install` replaced, newest first."""
        while self.saved:
            owner, name, value = self.saved.pop()
            setattr(owner, name, value)
        self.depth = 0


SHIMS = InterpreterShims()


@contextlib.contextmanager
def shims() -> Iterator[bool]:
    """Enter with the interpreter's gaps handled (reentrant); yields whether shims are on.
    Off the interpreter (a GPU run) it installs nothing and yields False."""
    if SHIMS.depth == 0:
        SHIMS.install()
    SHIMS.depth += 1
    try:
        yield SHIMS.installed
    finally:
        SHIMS.depth -= 1
        if SHIMS.depth == 0:
            SHIMS.reset()


# ------------------------------------------------------------------ the four shims


def _float_args(interp: Any) -> Callable[[Any], Any]:
    """Gap 1: `_implicit_cvt` that makes a Python float an fp32 scalar tensor, as compiled
    Triton specialises it; everything else goes to the interpreter's own conversion."""
    original = interp._implicit_cvt
    tl = importlib.import_module("triton.language")

    def implicit_cvt(arg: Any) -> Any:
        if isinstance(arg, float):
            handle = interp.TensorHandle(np.array([arg], dtype=np.float32), tl.float32)
            return tl.tensor(handle, tl.float32)
        return original(arg)

    return implicit_cvt


def _libdevice_stubs() -> dict[int, str]:
    """{id(stub): name} of every libdevice stub that has a numpy implementation here."""
    stubs: dict[int, str] = {}
    for module_name in LIBDEVICE_MODULES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            for name in LIBDEVICE_NUMPY:
                if hasattr(module, name):
                    stubs[id(getattr(module, name))] = name
    return stubs


def _interpreted(name: str) -> Callable[[Any], Any]:
    """libdevice `name` for interpreted tensors: computed in float64 from the operand's
    values, returned in its dtype (bfloat16 through `bf16_round`)."""
    tl = importlib.import_module("triton.language")
    interp = importlib.import_module("triton.runtime.interpreter")
    fn = LIBDEVICE_NUMPY[name]

    def call(x: Any) -> Any:
        dtype = x.dtype.scalar if hasattr(x.dtype, "scalar") else x.dtype
        data = x.handle.data
        values = bf16_widen(data) if dtype == tl.bfloat16 else data
        out = np.asarray(fn(values.astype(np.float64)))
        out = bf16_round(out.astype(np.float32)) if dtype == tl.bfloat16 else out.astype(data.dtype)
        return tl.tensor(interp.TensorHandle(out, dtype), x.type)

    return call


def _with_libdevice(call: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 2: a kernel launch with the libdevice stubs its module bound replaced by
    `_interpreted` while it runs (restored after, also on error)."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        namespace = self.fn.__globals__
        stubs = _libdevice_stubs()
        swapped = {k: v for k, v in namespace.items() if id(v) in stubs}
        try:
            for key, stub in swapped.items():
                namespace[key] = _interpreted(stubs[id(stub)])
            return call(self, *args, **kwargs)
        finally:
            namespace.update(swapped)

    return run


def _one_config(prune: Callable[..., list]) -> Callable[..., list]:
    """Gap 3: the autotuner's pruning, keeping only the first surviving config, so that
    `Autotuner.run` takes its single-config path and benchmarks nothing."""

    def prune_configs(self: Any, kwargs: dict) -> list:
        return prune(self, kwargs)[:1]

    return prune_configs


def _bf16_cast(interp: Any, cast_impl: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: casts to and from bfloat16 through exact float32 values, float32 -> bfloat16
    rounded to nearest even (the interpreter truncates)."""
    tl = importlib.import_module("triton.language")

    def cast(self: Any, src: Any, dst_type: Any) -> Any:
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == dst_ty or tl.bfloat16 not in (src_ty, dst_ty):
            return cast_impl(self, src, dst_type)
        if src_ty == tl.bfloat16:
            widened = interp.TensorHandle(bf16_widen(src.data), tl.float32)
            return widened if dst_ty == tl.float32 else cast_impl(self, widened, dst_type)
        as_f32 = src if src_ty == tl.float32 else cast_impl(self, src, tl.float32)
        return interp.TensorHandle(bf16_round(as_f32.data), tl.bfloat16)

    return cast


def _bf16_fp_to_fp(interp: Any, fp_to_fp: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: an explicit-rounding float cast to bfloat16 honours its rounding mode (RTZ
    truncates, RTNE rounds to nearest even; the interpreter's RTNE rounds half up)."""
    tl = importlib.import_module("triton.language")

    def convert(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if dst_type.scalar != tl.bfloat16 or src.dtype.scalar != tl.float32:
            return fp_to_fp(self, src, dst_type, rounding_mode)
        rtz = rounding_mode == interp._ir.ROUNDING_MODE.RTZ
        bits = bf16_truncate(src.data) if rtz else bf16_round(src.data)
        return interp.TensorHandle(bits, tl.bfloat16)

    return convert


def _bf16_binary(interp: Any, binary_op: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: bfloat16 arithmetic and comparisons on values, not bit patterns: computed in
    float32 (exact for + - * of bfloat16; one rounding of / as the hardware's) and rounded."""
    tl = importlib.import_module("triton.language")

    def binary(self: Any, lhs: Any, rhs: Any, op: Callable[..., Any]) -> Any:
        if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
            return binary_op(self, lhs, rhs, op)
        out = op(bf16_widen(lhs.data), bf16_widen(rhs.data))
        if out.dtype == np.bool_:
            return interp.TensorHandle(out, lhs.dtype.scalar)
        return interp.TensorHandle(bf16_round(out.astype(np.float32)), tl.bfloat16)

    return binary


def _bf16_unary(interp: Any, unary_op: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: bfloat16 unary math (exp, log, sqrt, ...) on values, rounded back."""
    tl = importlib.import_module("triton.language")

    def unary(self: Any, arg: Any, op: Callable[..., Any]) -> Any:
        if arg.dtype.scalar != tl.bfloat16:
            return unary_op(self, arg, op)
        out = op(bf16_widen(arg.data)).astype(np.float32)
        return interp.TensorHandle(bf16_round(out), tl.bfloat16)

    return unary


def _bf16_fma(interp: Any, fma: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: a bfloat16 fused multiply-add on values (float64 holds the exact product)."""
    tl = importlib.import_module("triton.language")

    def create_fma(self: Any, x: Any, y: Any, z: Any) -> Any:
        if z.dtype.scalar != tl.bfloat16:
            return fma(self, x, y, z)
        x64, y64, z64 = (bf16_widen(h.data).astype(np.float64) for h in (x, y, z))
        out = (x64 * y64 + z64).astype(np.float32)
        return interp.TensorHandle(bf16_round(out), tl.bfloat16)

    return create_fma


def _bf16_dot(interp: Any, dot: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: `tl.dot` of bfloat16 operands on values (the interpreter multiplies the uint16
    bit patterns), accumulated in the accumulator's dtype as a GPU's MMA does (float32)."""
    tl = importlib.import_module("triton.language")

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return dot(self, a, b, d, *args)
        widened = [
            interp.TensorHandle(bf16_widen(h.data), tl.float32)
            if h.dtype.scalar == tl.bfloat16
            else h
            for h in (a, b)
        ]
        return dot(self, *widened, d, *args)

    return create_dot


def _bf16_atomic(interp: Any, atomic_rmw: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: `tl.atomic_add` on bfloat16 (the interpreter's atomics have no bfloat16: it
    raises "Unsupported data type"), element by element in order, each sum rounded to
    bfloat16 as a GPU's bfloat16 atomic add rounds; programs run one at a time here, so the
    order is the launch's (a GPU's is any). Returns the old values, as an atomic does."""
    tl = importlib.import_module("triton.language")
    fadd = interp._ir.ATOMIC_OP.FADD

    def create_atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *rest: Any) -> Any:
        if val.dtype.scalar != tl.bfloat16 or op != fadd:
            return atomic_rmw(self, op, ptr, val, mask, *rest)
        ptrs, values, masks = np.broadcast_arrays(ptr.data, val.data, mask.data)
        old = np.zeros(ptrs.shape, dtype=np.uint16)
        on, zero = np.ones(1, dtype=bool), np.zeros(1, dtype=np.uint16)
        for index in np.ndindex(ptrs.shape):
            if not masks[index]:
                continue
            address = np.array([ptrs[index]], dtype=np.uint64)
            current = interp._interpreter.load(address, on, zero, np.dtype(np.uint16))
            old[index] = current[0]
            total = bf16_widen(current) + bf16_widen(np.array([values[index]], dtype=np.uint16))
            interp._interpreter.store(address, bf16_round(total), on)
        return interp.TensorHandle(old, tl.bfloat16)

    return create_atomic_rmw


_BF16_WRAPS: dict[str, Callable[[Any, Callable[..., Any]], Callable[..., Any]]] = {
    "cast_impl": _bf16_cast,
    "create_fp_to_fp": _bf16_fp_to_fp,
    "binary_op": _bf16_binary,
    "unary_op": _bf16_unary,
    "create_fma": _bf16_fma,
    "create_dot": _bf16_dot,
    "create_atomic_rmw": _bf16_atomic,
}
"""InterpreterBuilder methods the bfloat16 shim wraps (the arithmetic lambdas call these)."""


def _bf16_sum(total: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: `tl.sum` of bfloat16 (kept bfloat16 by Triton) on values, in float32, rounded
    once (a GPU rounds its tree of bfloat16 additions: within that rounding)."""
    tl = importlib.import_module("triton.language")

    def total_bf16(self: Any, input: Any) -> Any:
        if input.dtype.scalar != tl.bfloat16:
            return total(self, input)
        values = bf16_widen(input.handle.data)
        out = np.sum(values, axis=self.axis, keepdims=self.keep_dims, dtype=np.float32)
        return self.to_tensor(bf16_round(np.asarray(out, dtype=np.float32)), input.dtype)

    return total_bf16


def _bf16_min_max(min_max: Callable[..., Any]) -> Callable[..., Any]:
    """Gap 4: `tl.min` / `tl.max` / argmin / argmax of bfloat16 on values (the bit patterns
    of negative numbers sort backwards); the extremes are exact, so rounding back is too."""
    tl = importlib.import_module("triton.language")

    def on_values(op: Callable[..., Any] | None, value: bool) -> Callable[..., Any] | None:
        if op is None:
            return None

        def run(data: np.ndarray, **kwargs: Any) -> Any:
            out = op(bf16_widen(data), **kwargs)
            return bf16_round(np.asarray(out, dtype=np.float32)) if value else out

        return run

    def min_max_bf16(self: Any, input: Any, val_reduce_op: Any, idx_reduce_op: Any = None) -> Any:
        inner = input[0] if isinstance(input, tuple) else input
        if inner.dtype.scalar != tl.bfloat16:
            return min_max(self, input, val_reduce_op, idx_reduce_op)
        ops = on_values(val_reduce_op, True), on_values(idx_reduce_op, False)
        return min_max(self, input, *ops)

    return min_max_bf16


_REDUCE_WRAPS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "sum": _bf16_sum,
    "min_max": _bf16_min_max,
}
"""ReduceOps methods the bfloat16 shim wraps (`tl.sum`, `tl.min`, `tl.max`, arg-variants)."""

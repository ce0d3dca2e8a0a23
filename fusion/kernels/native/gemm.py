"""Decode-sized float32 linears on CPU by our own kernel (`csrc/rowmajor_gemm.c`), reading the
live weight where it lies.

Why: at 1-256 rows a CPU linear is bound by streaming its weight from memory. MKL's float32
GEMM packs the weight it is given on every call (one more pass over it) and oneDNN's one-row
product stops at one row; a packed copy kept between calls is the stale-copy hazard the
lifecycle rules forbid. The kernel reads the row-major weight once, in place, as dot products
along K (see the C source), so nothing is cached and every write to the weight, by any
spelling, is seen by the next call. Measured with weights streamed from memory (as in a
decode step), it beats `F.linear` (and oneDNN's one-row product) at decode row counts; the
kernel policy runs it only where this machine's calibration measured it faster.

bfloat16 (same kernel, `fh_linear_bf16`): a bf16 weight is read where it lies, each value
widened exactly to float32 in registers, so half the bytes are streamed; the input rows and
the bias are widened to float32 beforehand (in C), and each float32 output is rounded to bf16
once, as PyTorch's own CPU bf16 linear accumulates in float32 and rounds once. Why: on CPUs
without a bf16 dot-product path for one row, `F.linear` in bf16 streams its weight no faster
(in bytes per second) than float32 does (measured well below float32's rate on an AVX-512
Xeon), so reading half the bytes is reading the weight faster.

Prefetch: the loops' hint (into L1, or only as far as L2) is this machine's measured
choice, made once per built library (`prefetch`): it moves where lines wait, never a result.

Rounding: each output is a sum over the vector lanes (16 with AVX-512, 8 with AVX2) of
blocked partial sums (the C source says how), which errs less than MKL against float64 (the
tests bound it by MKL's). The order depends only on K: bit-identical results at any
thread count and for any batch composition.

Fail closed, always to the caller's PyTorch path (`applies` False): anything but float32 or
bfloat16 operands of one dtype on CPU (the MoE experts: float32 only); autograd recording (the kernel has no derivative); wherever PyTorch itself would not run
its plain dense kernel (`contract.plain_dense`: autocast, a tensor subclass or a
`__torch_function__` / `__torch_dispatch__` mode, a functorch transform, a reduced float32
matmul precision); a weight not unit-stride along K, a K that is not a multiple of 16, more
rows than `rows_ok` allows, a weight under `MIN_ELEMENTS`;
under `torch.compile` (the caller traces the `fusion::linear_product` operator, which asks
again when it runs); a machine whose ATen capability is not in `LIMITS`; the library
unavailable (`status()` says why: no compiler, a build error, a failed probe, the CPU, or
`FUSION_NATIVE_KERNELS=0`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fusion.kernels import contract, reference
from fusion.kernels.native import build as native_build
from fusion.kernels.native import prefetch

MIN_ELEMENTS = 1 << 18
"""Smallest weight (N * K elements) the kernel takes (1 MiB in float32, 512 KiB in bf16):
below it the kernel's fixed costs (a ctypes call, a few tensor operations) are a large share
of a product however its weight is read. A model's weights of this size are streamed from
memory at every decode step (a decoder's layers together exceed any cache), which is where
the kernel wins: SmolLM2-135M's 576 x 576 and 576 x 1536 projections are above it. Whether it
runs is still the policy's measured choice. It is also the `decode_linear` fuser's size
rule, so the corpus' tiny models (their weights are at most a few ten thousand elements)
never take this path unless a test lowers it."""


@dataclass(frozen=True)
class RowLimits:
    """How many input rows the kernel takes on one kind of machine (`LIMITS`)."""

    max_rows: int
    """Most rows (product of `x`'s leading dimensions); more go to MKL, whose packed GEMM
    catches up as rows amortise the packing."""
    max_input_elements: int
    """Most input elements (rows * K): every block of weight rows re-reads the whole input,
    so it must stay in cache."""


LIMITS: dict[str, RowLimits] = {
    "AVX512": RowLimits(256, 1 << 20),
    "AVX2": RowLimits(64, 1 << 18),
}
"""Per ATen CPU capability (`torch.backends.cpu.get_cpu_capability()`): where `applies` may
answer True, and up to how many rows. A rule on the machine and the shape, never a timing, so
the same inputs on the same machine always take the same path (reproducible rounding).

AVX512 (measured on Zen 4, weights streamed, one and two threads): the kernel beats
`F.linear` up to 256 rows; beyond, at long reductions, the input every block of weight rows
re-reads falls out of cache and it loses. The input limit sits below what one machine's L3
held, as smaller caches are common.

AVX2 (the kernel built for x86-64-v3 and MKL limited to AVX2, emulated on the same Zen 4: no
AVX2-only machine was available; 8 lanes, blocks of 2 input x 4 weight rows, as AVX2 has 16
vector registers, which re-read the input half as often as blocks of 4 input x 2 weight
rows): it wins up to 64 rows and loses at some widths beyond, hence the lower limits."""

_NO_ROWS = RowLimits(0, 0)

DTYPES = (torch.float32, torch.bfloat16)
"""The operand dtypes the kernel computes (one dtype for input, weight and bias)."""

K_MULTIPLE = 16
"""The reduction length must be a multiple of the kernel's vector width (16 floats)."""

DISABLE_ENV = "FUSION_NATIVE_KERNELS"
"""Set to `0` to keep the native kernels off (read once, at first use)."""

_SOURCE = "rowmajor_gemm"
_ABI_VERSION = 6


@dataclass(frozen=True)
class Resolved:
    """What `resolve` found on this machine (or what a test pretends it found:
    `NativeKernelState.pretend`)."""

    function: object | None
    """The kernel's ctypes function (float32 weights), or None when it did not build or
    failed its probe."""
    reason: str
    """'built', or why `function` is None."""
    verdict: str
    """'available' where `applies` may pick the kernel, else why not."""
    limits: RowLimits
    """This machine's `LIMITS` entry (no rows where the verdict is not 'available')."""
    build: str
    """The built library's file name (it embeds the build's cache key), or 'none'."""
    bf16_function: object | None = None
    """The same kernel for bfloat16 operands (`fh_linear_bf16`), None wherever `function` is."""
    prefetch: int = prefetch.L1
    """The loops' prefetch hint, the last argument of every call (`prefetch.choose`:
    measured where the kernel is available, else `L1`); it never changes a result."""
    prefetch_reason: str = ""
    """How `prefetch` was chosen (`prefetch.Choice.reason`)."""


def _build() -> tuple[tuple[object, object] | None, str, native_build.Built]:
    """The kernel's two ctypes functions (float32, bf16 weights), built and probed on this
    machine, or None and why; and the build (its path names the build's identity)."""
    built = native_build.build(_SOURCE)
    functions, reason = _load(built)
    return functions, reason, built


def _load(built: native_build.Built) -> tuple[tuple[object, object] | None, str]:
    """The ctypes functions of `built` (float32, bf16 weights), typed and probed, or None
    and why."""
    if built.library is None:
        return None, built.reason
    try:
        version = built.library.fh_abi_version
        function = built.library.fh_linear
        bf16_function = built.library.fh_linear_bf16
    except AttributeError as exc:
        return None, f"{built.path} lacks a symbol: {exc}"
    version.restype = ctypes.c_int
    if version() != _ABI_VERSION:
        return None, f"{built.path} has ABI {version()}, expected {_ABI_VERSION}"
    for each in (function, bf16_function):
        _declare(each)
    runtimes = native_build.one_openmp_runtime()
    if runtimes:
        return None, f"{built.path} is not run: {runtimes}"
    for each, dtype in ((function, torch.float32), (bf16_function, torch.bfloat16)):
        problem = _probe(each, dtype)
        if problem:
            return None, f"{built.path} failed its {dtype} probe: {problem}"
    return (function, bf16_function), "built"


def _declare(function) -> None:
    """Type one of the kernel's entry points (both share one signature: pointers, strides,
    sizes, threads, the prefetch hint)."""
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
    ]


def _machine_rule() -> str:
    """'available' where `applies` may pick the kernel, else why not (the setting, the CPU)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"disabled by {DISABLE_ENV}=0"
    capability_ = capability()
    if capability_ not in LIMITS:
        return f"ATen CPU capability {capability_} is not in {sorted(LIMITS)}"
    return "available"


def capability() -> str:
    """ATen's CPU capability here ('AVX512', 'AVX2', 'DEFAULT', ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "DEFAULT"


def _probe(function, dtype: torch.dtype) -> str:
    """'' when small products with a bias and padded row strides, all operands of `dtype`
    (float32 or bfloat16, the entry point's), match float64 within that dtype's rounding at one
    and two threads and with each prefetch hint, all bit-identically, at one row (the one-row
    loop) and at five; else what differed."""
    # explicit device and dtype: the first call may come under `with torch.device("meta")`
    # or another default dtype (a model built on meta, then fused), where a plain
    # `torch.randn` would hand the kernel a pointer to no memory
    cpu = {"device": "cpu", "dtype": torch.float32}
    generator = torch.Generator(device="cpu").manual_seed(0)
    # float32 sums, then (bfloat16) one rounding of each output: half a unit in the last place
    rounding = 1e-4 if dtype == torch.float32 else 2.0**-8
    for rows in (1, 5):
        x = torch.randn(rows, 80, generator=generator, **cpu).to(dtype)[:, :48]
        weight = torch.randn(7, 64, generator=generator, **cpu).to(dtype)[:, :48]
        bias = torch.randn(7, generator=generator, **cpu).to(dtype)
        expected = x.double() @ weight.double().t() + bias.double()  # on CPU, as its operands
        outs = []
        for threads, hint in ((1, prefetch.L1), (2, prefetch.L1), (1, prefetch.L2)):
            out = torch.full((rows, 7), float("nan"), device="cpu", dtype=dtype)
            code = function(
                x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0), bias.data_ptr(),
                out.data_ptr(), 7, rows, 7, 48, threads, hint,
            )  # fmt: skip
            if code != 0:
                return f"returned {code} at {rows} rows"
            outs.append(out)
        error = ((outs[0].double() - expected).abs() / expected.abs().clamp(min=1)).max().item()
        if not error <= rounding:
            return f"max error {error:.3g} against float64 at {rows} rows"
        if not torch.equal(outs[0], outs[1]):
            return f"one and two threads differ at {rows} rows"
        if not torch.equal(outs[0], outs[2]):
            return f"the two prefetch hints differ at {rows} rows"
    return ""


class NativeKernelState:
    """What this process resolved about the native kernel (`Resolved`), computed once at
    first use, and what a test pretends instead.

    Two fields, because resolving costs a build (a compiler's `--version`, loading the
    library) and a probe: `stop_pretending` drops a test's pretence and goes back to what
    this machine resolved without redoing either, so the suite can drop pretences after every
    test at no cost, while `reset` (and `fresh`, for a block) forgets the machine's answer
    too, for a test that resolves again under other settings (`-march`, a capability)."""

    def __init__(self) -> None:
        self.current: Resolved | None = None
        """What every check reads: the machine's answer or a test's pretence; None until
        first use. A plain attribute, so `known_ok` and `rows_ok` are reads Dynamo traces
        (set it through the methods, which keep it consistent with what was resolved)."""
        self._machine: Resolved | None = None

    def resolve(self) -> Resolved:
        """What `current` holds, building (or loading) and probing the kernel first if
        nothing was resolved or pretended yet: never under a trace (see `resolve` below)."""
        current = self.current
        if current is None:
            current = self.current = self.machine()
        return current

    def machine(self) -> Resolved:
        """This machine's answer, whatever a test pretends: resolved (built, probed, the
        machine rule applied) at the first call and kept until `reset`."""
        if self._machine is None:
            functions, reason, built = _build()
            build = built.path.name if built.path is not None else "none"
            verdict = _machine_rule() if functions is not None else reason
            limits = LIMITS.get(capability(), _NO_ROWS) if verdict == "available" else _NO_ROWS
            function, bf16_function = functions if functions is not None else (None, None)
            # measured only where `applies` may run it: a disabled kernel costs nothing
            choice = (
                prefetch.choose(functions, built.path)
                if functions is not None and verdict == "available"
                else prefetch.Choice(prefetch.L1, f"not measured: {verdict}")
            )
            self._machine = Resolved(
                function, reason, verdict, limits, build, bf16_function, choice.hint, choice.reason
            )
        return self._machine

    def pretend(self, resolved: Resolved) -> None:
        """Every check reads `resolved` instead of this machine's answer (a test's machine),
        until `stop_pretending` or `reset`; nothing is built."""
        self.current = resolved

    def pretend_available(self, limits: RowLimits) -> None:
        """Pretend the machine rule allows the kernel, with `limits`: the kernel built here
        (resolved first) runs wherever the operand rules and `limits` allow. Raises
        RuntimeError where it did not build (there is no function to pretend with)."""
        real = self.machine()
        if real.function is None:
            raise RuntimeError(f"the native linear is not built here: {real.reason}")
        self.pretend(dataclasses.replace(real, reason="built", verdict="available", limits=limits))

    def pretend_off(self, reason: str) -> None:
        """Pretend the kernel is unavailable because of `reason` (as on a machine without a
        compiler): every check answers False and `linear` raises; nothing is built."""
        self.pretend(Resolved(None, reason, reason, _NO_ROWS, "none"))

    def stop_pretending(self) -> None:
        """Back to this machine's answer (None if it was never resolved: resolved at the
        next use); nothing is rebuilt. Safe at any time: a pretence only ever replaced it."""
        self.current = self._machine

    def reset(self) -> None:
        """Forget every answer and pretence: the next use builds (or loads the cached
        library) and probes again, as a new process would."""
        self.current = self._machine = None

    @contextmanager
    def fresh(self) -> Iterator[None]:
        """`reset` for a block (which then resolves again at first use, under whatever
        settings the block changed); afterwards the answers from before the block again, so
        one resolved under a test's settings never outlives it."""
        saved = self.current, self._machine
        self.reset()
        try:
            yield
        finally:
            self.current, self._machine = saved


NATIVE = NativeKernelState()
"""The process's one native-kernel state (`NATIVE.reset()` forgets it)."""


def resolve() -> None:
    """Build (or load) and probe the kernel now, and apply the machine rule, outside any
    trace: compiled code only reads `known_ok`."""
    NATIVE.resolve()


def build_id() -> str:
    """The built library's file name (its build identity), or 'none: why' (resolving first)."""
    state = NATIVE.resolve()
    return state.build if state.function is not None else f"none: {state.reason}"


def status() -> str:
    """'available' where `applies` may pick the kernel, else why not (resolving first)."""
    return NATIVE.resolve().verdict


def prefetch_status() -> tuple[str, str]:
    """The kernel's prefetch hint ('l1' or 'l2') and how it was chosen (resolving first): a
    speed figure of the kernel is a figure of this hint."""
    state = NATIVE.resolve()
    return prefetch.name(state.prefetch), state.prefetch_reason


def built() -> bool:
    """Whether the kernel is built and passed its probe here, whatever the machine rule says
    (`linear` works then; tests call it directly on every machine with a compiler)."""
    return NATIVE.resolve().function is not None


def known_ok() -> bool:
    """Whether `applies` may pick the kernel, if that was already resolved (False if not
    yet): a plain read Dynamo can trace."""
    state = NATIVE.current
    return state is not None and state.verdict == "available"


def rows_ok(rows: int, k: int) -> bool:
    """The row rules of this machine (`LIMITS`) for `rows` rows of K elements; False before
    `resolve` and wherever the kernel is off."""
    state = NATIVE.current
    limits = state.limits if state is not None else _NO_ROWS
    return 1 <= rows <= limits.max_rows and rows * k <= limits.max_input_elements


def _on_cpu(t: torch.Tensor, traced: bool) -> bool:
    """`t` lies in CPU memory. Eager: `t.is_cpu` (`t.device` builds a device object, ~1.5
    us a tensor); while Dynamo traces, `t.device.type`, which it folds to a constant (it
    records `is_cpu` as a graph node)."""
    return t.device.type == "cpu" if traced else t.is_cpu


def _layout_ok(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, traced: bool = False
) -> bool:
    """What the kernel reads, as it reads it (metadata only, so Dynamo can trace it: pass
    `traced` then): CPU operands of one dtype, float32 or bfloat16 (`DTYPES`), a 2-D weight
    unit-stride along K with rows at least K apart, an input of the weight's width, a bias
    of one value per output."""
    k = weight.shape[-1] if weight.dim() == 2 else -1
    dtype = weight.dtype
    return (
        x.dim() >= 1
        and x.shape[-1] == k
        and x.dtype == dtype
        and dtype in DTYPES
        and _on_cpu(x, traced)
        and _on_cpu(weight, traced)
        and weight.stride(1) == 1
        and weight.stride(0) >= k
        and (
            bias is None
            or (
                bias.dtype == dtype
                and _on_cpu(bias, traced)
                and tuple(bias.shape) == (weight.shape[0],)
            )
        )
    )


def _operands_ok(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, traced: bool
) -> bool:
    """The rules both checks share (module docstring), all from metadata: the layout the
    kernel reads (`_layout_ok`), then the speed rules and no gradient recorded. `traced`:
    Dynamo is tracing."""
    if not _layout_ok(x, weight, bias, traced=traced):
        return False
    k = weight.shape[1]
    return (
        k > 0
        and k % K_MULTIPLE == 0
        and rows_ok(x.numel() // k, k)
        and weight.numel() >= MIN_ELEMENTS
        and not reference.records_grad(x, weight, *(() if bias is None else (bias,)))
    )


def traced(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """While Dynamo traces: may this product go through `fusion::linear_product` (which makes
    `applies`' choice again when the compiled code runs)? The operand rules and the
    dispatcher's contract as far as a trace can ask it (`contract.plain_dense`: no autocast,
    subclass or mode; the operator asks the rest when it runs), on a machine where the
    kernel was already loaded (`resolve`)."""
    return (
        _operands_ok(x, weight, bias, traced=True)
        and known_ok()
        and contract.plain_dense("cpu", x, weight, bias) is None
    )


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` may compute `F.linear(x, weight, bias)` now: eager (not compiling),
    where PyTorch itself would run its plain dense kernel (`contract.plain_dense`, asked
    first: it also vouches for the operands' types before any of their metadata is read),
    the operand rules, the kernel available on this machine. Anything else: False, and the
    caller keeps its own path. Depends on shapes, dtypes, types, the dispatcher's state and
    the machine, never on timings."""
    if torch.compiler.is_compiling():
        return False
    state = NATIVE.resolve()
    return (
        contract.plain_dense("cpu", x, weight, bias) is None
        and _operands_ok(x, weight, bias, traced=False)
        and state.verdict == "available"
    )


def _check_memory(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError unless the kernel may read these tensors' memory as it will: the
    layout it reads (`_layout_ok`) on tensors that have storage (not meta). `linear` checks
    this on every call, whatever its caller checked, because a wrong pointer here is a crash
    of the whole process, not an exception (`run` then checks the storages' extent)."""
    tensors = [x, weight] + ([] if bias is None else [bias])
    if not (all(not t.is_meta for t in tensors) and _layout_ok(x, weight, bias)):
        raise ValueError(f"native linear cannot read these operands: {_described(tensors)}")


def _described(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{t.dtype} {t.device} {tuple(t.shape)} strides {t.stride()}" for t in tensors)


def experts_ok(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """May the MoE experts' GEMMs (`gate_up [E, 2I, H]`, `down [E, H, I]`) of `rows [R, H]`
    take the kernel? `applies` on one row against expert 0's slices: every expert's slice
    has the same shape, strides and type, so the answer holds for all of them. The caller
    checks each expert's row count (`expert_rows_ok`).

    Why: a CPU MoE block's time is its selected experts' weights streamed once; the kernel
    reads them faster than `mm` at decode sizes (module docstring), and errs less."""
    # float32 only: the experts backends combine expert outputs in their operands' dtype with
    # float32-specific buffers; bf16 experts take their reference
    if gate_up.dim() != 3 or down.dim() != 3 or rows.shape[0] == 0:
        return False
    if not (rows.dtype == gate_up.dtype == down.dtype == torch.float32):
        return False
    inter = rows.new_empty(1, down.shape[-1])
    return applies(rows[:1], gate_up[0], None) and applies(inter, down[0], None)


def expert_rows_ok(count: int, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """The row rules (`rows_ok`) for an expert with `count` rows, against either projection."""
    return rows_ok(count, max(gate_up.shape[-1], down.shape[-1]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the native kernel: a new tensor of the operands' dtype
    and shape `(*x.shape[:-1], N)`. Call where `applies` (or, in tests, where `built()` and
    the operand rules hold); operands outside the kernel's contract raise RuntimeError
    (ValueError where the kernel could not read their memory: `_check_memory`).
    bfloat16: the weight is read in place as bf16; the kernel widens the input rows and bias
    to float32 (a copy of M x K and N values, beside the N x K weight) and rounds the float32
    sums to bf16 once (round to nearest even, as `Tensor.to`).

    Reads `weight` and `bias` as they are now (no copy, no cache)."""
    state = NATIVE.resolve()
    function = _function(state, weight.dtype)
    if function is None:
        raise RuntimeError(f"the native linear is not built here: {state.reason}")
    _check_memory(x, weight, bias)
    return run(function, x, weight, bias, state.prefetch)


def try_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """`linear(x, weight, bias)` where `applies`, else None (the caller keeps its own path).
    The checks of both, made once: `applies`' operand rules include the layout `linear`
    checks (CPU tensors, so not meta), so only `run`'s storage check follows. On a decode step
    this is the whole Python cost of a product besides the kernel, paid after a GEMV has
    emptied the caches: every check made twice was a cold frame more."""
    if not applies(x, weight, bias):
        return None
    state = NATIVE.resolve()
    return run(_function(state, weight.dtype), x, weight, bias, state.prefetch)


def _function(state: Resolved, dtype: torch.dtype) -> object | None:
    """`state`'s entry point for operands of `dtype` (None where the kernel did not build)."""
    return state.bf16_function if dtype == torch.bfloat16 else state.function


def _reaches(t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
    """Does `storage` (`t`'s) hold every element of `t` (a 1-D or 2-D CPU strided tensor,
    non-negative strides), at a real address? A storage resized after the tensor was made
    (freed to save memory, as sharded training does) would otherwise be read past its end."""
    shape, stride = t.shape, t.stride()
    if not shape[0] or (len(shape) == 2 and not shape[1]):
        return True
    last = t.storage_offset() + (shape[0] - 1) * stride[0]
    if len(shape) == 2:
        last += (shape[1] - 1) * stride[1]
    return t.data_ptr() != 0 and (last + 1) * t.element_size() <= storage.nbytes()


def run(
    function: object,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    hint: int = prefetch.L1,
) -> torch.Tensor:
    """The kernel call behind `linear` and `try_linear`, on operands whose layout was
    checked; `hint` is the loops' prefetch (`Resolved.prefetch`: speed only). The storages
    are held for the call, so another thread re-pointing a tensor (`set_`) cannot free
    memory the kernel is reading; each is checked to hold what the kernel reads
    (`_reaches`)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if rows.stride(1) != 1 or (m > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    held = [(t, t.untyped_storage()) for t in (rows, weight, bias) if t is not None]
    if not all(_reaches(t, storage) for t, storage in held):
        raise ValueError(f"native linear cannot read these operands: {_described([x, weight])}")
    out = torch.empty(m, n, dtype=weight.dtype, device="cpu")  # not the default device
    code = function(
        rows.data_ptr(), rows.stride(0) if m > 1 else k, weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
        torch.get_num_threads(), hint,
    )  # fmt: skip
    del held
    if code != 0:
        raise RuntimeError(f"native linear refused its operands (code {code}): {m}x{k} @ {n}x{k}")
    return out.view(*x.shape[:-1], n)

"""oneDNN GEMMs for the MoE experts on CPU (float32), reading the live expert weights.

Why this backend exists: on x86 CPUs PyTorch's float32 `mm`/`linear` calls MKL, which on
some machines (AMD Zen 4 with AVX-512 here) runs a narrower code path; oneDNN's JIT kernels
reach about twice the throughput on the same core. Transformers' expert loop and its
`grouped_mm` both go through `mm`, so the experts' GEMMs, nearly all of a CPU MoE block's
time, are where a fused block can win. Measured numbers are in `tests/bench/test_bench_moe.py`'s docstring.

What it computes: exactly `reference.moe_experts` (the same routed products, rounded to the
input dtype before the K-term sum), with one difference confined to rounding: the GEMMs are
oneDNN's. oneDNN accumulates a whole reduction in registers, which in float32 errs 2-3x more
than MKL's blocked accumulation at H >= 512 (max error against float64); the harness' parity
oracle allows at most 2x. So the reduction is split into blocks of `K_BLOCK` and each block's
product is added to the running sum by the GEMM's own `add` post-op: blocked accumulation like
MKL's, with no extra pass over the output. `tests/fusion/kernels/test_onednn.py`
checks the error stays within 1.5x of `mm`'s against a float64 reference.

No cached copy of any weight (why it is coherent): every call slices the expert weight it is
given into `K_BLOCK`-wide contiguous blocks, a copy made from the tensor's current contents
and dropped after the call. An earlier version kept oneDNN-reordered copies keyed by the
tensor's version counter; writes through `p.data` (EMA updates, weight merging, older
optimisers) do not move that counter, so the copies went stale and outputs were wrong. A
cache that such writes can bypass cannot be made coherent cheaply (checking it means reading
the whole weight), so there is none. The per-call copy costs one pass over the used experts'
weights; oneDNN on a strided (uncopied) column block is a slow reference path, and oneDNN's
own reorder is slower still.

Few rows per expert (decode, short prompts): where our native kernel is on
(`native_gemm`, up to its row limit), each expert's GEMMs run on it instead, reading the
live expert weights the same way (nothing cached); oneDNN's paths below serve the rest.

Where `auto` picks it (`AUTO_CAPABILITIES`): only on CPUs whose ATen kernels run AVX-512.
The speed-up was measured on AVX-512 (Zen 4); on an AVX2-only x86 machine a oneDNN linear ran
no faster than MKL's, so there `auto` keeps the reference. The rule is the CPU's capability,
not a timing, so the same machine and inputs always take the same path (reproducible
rounding). `backend="onednn"` uses it anywhere it runs.

Fail closed, always by falling back to the torch reference (slower, never different):

- Only float32 on CPU takes the oneDNN path. bf16/fp16 CPU GEMMs already run in oneDNN
  through `mm`, and a blocked sum would round the running value to half precision between
  blocks, which `mm` does not.
- When autograd records (the oneDNN ops have no derivative), when
  `torch.backends.mkldnn` is disabled, or when its float32 math mode allows bf16/tf32
  (`mm` itself then follows that mode, and the reference computes what it computes).
- Wherever PyTorch itself would not run its plain dense kernel (`contract.plain_dense`:
  autocast, whose bfloat16 GEMMs the reference then runs as the unfused experts do; a tensor
  subclass or a `__torch_function__` / `__torch_dispatch__` mode, which the reference's ops
  are dispatched through; a functorch transform; a reduced float32 matmul precision).
- Under `torch.compile` (the settings above are Python state Dynamo cannot guard on, and
  the reference's ops are what Inductor optimises).
- The backend is unavailable (`create()` returns None) when the ops are missing or a probe
  product at construction differs from `mm` beyond rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusion.kernels import contract, reference
from fusion.kernels.native import gemm as native_gemm

K_BLOCK = 128
"""Reduction block length: each GEMM sums `K_BLOCK` products in registers, then adds the
block's result to the running sum (MKL-like accuracy; see the module docstring)."""

MIN_ROWS = 64
"""Fewest rows an expert's GEMM needs to go to oneDNN; fewer take `mm`. Every oneDNN GEMM
first copies its weight's `K_BLOCK`-wide blocks (the price of reading the live weight, see
the module docstring), a cost of the weight's size that only enough rows amortise (measured
on Zen 4, float32, one thread: blocked-copy oneDNN loses to `mm` at a few rows and wins from
about this many). A fixed shape rule, not a timing, so the same inputs always take the same path (reproducible rounding).
When every expert of a call is below it, the call runs as one `grouped_mm` per projection
instead."""

AUTO_CAPABILITIES = frozenset({"AVX512"})
"""ATen CPU capabilities (`torch.backends.cpu.get_cpu_capability()`) on which `auto` picks
this backend: where its speed-up was measured (module docstring)."""

_STRICT_FP32 = ("none", "ieee")
"""`torch.backends.mkldnn` float32 precision settings under which oneDNN computes in float32."""


def _ops_available() -> bool:
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._linear_pointwise.default is not None
            and torch.ops.mkldnn._linear_pointwise.binary is not None
            and torch.ops.mkldnn._reorder_linear_weight.default is not None
        )
    except (AttributeError, RuntimeError):
        return False


def cpu_capability() -> str:
    """The vector ISA ATen's CPU kernels dispatch to here (`AVX512`, `AVX2`, `DEFAULT`, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "DEFAULT"


def strict_fp32() -> bool:
    """Whether oneDNN currently computes float32 GEMMs in float32 (no bf16/tf32 math mode)."""
    setting = getattr(torch.backends.mkldnn, "matmul", None)
    precision = getattr(setting, "fp32_precision", "none") if setting is not None else "none"
    overall = getattr(torch.backends.mkldnn, "fp32_precision", "none")
    return precision in _STRICT_FP32 and overall in _STRICT_FP32


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.t()` for 2-D float32 `x` and a `[N, K]` `weight`: a new `[M, N]` tensor.

    The running sum lives in float32 and each `K_BLOCK`-wide block's product is added by the
    GEMM's `add` post-op, so the result is a sum of `K_BLOCK`-long register-accumulated
    partial products: the same function as `mm`, with MKL-like rounding. Each weight block is
    a fresh contiguous copy of the weight's current contents (see the module docstring)."""
    k = weight.shape[1]
    # Column slices of `x` go in as strided views: oneDNN reads them in place, and the
    # result is bit-identical to passing contiguous copies (checked by the tests).
    end = min(K_BLOCK, k)
    out = torch.ops.mkldnn._linear_pointwise(
        x[:, :end], weight[:, :end].contiguous(), None, "none", [], ""
    )
    for a in range(K_BLOCK, k, K_BLOCK):
        b = min(a + K_BLOCK, k)
        out = torch.ops.mkldnn._linear_pointwise.binary(
            x[:, a:b], out, weight[:, a:b].contiguous(), None, "add"
        )
    return out


ROW_CAPABILITIES = frozenset({"AVX512"})
"""ATen CPU capabilities on which `row_linear_applies` may answer True (where oneDNN's
one-row product was measured faster than `F.linear`; see `row_linear`)."""

ROW_MIN_ELEMENTS = 1 << 20
"""Smallest weight (N * K elements) `row_linear_applies` sends to oneDNN: below it the
primitive's fixed cost outweighs its faster read of the weight. Measured one row, one
thread, float32, Zen 4: with weights streamed from memory as in a decode step oneDNN wins at
every shape measured, but with one small weight hot in cache it loses below about this size:
the threshold keeps small, cache-resident weights (tiny test models, narrow projections) on
MKL."""

ROW_MAX_K_ONE_THREAD = 4096
"""Longest reduction the one-row product takes when torch runs one thread. Measured as
above (streamed, one thread): oneDNN loses at longer reductions and wins up to this one.
With two threads oneDNN wins at every shape measured: MKL's one-row product runs on one
thread whatever the setting."""


def _row_width_ok(k: int) -> bool:
    return k <= ROW_MAX_K_ONE_THREAD or torch.get_num_threads() > 1


class RowMachineState:
    """The machine check behind `row_linear_applies` and `row_experts_ok` (this torch has
    oneDNN's ops, the CPU capability is in `ROW_CAPABILITIES`): a property of the process,
    made at first use and kept, or what a test pretends instead. Making it reads a few torch
    attributes (nothing is built or run), so `reset` is cheap enough for every test."""

    def __init__(self) -> None:
        self.ok: bool | None = None
        """The check's answer, or None until it is made. A plain attribute, so
        `row_machine_known_ok` is a read Dynamo traces (set it through the methods)."""

    def check(self) -> bool:
        """The check's answer, made now if it was not yet: never under a trace (compiled
        code reads `ok`, made ahead by `resolve_machine`)."""
        ok = self.ok
        if ok is None:
            ok = self.ok = _ops_available() and cpu_capability() in ROW_CAPABILITIES
        return ok

    def pretend(self, ok: bool) -> None:
        """Answer `ok` (a test's machine) until `reset`, without making the check. The
        operand and settings rules still apply at every call, and `row_linear` still needs
        oneDNN's ops: pretend True only where `_ops_available()`."""
        self.ok = ok

    def reset(self) -> None:
        """Forget the answer (made or pretended): the next use makes the check again."""
        self.ok = None


ROW_MACHINE = RowMachineState()
"""The process's one row-machine check (`ROW_MACHINE.reset()` forgets it)."""


def row_machine_known_ok() -> bool:
    """The machine check behind `row_linear_applies` if it was already made (else False),
    without making it: a plain read Dynamo can trace. `resolve_machine` makes it ahead."""
    return bool(ROW_MACHINE.ok)  # None (not made yet) reads as False


def resolve_machine() -> None:
    """Make the machine check now (outside any trace), so compiled code can read it."""
    ROW_MACHINE.check()


def _one_row_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What both row checks ask of the operands: one float32 row on CPU (`x.numel()` is its
    last dimension), a 2-D weight of `ROW_MIN_ELEMENTS` or more, no gradient recorded."""
    return (
        x.dim() >= 1
        and x.numel() == x.shape[-1] == weight.shape[-1]
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() >= ROW_MIN_ELEMENTS
        and not reference.records_grad(x, weight, *(() if bias is None else (bias,)))
    )


def row_linear_traced(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """While Dynamo traces: should `F.linear(x, weight, bias)` go through the
    `fusion::linear_product` operator, which makes `row_linear_applies`' run-time choice (the
    oneDNN one-row product or `F.linear`) when the compiled code runs? Only what a trace
    may ask: the operands' shape (`_one_row_shape`), on a machine already checked
    (`resolve_machine`), and the dispatcher's contract as far as a trace can ask it
    (`contract.plain_dense`). The settings (`torch.backends.mkldnn`, the matmul precision)
    are read by the operator at each call, so toggling them after compiling is obeyed;
    nothing is cached."""
    return (
        _one_row_shape(x, weight, bias)
        and row_machine_known_ok()
        and contract.plain_dense("cpu", x, weight, bias) is None
    )


def row_linear_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `row_linear` may compute `F.linear(x, weight, bias)`: the operands' shape
    (`_one_row_shape`: one float32 row on CPU, a 2-D weight of `ROW_MIN_ELEMENTS` or more,
    no gradient recorded), where PyTorch itself would run its plain dense kernel
    (`contract.plain_dense`: no autocast, subclass, mode or functorch transform, a strict
    matmul precision), the weight contiguous on CPU, a reduction of
    `ROW_MAX_K_ONE_THREAD` or less when torch runs one thread, not under `torch.compile`
    (the caller traces `fusion::linear_product` then), oneDNN enabled in strict float32 mode,
    and an AVX-512 machine (`ROW_CAPABILITIES`). Anything else: False (the caller keeps
    `F.linear`), so the answer depends on shapes, dtypes, the dispatcher's state and
    settings, never on timings."""
    if torch.compiler.is_compiling():
        return False
    return (
        _one_row_shape(x, weight, bias)
        and contract.plain_dense("cpu", x, weight, bias) is None
        and weight.is_cpu
        and _row_width_ok(weight.shape[-1])
        and weight.is_contiguous()
        and ROW_MACHINE.check()
        and torch.backends.mkldnn.enabled
        and strict_fp32()
    )


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for one row (`row_linear_applies`), by oneDNN on the live
    weight: a new tensor of shape `(*x.shape[:-1], N)`.

    Why: at one row (decode) MKL's float32 product reads the weight slower than oneDNN's on
    AVX-512 (measured on Zen 4, one thread), and oneDNN's one-row kernel splits the reduction
    across vector lanes, so it errs less than MKL against float64 (the tests check it never
    exceeds MKL's error by more than rounding noise). At 2+ rows oneDNN switches to a kernel
    that accumulates the whole reduction in one register (more error than MKL's), so only one
    row comes here.

    Coherent by construction: nothing is cached or packed; each call reads `weight` as it
    is now, so a write by any spelling (`p.data`, numpy, `set_`, an optimiser step,
    `load_state_dict`) is seen by the next call."""
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(1, x.shape[-1]), weight, bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], weight.shape[0])


ROW_MAX_ROWS = 2
"""Most rows of one expert that take one one-row product each (reading the expert's weight
once per row) rather than `mm`. Measured with MoE-sized experts, one thread, weights
streamed: per-row products beat `mm` up to this many rows and lose beyond."""


def _rows_ok(*weights: torch.Tensor) -> bool:
    """May an expert's one-row GEMM take `row_linear`? Contiguous expert weights (each
    expert's `[N, K]` slice is then contiguous) of `ROW_MIN_ELEMENTS // 4` elements or more
    per expert, on a machine `row_linear` is for. The caller (`moe_experts`' oneDNN path)
    has already checked float32 CPU, no gradient and the oneDNN settings.

    Why: at decode every selected expert has a row or two, and a CPU MoE block's time is its
    experts' weights streamed once; oneDNN's one-row product reads them faster than `mm`
    (measured on a Qwen3-MoE-sized experts layer, one thread) and errs less (see
    `row_linear`)."""
    return ROW_MACHINE.check() and all(
        w.is_contiguous()
        and w.shape[-2] * w.shape[-1] >= ROW_MIN_ELEMENTS // 4
        and _row_width_ok(w.shape[-1])
        for w in weights
    )


def _grouped_mm_ok(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Can `F.grouped_mm` take these experts? It exists (torch >= 2.10) and every operand's
    rows are 16-byte aligned, which it requires: expert widths `H` and `I` whose rows are a
    multiple of 16 bytes, and weight storage starting on a 16-byte boundary (the activations
    are fresh allocations). Found by the property test: `I = 130` in float32 raised."""
    if not hasattr(F, "grouped_mm"):
        return False
    size = gate_up.element_size()
    widths = (gate_up.shape[2], down.shape[2])
    return all(w * size % 16 == 0 for w in widths) and all(
        t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(-2) * size % 16 == 0
        for t in (gate_up, down)
    )


class OneDnnKernels(reference.TorchKernels):
    """Backend object: the oneDNN MoE experts; every other op is inherited from the reference."""

    name = "onednn"
    delegated = frozenset({"act_and_mul", "rms_norm", "add_rms_norm"})
    """Ops this backend inherits from the torch reference unchanged."""

    auto_pick: bool = False
    """Whether `auto` may choose this backend on this machine (AVX-512 CPUs only; set by
    `create`, see `AUTO_CAPABILITIES`)."""

    @classmethod
    def create(cls) -> OneDnnKernels | None:
        """The backend, or None when oneDNN is missing or fails the probe (see module doc)."""
        if not _ops_available():
            return None
        # explicit device and dtype: the first request may come under a default-device or
        # default-dtype context (a model built on meta, then fused)
        cpu = {"device": "cpu", "dtype": torch.float32}
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(8, 2 * K_BLOCK + 3, generator=generator, **cpu)
        w = torch.randn(16, 2 * K_BLOCK + 3, generator=generator, **cpu)
        try:
            got = linear(x, w)
        except RuntimeError:
            return None
        want = x.double() @ w.double().t()
        if got.shape != want.shape or not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4):
            return None
        backend = cls()
        backend.auto_pick = cpu_capability() in AUTO_CAPABILITIES
        return backend

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def uses_onednn(self, *tensors: torch.Tensor) -> bool:
        """Whether `moe_experts` on these tensors takes the oneDNN path (else the reference):
        float32 CPU tensors where PyTorch itself would run its plain dense kernel
        (`contract.plain_dense`), oneDNN enabled in strict float32 mode, no gradient.

        Under `torch.compile` it answers False before reading any `torch.backends` setting,
        so Dynamo traces the reference without a graph break."""
        if torch.compiler.is_compiling():
            return False
        return (
            contract.plain_dense("cpu", *tensors) is None
            and all(t.is_cpu and t.dtype == torch.float32 for t in tensors)
            and torch.backends.mkldnn.enabled
            and strict_fp32()
            and not reference.records_grad(*tensors)
        )

    def moe_experts(
        self,
        hidden: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str,
    ) -> torch.Tensor:
        """`reference.moe_experts` with each expert's two GEMMs in oneDNN (float32 CPU).

        Rows are sorted by expert as in the reference; each expert then runs its whole
        chain (gate_up GEMM, act-and-mul, down GEMM) before the next, so its intermediate
        stays in cache, and the weighted rows go back with one `index_add_`."""
        if not self.uses_onednn(hidden, gate_up, down, topk_weights):
            return reference.moe_experts(hidden, gate_up, down, topk_ids, topk_weights, activation)
        num_tokens = hidden.shape[0]
        if num_tokens == 0 or topk_ids.shape[-1] == 0:
            return hidden.new_zeros(hidden.shape)
        routed = reference.sort_by_expert(hidden, topk_ids, gate_up.shape[0])
        # once per call, not per expert: every expert's slice has the same shape and strides
        native = native_gemm.experts_ok(routed.rows, gate_up, down)
        per_row = (_rows_ok(gate_up), _rows_ok(down))
        if native and native_gemm.expert_rows_ok(max(routed.counts), gate_up, down):
            # decode and short prompts: every expert's GEMMs by the native kernel (`_gemm`)
            expert_out = self._chain(routed, gate_up, down, activation, per_row, native)
        elif max(routed.counts) <= ROW_MAX_ROWS and all(per_row):
            # decode: a row or two per expert, oneDNN's one-row product (`_gemm`)
            expert_out = self._chain(routed, gate_up, down, activation, per_row, native)
        elif max(routed.counts) < MIN_ROWS and _grouped_mm_ok(gate_up, down):
            expert_out = self._small(routed, gate_up, down, activation)
        else:
            expert_out = self._chain(routed, gate_up, down, activation, per_row, native)
        return reference.combine(routed, expert_out, topk_weights, num_tokens)

    def _chain(
        self,
        routed: reference.ExpertRows,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        activation: str,
        per_row: tuple[bool, bool],
        native: bool,
    ) -> torch.Tensor:
        """`reference.expert_chain` with this backend's GEMM choice (`_gemm`). `per_row`: may
        the gate_up / down GEMMs take one-row products (`_rows_ok` of each)? `native`: may
        both take the native kernel (`native_gemm.experts_ok`)?"""

        def gemm(x: torch.Tensor, weights: torch.Tensor, expert: int) -> torch.Tensor:
            one_row = per_row[0] if weights is gate_up else per_row[1]
            return self._gemm(x, weights, expert, one_row, native)

        return reference.expert_chain(routed, gate_up, down, activation, gemm)

    @staticmethod
    def _small(
        routed: reference.ExpertRows, gate_up: torch.Tensor, down: torch.Tensor, activation: str
    ) -> torch.Tensor:
        """Every expert too small for oneDNN: one `grouped_mm` per projection (on CPU the
        same per-group `mm` as the reference's loop, without its per-expert Python calls)."""
        offsets = torch.tensor(routed.counts).cumsum(0).to(torch.int32)
        projected = F.grouped_mm(routed.rows, gate_up.transpose(-2, -1), offs=offsets)
        activated = reference.act_and_mul(projected, activation)
        return F.grouped_mm(activated, down.transpose(-2, -1), offs=offsets)

    @staticmethod
    def _gemm(
        x: torch.Tensor, weights: torch.Tensor, expert: int, per_row: bool, native: bool
    ) -> torch.Tensor:
        """`x @ weights[expert].t()`: the native kernel where `native` and its row rules
        hold (`native_gemm.rows_ok`); else oneDNN from `MIN_ROWS` rows up, one one-row product per
        row for up to `ROW_MAX_ROWS` rows where `per_row` (`_rows_ok(weights)`), else `mm`."""
        if native and native_gemm.rows_ok(x.shape[0], x.shape[1]):
            return native_gemm.linear(x, weights[expert], None)
        if x.shape[0] >= MIN_ROWS:
            return linear(x, weights[expert])
        if x.shape[0] <= ROW_MAX_ROWS and per_row:
            rows = [row_linear(x[r : r + 1], weights[expert], None) for r in range(x.shape[0])]
            return torch.cat(rows) if len(rows) > 1 else rows[0]
        return torch.mm(x, weights[expert].t())


def create() -> OneDnnKernels | None:
    return OneDnnKernels.create()

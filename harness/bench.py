"""Fused vs unfused timings: correct timers, benchmark cases and the speedup table.

    fusion-harness bench [--device cpu|cuda] [--dtype D] [--kernel K ...] [--tokens N ...]
                         [--full] [--budget S] [--json FILE]
    python -m harness.bench ...          (the same, without the CLI wiring)

The cases here are shared by `fusion-harness bench` and the pytest-benchmark suite in
`tests/bench` (which adds regression tracking), so both time exactly the same code.

Timing rules (why the numbers can be trusted):

- GPU: CUDA events around each call, after warm-up, with the L2 cache flushed (a 256 MiB
  write) before every round, so a kernel is never timed on data a previous round left in
  cache; the median of the rounds is reported. The host clock is never read around
  asynchronous work.
- CPU: `time.perf_counter` around a batch of calls sized to at least a millisecond, after
  warm-up; the median of the rounds. Large temporaries make CPU timings bimodal unless glibc
  keeps freed memory mapped: set `MALLOC_MMAP_THRESHOLD_=4294967296` and
  `MALLOC_TRIM_THRESHOLD_=4294967296` *before the process starts*. `fusion-harness bench`
  re-executes itself with them when they are missing (`FUSION_BENCH_NO_REEXEC=1` to refuse);
  pytest must be started with them (tox's `bench` env and scripts/gpu_check.sh do).
- Fused and unfused variants of a case run in the same process on the same inputs and the
  same weights, one after the other, and are reported side by side with their ratio.

Memory-bound kernels (RMSNorm, act-and-mul) also report achieved bandwidth on the GPU as a
fraction of the card's copy bandwidth, measured here with a large `Tensor.copy_`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
"""glibc settings that keep large freed blocks mapped, so CPU timings are not bimodal."""

TOKENS = (1, 16, 512, 4096)
"""Token counts of the full grid: decode, small batch, prefill chunk, long prefill."""

REDUCED_TOKENS = (1, 16, 512)
"""Token counts of the default (CI, CPU) grid."""

DENSE_SHAPES = (
    # (name, hidden, intermediate, q, kv): Llama-3.2-1B and Llama-3-8B widths
    ("llama-1b", 2048, 8192, 2048, 512),
    ("llama-8b", 4096, 14336, 4096, 1024),
)
"""Real model widths for the dense kernels (RMSNorm, act-and-mul, QKV, gate_up)."""

MOE_SHAPES = (
    # (name, hidden, expert intermediate, experts, top-k)
    ("olmoe", 2048, 1024, 64, 8),
    ("mixtral", 4096, 14336, 8, 2),
)
"""Real MoE widths: OLMoE-1B-7B (64 experts, top-8) and Mixtral-8x7B (8 experts, top-2)."""

KERNELS = ("rmsnorm_llama", "rmsnorm_gemma", "act_and_mul", "qkv", "gate_up", "moe")
MODELS = ("model_llama", "model_qwen3_moe")

UNFUSED = "unfused"
"""Name of the baseline variant of every case (Hugging Face eager)."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """float32 on CPU, bfloat16 on GPU (what each is used with)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def malloc_env_set(environ: dict[str, str] | None = None) -> bool:
    """Whether the glibc malloc settings of `MALLOC_ENV` are in the environment."""
    environ = os.environ if environ is None else environ
    return all(environ.get(key) == value for key, value in MALLOC_ENV.items())


# --- timers -------------------------------------------------------------------------------------

_FLUSH: dict[str, torch.Tensor] = {}


def flush_cache(device: torch.device | str) -> None:
    """On CUDA, overwrite a 256 MiB buffer (larger than any L2) so the next call starts cold;
    queued on the current stream, no synchronisation. On CPU: nothing."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    key = str(device)
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)
    _FLUSH[key].zero_()


def time_cuda(
    fn: Callable[[], Any],
    *,
    budget_s: float = 0.5,
    warmup_s: float = 0.05,
    min_rounds: int = 10,
    max_rounds: int = 500,
    device: torch.device | str = "cuda",
) -> list[float]:
    """Seconds per call of `fn` on the GPU, one value per round (as `triton.testing.do_bench`).

    Each round: flush the L2, record a start event, call `fn`, record an end event; every
    round is queued before one final synchronisation, so the host's own speed only shows
    where the GPU really waits for it (launch-bound eager code). Warm-up first (compilation,
    allocator, clocks).
    """
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    while True:  # warm-up, also an estimate of the time per call
        fn()
        torch.cuda.synchronize(device)
        if time.perf_counter() - start >= warmup_s:
            break
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    per_call = max(begin.elapsed_time(end) / 5e3, 1e-7)
    rounds = int(min(max_rounds, max(min_rounds, budget_s / per_call)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    for i in range(rounds):
        flush_cache(device)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def time_cpu(
    fn: Callable[[], Any],
    *,
    budget_s: float = 0.5,
    warmup_calls: int = 2,
    min_rounds: int = 5,
    max_rounds: int = 1000,
) -> list[float]:
    """Seconds per call of `fn` on the CPU, one value per round of `n` calls (n sized so a
    round lasts at least a millisecond), after `warmup_calls` calls."""
    for _ in range(warmup_calls):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, math.ceil(1e-3 / one))
    rounds = int(min(max_rounds, max(min_rounds, budget_s / (one * calls))))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return times


def measure(fn: Callable[[], Any], device: torch.device | str, budget_s: float) -> list[float]:
    """Per-round seconds per call of `fn`: `time_cuda` on a GPU, else `time_cpu`."""
    device = torch.device(device)
    if device.type == "cuda":
        return time_cuda(fn, budget_s=budget_s, device=device)
    return time_cpu(fn, budget_s=budget_s)


class CudaEventClock:
    """A pytest-benchmark timer that reads the GPU's clock instead of the host's.

    pytest-benchmark's pedantic runner calls its timer exactly twice per round, before and
    after the target. The first call records a start event and returns 0.0; the second
    records an end event, waits for it and returns the GPU time between the two, in seconds.
    So a round's duration is the device time of the target, and (with the cache flush queued
    by `setup`, not waited for) the host never sits idle-timed between flush and target.
    """

    def __init__(self) -> None:
        self._start: torch.cuda.Event | None = None

    def __call__(self) -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._start is None:
            self._start = event
            return 0.0
        start, self._start = self._start, None
        event.synchronize()
        return start.elapsed_time(event) / 1e3


def copy_bandwidth(device: torch.device | str, nbytes: int = 1 << 30) -> float:
    """Bytes per second a large `Tensor.copy_` moves on `device` (read + write), the ceiling
    the memory-bound kernels are compared with; median of timed rounds."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = measure(lambda: dst.copy_(src), device, budget_s=0.3)
    return 2 * nbytes / statistics.median(times)


# --- cases --------------------------------------------------------------------------------------


@dataclass
class Case:
    """One benchmark: a kernel (or model slice) at one shape and dtype, with its variants.

    `make()` allocates the inputs and weights once and returns {variant: zero-argument
    callable}; every variant computes the same function on the same tensors. `variants`
    names them in order, `UNFUSED` first; a variant that cannot run here maps to the reason
    in `unavailable` instead. `bytes_moved`: the minimal memory traffic of one call for
    memory-bound kernels (for achieved bandwidth), else None.
    """

    kernel: str
    shape: str
    dtype: torch.dtype
    device: str
    tokens: int
    make: Callable[[], dict[str, Callable[[], Any]]] = field(repr=False)
    variants: tuple[str, ...] = ()
    bytes_moved: int | None = None
    unavailable: dict[str, str] = field(default_factory=dict)

    def build(self) -> dict[str, Callable[[], Any]]:
        """`make()`, each variant wrapped to run under `torch.no_grad()` (inference timings:
        no autograd graph is recorded for any variant)."""
        return {name: _no_grad(fn) for name, fn in self.make().items()}

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def id(self) -> str:
        return f"{self.kernel}-{self.shape}-T{self.tokens}-{self.dtype_name}"

    @property
    def group(self) -> str:
        """pytest-benchmark group: all variants of one case side by side."""
        return f"{self.kernel} {self.shape} T={self.tokens} {self.dtype_name} {self.device}"


def _no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    if isinstance(fn, _Unavailable):
        return fn

    def run() -> Any:
        with torch.no_grad():
            return fn()

    return run


def fused_backends(device: str, op: str | None = None) -> list[str]:
    """Kernel backends fused variants are timed with on `device`: every available one that
    is not an interpreter, leaving out those that hand `op` to the torch reference (their
    `delegated` ops), which would only time the reference twice."""
    from fusion import kernels

    names = []
    for name in kernels.available_backends(device):
        backend = kernels.get(name, device)
        if getattr(backend, "interpreted", False) or op in getattr(backend, "delegated", ()):
            continue
        names.append(name)
    return names


def _randn(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _rmsnorm_case(
    variant: str, hidden: int, tokens: int, dtype: torch.dtype, device: str, name: str
) -> Case:
    """RMSNorm of `tokens` rows: HF's eager module vs the backends' kernel."""
    backends = fused_backends(device, "rms_norm")
    kwargs = (
        dict(offset=0.0, upcast=True, weight_after_cast=True)
        if variant == "llama"
        else dict(offset=1.0, upcast=True, weight_after_cast=False)
    )

    def make() -> dict[str, Callable[[], Any]]:
        from fusion import kernels

        if variant == "llama":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm
        else:
            from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as Norm
        norm = Norm(hidden, eps=1e-6).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(_randn(hidden, dtype=dtype, device=device, scale=0.1) + 1)
        x = _randn(tokens, hidden, dtype=dtype, device=device)
        fns: dict[str, Callable[[], Any]] = {UNFUSED: lambda: norm(x)}
        for backend in backends:
            k = kernels.get(backend, device)
            fns[f"fused[{backend}]"] = lambda k=k: k.rms_norm(
                x, norm.weight, norm_eps(norm), **kwargs
            )
        return fns

    size = torch.tensor([], dtype=dtype).element_size()
    return Case(
        kernel=f"rmsnorm_{variant}",
        shape=f"{name}:H{hidden}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, *(f"fused[{b}]" for b in backends)),
        bytes_moved=(2 * tokens * hidden + hidden) * size,
    )


def norm_eps(norm: torch.nn.Module) -> float:
    """The epsilon of a Transformers RMSNorm (`variance_epsilon` or `eps`)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _act_case(intermediate: int, tokens: int, dtype: torch.dtype, device: str, name: str) -> Case:
    """SiLU-and-mul: HF eager `silu(gate) * up` on the two projections' separate outputs vs
    the backends' kernel on the merged projection's output."""
    backends = fused_backends(device, "act_and_mul")

    def make() -> dict[str, Callable[[], Any]]:
        import torch.nn.functional as F

        from fusion import kernels

        gate_up = _randn(tokens, 2 * intermediate, dtype=dtype, device=device)
        gate = gate_up[:, :intermediate].contiguous()
        up = gate_up[:, intermediate:].contiguous()
        fns: dict[str, Callable[[], Any]] = {UNFUSED: lambda: F.silu(gate) * up}
        for backend in backends:
            k = kernels.get(backend, device)
            fns[f"fused[{backend}]"] = lambda k=k: k.act_and_mul(gate_up, "silu")
        return fns

    size = torch.tensor([], dtype=dtype).element_size()
    return Case(
        kernel="act_and_mul",
        shape=f"{name}:I{intermediate}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, *(f"fused[{b}]" for b in backends)),
        bytes_moved=3 * tokens * intermediate * size,
    )


def _merged_gemm_case(
    kernel: str, hidden: int, sizes: Sequence[int], tokens: int, dtype, device, name
) -> Case:
    """Separate projections (one GEMM each, as HF eager) vs one `MergedLinear` GEMM + split."""

    def make() -> dict[str, Callable[[], Any]]:
        import torch.nn.functional as F

        weights = [_randn(n, hidden, dtype=dtype, device=device, scale=0.02) for n in sizes]
        stacked = torch.cat(weights, dim=0)
        x = _randn(tokens, hidden, dtype=dtype, device=device)
        return {
            UNFUSED: lambda: [F.linear(x, w) for w in weights],
            "fused": lambda: F.linear(x, stacked).split(list(sizes), dim=-1),
        }

    return Case(
        kernel=kernel,
        shape=f"{name}:{hidden}->{'+'.join(str(s) for s in sizes)}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, "fused"),
    )


def _with_experts_implementation(block: torch.nn.Module, config: Any, impl: str) -> torch.nn.Module:
    """A shallow copy of a sparse MoE `block` whose experts dispatch to Transformers' `impl`
    ("eager" or "grouped_mm"); it shares every parameter with `block` (no weight copy) and
    leaves `block` unchanged (the copy gets its own child table and its own config)."""
    variant = copy.copy(block)
    variant._modules = dict(block._modules)
    experts = copy.copy(block.experts)
    experts.config = copy.copy(config)
    experts.config._experts_implementation = impl
    variant.experts = experts
    return variant


def _moe_case(
    hidden: int, inter: int, experts: int, top_k: int, tokens: int, dtype, device, name
) -> Case:
    """Routed experts at real widths on one routing (computed once by a Qwen3-MoE router,
    outside the timing): Transformers' eager expert loop (the baseline), Transformers'
    `grouped_mm` experts, and each backend's `moe_experts` on the same weights."""
    backends = fused_backends(device)

    def make() -> dict[str, Callable[[], Any]]:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        from fusion import kernels

        config = Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
        )
        with torch.device(device):
            block = Qwen3MoeSparseMoeBlock(config).to(dtype)
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0.0, 0.02)
            x = _randn(tokens, hidden, dtype=dtype, device=device)
            _, weights, ids = block.gate(x)
        fns: dict[str, Callable[[], Any]] = {}
        for impl, variant in (("eager", UNFUSED), ("grouped_mm", "hf[grouped_mm]")):
            experts_module = _with_experts_implementation(block, config, impl).experts
            fns[variant] = lambda m=experts_module: m(x, ids, weights)
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        for backend in backends:
            k = kernels.get(backend, device)
            fns[f"fused[{backend}]"] = lambda k=k: k.moe_experts(
                x, gate_up, down, ids, weights, "silu"
            )
        return fns

    return Case(
        kernel="moe",
        shape=f"{name}:H{hidden}-I{inter}-E{experts}-top{top_k}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, "hf[grouped_mm]", *(f"fused[{b}]" for b in backends)),
    )


class _Unavailable:
    """Stands in for a variant that cannot run here; calling it raises with the reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self) -> Any:
        raise VariantUnavailable(self.reason)


class VariantUnavailable(RuntimeError):
    """A case's variant cannot run on this machine (the message says why)."""


def kernel_cases(
    device: str,
    dtype: torch.dtype,
    *,
    full: bool = False,
    kernels: Sequence[str] = KERNELS,
    tokens: Sequence[int] | None = None,
) -> list[Case]:
    """Per-kernel cases. Full grid: both dense widths and both MoE shapes at every token
    count. Reduced grid (default; CPU-friendly): the Llama-1B width, `REDUCED_TOKENS` (gate_up
    only 1 and 16: larger is a long CPU GEMM), and the OLMoE shape at 16 tokens."""
    token_grid = tuple(tokens) if tokens else (TOKENS if full else REDUCED_TOKENS)
    dense = DENSE_SHAPES if full else DENSE_SHAPES[:1]
    moe = MOE_SHAPES if full else MOE_SHAPES[:1]
    cases: list[Case] = []
    for name, hidden, inter, q, kv in dense:
        for t in token_grid:
            if "rmsnorm_llama" in kernels:
                cases.append(_rmsnorm_case("llama", hidden, t, dtype, device, name))
            if "rmsnorm_gemma" in kernels:
                cases.append(_rmsnorm_case("gemma", hidden, t, dtype, device, name))
            if "act_and_mul" in kernels:
                cases.append(_act_case(inter, t, dtype, device, name))
            if "qkv" in kernels:
                cases.append(_merged_gemm_case("qkv", hidden, (q, kv, kv), t, dtype, device, name))
            if "gate_up" in kernels and (full or tokens or t <= 16):
                cases.append(
                    _merged_gemm_case("gate_up", hidden, (inter, inter), t, dtype, device, name)
                )
    if "moe" in kernels:
        for name, hidden, inter, experts, top_k in moe:
            for t in token_grid if (full or tokens) else (16,):
                cases.append(_moe_case(hidden, inter, experts, top_k, t, dtype, device, name))
    return cases


def _model_case(
    arch: str, config_kwargs: dict, tokens: int, dtype: torch.dtype, device: str, name: str
) -> Case:
    """A 2-layer slice of a real model (real widths, random weights, small vocabulary since
    only the decoder stack is timed): the unfused decoder forward vs the fused one."""

    def make() -> dict[str, Callable[[], Any]]:
        from transformers import AutoConfig, AutoModelForCausalLM

        import fusion

        config = AutoConfig.for_model(arch, **config_kwargs)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        fused = copy.deepcopy(model)
        report = fusion.fuse(fused)
        ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)

        def forward(m: torch.nn.Module) -> Callable[[], Any]:
            def run() -> Any:
                with torch.no_grad():
                    return m.model(input_ids=ids, use_cache=False).last_hidden_state

            return run

        fns: dict[str, Callable[[], Any]] = {UNFUSED: forward(model)}
        fns["fused"] = (
            forward(fused)
            if report.applied
            else _Unavailable(f"fusion.fuse applied nothing: {report.skipped}")
        )
        return fns

    return Case(
        kernel=f"model_{arch}",
        shape=name,
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(UNFUSED, "fused"),
    )


def model_cases(
    device: str,
    dtype: torch.dtype,
    *,
    full: bool = False,
    models: Sequence[str] = MODELS,
    tokens: Sequence[int] | None = None,
) -> list[Case]:
    """Per-model cases: a Llama-shaped and a Qwen3-MoE-shaped 2-layer slice. Full grid: both
    Llama widths, Qwen3-30B-A3B's 128 experts, every token count; reduced (default): Llama-1B
    widths, 64 experts (half Qwen3-30B-A3B's, to fit a CPU's memory), 16 tokens."""
    token_grid = tuple(tokens) if tokens else (TOKENS if full else (16,))
    common = dict(num_hidden_layers=2, vocab_size=1024, max_position_embeddings=8192)
    cases = []
    if "model_llama" in models:
        for name, hidden, inter, q, kv in DENSE_SHAPES if full else DENSE_SHAPES[:1]:
            kwargs = dict(
                common,
                hidden_size=hidden,
                intermediate_size=inter,
                num_attention_heads=32,
                num_key_value_heads=32 * kv // q,
                head_dim=q // 32,
            )
            for t in token_grid:
                cases.append(_model_case("llama", kwargs, t, dtype, device, f"{name}-2L"))
    if "model_qwen3_moe" in models:
        experts = 128 if full else 64
        kwargs = dict(
            common,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=experts,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        for t in token_grid:
            cases.append(
                _model_case("qwen3_moe", kwargs, t, dtype, device, f"30b-a3b-E{experts}-2L")
            )
    return cases


# --- running and reporting ----------------------------------------------------------------------


@dataclass
class Row:
    """The timings of one (case, variant) against the case's unfused baseline."""

    kernel: str
    variant: str
    shape: str
    tokens: int
    dtype: str
    device: str
    unfused_ms: float | None
    fused_ms: float | None
    speedup: float | None
    bandwidth_gbs: float | None = None
    copy_fraction: float | None = None
    note: str = ""


def rows_from_medians(
    case: Case, medians: dict[str, float], copy_bw: float | None, notes: dict[str, str]
) -> list[Row]:
    """Table rows of `case`: each non-baseline variant against the unfused median (seconds).
    Bandwidth (GB/s and fraction of `copy_bw`) for memory-bound kernels when `copy_bw` is given."""
    base = medians.get(UNFUSED)
    rows = []
    for variant in case.variants[1:]:
        t = medians.get(variant)
        bw = case.bytes_moved / t if (t and case.bytes_moved) else None
        rows.append(
            Row(
                kernel=case.kernel,
                variant=variant,
                shape=case.shape,
                tokens=case.tokens,
                dtype=case.dtype_name,
                device=case.device,
                unfused_ms=base * 1e3 if base else None,
                fused_ms=t * 1e3 if t else None,
                speedup=base / t if (base and t) else None,
                bandwidth_gbs=bw / 1e9 if bw else None,
                copy_fraction=bw / copy_bw if (bw and copy_bw) else None,
                note=notes.get(variant, notes.get(UNFUSED, "")),
            )
        )
    return rows


def run_case(case: Case, budget_s: float, copy_bw: float | None = None) -> list[Row]:
    """Time every variant of `case` (same tensors, one after the other) and return its rows.
    A variant that cannot run here is reported with its reason instead of a time."""
    medians: dict[str, float] = {}
    notes: dict[str, str] = {}
    try:
        fns = case.build()
    except Exception as exc:  # a case that cannot be built is reported, not fatal
        return rows_from_medians(case, {}, None, {UNFUSED: f"cannot build: {exc}"})
    for variant in case.variants:
        fn = fns.get(variant)
        if fn is None or isinstance(fn, _Unavailable):
            notes[variant] = fn.reason if isinstance(fn, _Unavailable) else "not available"
            continue
        medians[variant] = statistics.median(measure(fn, case.device, budget_s))
    del fns
    return rows_from_medians(case, medians, copy_bw, notes)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[Row], *, bandwidth: bool = False) -> str:
    """The speedup table: kernel, variant, shape, tokens, dtype, unfused ms, fused ms, speedup
    (and achieved GB/s with the fraction of copy bandwidth when `bandwidth`)."""
    header = ["kernel", "variant", "shape", "tokens", "dtype", "unfused ms", "fused ms", "speedup"]
    if bandwidth:
        header += ["GB/s", "% copy BW"]
    table = [header]
    notes = []
    for r in rows:
        line = [
            r.kernel,
            r.variant,
            r.shape,
            str(r.tokens),
            r.dtype,
            _fmt(r.unfused_ms, ".4f"),
            _fmt(r.fused_ms, ".4f"),
            _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
        ]
        if bandwidth:
            line += [
                _fmt(r.bandwidth_gbs, ".0f"),
                _fmt(r.copy_fraction and 100 * r.copy_fraction, ".0f"),
            ]
        table.append(line)
        if r.note:
            notes.append(f"{r.kernel} {r.variant} {r.shape} T={r.tokens}: {r.note}")
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    numeric = set(range(3, len(header))) - {4}
    lines = []
    for n, row in enumerate(table):
        cells = [
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines + (["", *notes] if notes else []))


def machine_info(device: str) -> dict[str, Any]:
    """Versions and hardware the numbers were measured on."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "malloc_env": malloc_env_set(),
        "threads": torch.get_num_threads(),
    }
    for module in ("transformers", "triton", "vllm"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # optional packages may be missing or fail to import
            info[module] = None
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


# --- command line -------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to a `fusion-harness` subparsers object; its handler is
    stored as `handler` (called with the parsed namespace, returns the exit status)."""
    parser = subparsers.add_parser(
        "bench",
        help="fused vs unfused timings",
        description="Time fused vs unfused kernels and model slices at real model widths and "
        "print a speedup table (on GPU also achieved bandwidth against the card's copy "
        "bandwidth). Default: the reduced grid; --full for every width and token count.",
    )
    _add_arguments(parser)
    parser.set_defaults(handler=run_from_args)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="default float32 on cpu, bfloat16 on cuda",
    )
    parser.add_argument(
        "--kernel",
        action="append",
        choices=[*KERNELS, *MODELS],
        metavar="K",
        help=f"what to time (repeatable; default all): {', '.join((*KERNELS, *MODELS))}",
    )
    parser.add_argument(
        "--tokens", action="append", type=int, metavar="N", help="token counts (repeatable)"
    )
    parser.add_argument("--full", action="store_true", help="the full grid (long on CPU)")
    parser.add_argument(
        "--budget", type=float, default=0.3, metavar="S", help="seconds per variant (default 0.3)"
    )
    parser.add_argument("--json", type=str, default=None, metavar="FILE", help="write rows here")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: torch's; 1 gives steadier numbers on a busy machine)",
    )


def _reexec_with_malloc_env(argv: Sequence[str]) -> None:
    """Restart this command with `MALLOC_ENV` set (glibc reads it only at process start)."""
    env = {**os.environ, **MALLOC_ENV, "FUSION_BENCH_NO_REEXEC": "1"}
    print(
        "bench: restarting with " + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()),
        file=sys.stderr,
    )
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "harness.bench", *argv], env)


def run_from_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the selected cases and print the table; exit status 0, or 2 for bad options.

    `argv`: the command's own arguments when it was started from the command line; then, on
    CPU without `MALLOC_ENV`, the process restarts itself with it (see the module doc).
    Called as the CLI handler (one argument), it restarts only when the process is
    `fusion-harness bench ...` / `python -m harness bench ...` itself.
    """
    device = args.device or default_device()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print("bench: error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if argv is None and sys.argv[1:2] == ["bench"]:
        argv = sys.argv[2:]
    if (
        argv is not None
        and torch.device(device).type == "cpu"
        and not malloc_env_set()
        and os.environ.get("FUSION_BENCH_NO_REEXEC") != "1"
    ):
        _reexec_with_malloc_env(argv)
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    selected = args.kernel or [*KERNELS, *MODELS]
    cases = kernel_cases(
        device,
        dtype,
        full=args.full,
        kernels=[k for k in selected if k in KERNELS],
        tokens=args.tokens,
    ) + model_cases(
        device,
        dtype,
        full=args.full,
        models=[k for k in selected if k in MODELS],
        tokens=args.tokens,
    )
    gpu = torch.device(device).type == "cuda"
    copy_bw = copy_bandwidth(device) if gpu else None
    info = machine_info(device)
    print(
        f"bench: {len(cases)} cases on {info.get('gpu', 'cpu')} ({device}, {args.dtype or dtype}); "
        f"torch {info['torch']}, transformers {info['transformers']}, triton {info['triton']}"
        + (f"; copy bandwidth {copy_bw / 1e9:.0f} GB/s" if copy_bw else ""),
        file=sys.stderr,
    )
    rows: list[Row] = []
    for i, case in enumerate(cases, 1):
        print(f"bench: [{i}/{len(cases)}] {case.id}", file=sys.stderr)
        rows.extend(run_case(case, args.budget, copy_bw))
        if gpu:
            torch.cuda.empty_cache()
    print(format_table(rows, bandwidth=gpu))
    if args.json:
        document = {
            "machine": info,
            "copy_bandwidth_gbs": copy_bw / 1e9 if copy_bw else None,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`fusion-harness bench` as a standalone command (`python -m harness.bench`)."""
    parser = argparse.ArgumentParser(
        prog="fusion-harness bench", description=__doc__.split("\n")[0]
    )
    _add_arguments(parser)
    if argv is None:  # started as a command: may restart itself with MALLOC_ENV
        argv = sys.argv[1:]
        return run_from_args(parser.parse_args(argv), argv)
    return run_from_args(parser.parse_args(list(argv)), None)


if __name__ == "__main__":
    sys.exit(main())

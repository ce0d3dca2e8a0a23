"""pytest-benchmark suite: fused vs unfused, per kernel and per model slice.

Run it (the glibc settings must be in the environment before Python starts; they keep CPU
timings from turning bimodal on page faults of large temporaries):

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        python -m pytest tests/bench -p no:xdist --benchmark-only

or `tox -e bench`. Selection and options:

- Default: the reduced grid (Llama-1B widths, 1/16/512 tokens, OLMoE-shaped MoE at 16 tokens,
  2-layer slices at 16 tokens): a couple of minutes on a 2-core CPU. `--bench-full` or
  `FUSION_BENCH_FULL=1`: every width and token count (for GPUs).
- Smoke runs: where pytest-benchmark does not time (under pytest-xdist, as CI's
  `python -m pytest -n auto -m slow` runs this directory, or with `--benchmark-disable`), each
  file runs one case of its grid, every variant once: its first case at its fewest tokens
  (e.g. the Llama-3.2-1B end-to-end model at 1 token, compiled variants included). That
  proves the benchmark code runs; timing real widths untimed would prove nothing more. The
  whole grid runs wherever benchmarks are timed (`tox -e bench`, `-p no:xdist`), or untimed
  with `FUSION_BENCH_SMOKE=0` (`FUSION_BENCH_SMOKE=1` forces a smoke run even when timed).
- `--bench-device cpu|cuda` / `FUSION_BENCH_DEVICE` (default cuda if present), `--bench-dtype`
  / `FUSION_BENCH_DTYPE` (default float32 on CPU, bfloat16 on GPU), `FUSION_BENCH_BUDGET`
  (seconds per benchmark, default 0.5). The environment variables work whichever directory
  pytest is started from; the options only when tests/bench is on the command line.
- `FUSION_BENCH_JSON=FILE`: also write the speedup rows (with ratios) as JSON.
- `FUSION_BENCH_KERNELS=a,b` and `FUSION_BENCH_TOKENS=1,16`: keep only those kernels (case
  `kernel` names, e.g. rmsnorm_llama, moe, model_llama) and token counts of the grid.
- `FUSION_BENCH_THREADS=N`: torch CPU threads. On a shared machine 1 is far steadier: with
  more threads than idle cores, OpenMP barriers turn a 1 ms op into 10-100 ms.

Regression tracking (pytest-benchmark's saved runs):

    pytest tests/bench --benchmark-autosave                    # save under .benchmarks/
    pytest tests/bench --benchmark-compare --benchmark-compare-fail=median:10%

Each case's variants share one benchmark group, so fused and unfused print side by side, and
the terminal summary ends with a speedup table (medians, unfused / fused). On a GPU every
round is timed with CUDA events after warm-up with the L2 flushed before it (see
`harness.speed.bench`); the GPU name is in the saved machine_info. Under pytest-xdist (the default
CI run) pytest-benchmark disables timing and each benchmark runs once, as a smoke test.

Other suites in this directory can use the same machinery: define `BENCH_CASES(device, dtype,
*, full) -> list[harness.speed.bench.Case]` in the module and take the `bench_case`,
`bench_variant`, `bench_run` and `benchmark` fixtures.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import pytest
import torch

# Triton decides compiled vs interpreted when it is first imported, and this conftest's
# parametrization (which asks the kernel registry) runs before tests/fusion/kernels is
# collected: on a machine without a GPU, select the interpreter now, so the kernel parity
# tests can run Triton on CPU. The benchmarks never time an interpreted backend.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from harness.speed import bench

SMOKE_ENV = "FUSION_BENCH_SMOKE"
"""`0`: the whole grid even where benchmarks are not timed; `1`: a smoke run even where they
are; unset or `auto`: a smoke run exactly where they are not timed."""


@dataclass(frozen=True)
class BenchConfig:
    """The session's benchmark settings (see the module doc)."""

    device: str
    dtype: torch.dtype
    full: bool
    budget_s: float


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fusion-bench", "fusion-harness benchmarks")
    group.addoption("--bench-full", action="store_true", default=None, help="the full grid")
    group.addoption("--bench-device", default=None, help="cpu or cuda (default: cuda if present)")
    group.addoption(
        "--bench-dtype", default=None, choices=sorted(bench.DTYPES), help="benchmark dtype"
    )


def _option(config: pytest.Config, name: str, env: str) -> Any:
    try:
        value = config.getoption(name)
    except ValueError:  # tests/bench was not on the command line: options not registered
        value = None
    return value if value is not None else os.environ.get(env)


def bench_config(config: pytest.Config) -> BenchConfig:
    """Settings from the options, then the environment, then the defaults."""
    device = _option(config, "--bench-device", "FUSION_BENCH_DEVICE") or bench.default_device()
    dtype_name = _option(config, "--bench-dtype", "FUSION_BENCH_DTYPE")
    dtype = bench.DTYPES[dtype_name] if dtype_name else bench.default_dtype(device)
    full = _option(config, "--bench-full", "FUSION_BENCH_FULL") not in (None, False, "", "0")
    budget = float(os.environ.get("FUSION_BENCH_BUDGET", "0.5"))
    return BenchConfig(device=device, dtype=dtype, full=full, budget_s=budget)


def pytest_configure(config: pytest.Config) -> None:
    threads = os.environ.get("FUSION_BENCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def smoke_run(config: pytest.Config) -> bool:
    """Whether this session is a smoke run (see the module doc): `FUSION_BENCH_SMOKE=0` or
    `=1` decides; unset (or `auto`), a run is a smoke run exactly when pytest-benchmark does
    not time (its session is disabled: xdist, `--benchmark-disable`)."""
    given = os.environ.get(SMOKE_ENV, "").strip().lower()
    if given not in ("", "auto"):
        return given != "0"
    session = getattr(config, "_benchmarksession", None)
    return bool(getattr(session, "disabled", False))


def smoke_cases(cases: list[bench.Case]) -> list[bench.Case]:
    """A smoke run's selection from one file's cases: the first case at the fewest tokens."""
    if not cases:
        return cases
    fewest = min(case.tokens for case in cases)
    return [next(case for case in cases if case.tokens == fewest)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize `bench_case`/`bench_variant` with the module's `BENCH_CASES`: one test per
    (case, variant), variants of a case adjacent (they share the case's tensors). In a smoke
    run, one case (`smoke_cases`) of what the FUSION_BENCH_* filters leave."""
    if "bench_case" not in metafunc.fixturenames:
        return
    settings = bench_config(metafunc.config)
    make_cases = metafunc.module.BENCH_CASES
    cases = make_cases(settings.device, settings.dtype, full=settings.full)
    kernels = os.environ.get("FUSION_BENCH_KERNELS")
    if kernels:
        cases = [c for c in cases if c.kernel in kernels.split(",")]
    tokens = os.environ.get("FUSION_BENCH_TOKENS")
    if tokens:
        cases = [c for c in cases if str(c.tokens) in tokens.split(",")]
    if smoke_run(metafunc.config):
        cases = smoke_cases(cases)
    marks = [pytest.mark.gpu] if torch.device(settings.device).type == "cuda" else []
    if marks and not torch.cuda.is_available():
        marks.append(pytest.mark.skip(reason="--bench-device cuda but no CUDA device is available"))
    params = [
        pytest.param(case, variant, id=f"{case.id}-{variant}", marks=marks)
        for case in cases
        for variant in case.variants
    ]
    metafunc.parametrize(("bench_case", "bench_variant"), params)


@dataclass
class _Built:
    case_id: str | None = None
    fns: dict[str, Callable[[], Any]] | None = None
    error: str | None = None


_BUILT = _Built()
"""The most recently built case (one at a time, so memory stays bounded)."""

_MEDIANS: dict[str, tuple[bench.Case, dict[str, float], dict[str, str]]] = {}
"""case id -> (case, variant -> median seconds, variant -> note), filled as benchmarks run."""

_IQRS: dict[str, dict[str, float]] = {}
"""case id -> variant -> interquartile range of the rounds (seconds), for the summary table."""

_COPY_BW: dict[str, float] = {}


def _variants_of(case: bench.Case) -> dict[str, Callable[[], Any]]:
    if _BUILT.case_id != case.id:
        _BUILT.fns = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        _BUILT.case_id, _BUILT.error = case.id, None
        try:
            _BUILT.fns = case.build()
        except Exception as exc:
            _BUILT.error = f"{type(exc).__name__}: {exc}"
    if _BUILT.error is not None:
        pytest.fail(f"cannot build {case.id}: {_BUILT.error}")
    return _BUILT.fns or {}


def _run_cpu(benchmark: Any, fn: Callable[[], Any], budget_s: float) -> None:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    iterations = max(1, math.ceil(1e-3 / one))
    rounds = int(min(1000, max(5, budget_s / (one * iterations))))
    benchmark.pedantic(fn, iterations=iterations, rounds=rounds, warmup_rounds=1)


def _run_cuda(benchmark: Any, fn: Callable[[], Any], device: str, budget_s: float) -> None:
    """Rounds timed by CUDA events (`bench.CudaEventClock`), each after an L2 flush queued
    by `setup`, after warm-up. Falls back to a synchronising target if this pytest-benchmark
    has no per-fixture timer to replace."""
    times = bench.time_cuda(fn, budget_s=min(0.05, budget_s), device=device)  # warm-up + estimate
    per_call = max(sorted(times)[len(times) // 2], 1e-7)
    rounds = int(min(1000, max(20, budget_s / per_call)))

    def flush() -> None:
        bench.flush_cache(device)

    if hasattr(benchmark, "_timer"):
        benchmark._timer = bench.CudaEventClock()
        benchmark.pedantic(fn, setup=flush, rounds=rounds, warmup_rounds=3)
    else:  # pragma: no cover - other pytest-benchmark versions

        def synchronised() -> Any:
            result = fn()
            torch.cuda.synchronize(device)
            return result

        benchmark.pedantic(synchronised, setup=flush, rounds=rounds, warmup_rounds=3)


@pytest.fixture
def bench_run(request: pytest.FixtureRequest) -> Callable[[Any, bench.Case, str], None]:
    """`bench_run(benchmark, case, variant)`: time one variant of a case in `case.group`,
    record its median for the speedup table; skip (with the reason) a variant that cannot
    run here."""
    settings = bench_config(request.config)

    def run(benchmark: Any, case: bench.Case, variant: str) -> None:
        fns = _variants_of(case)
        fn = fns.get(variant)
        if fn is None:
            pytest.skip(f"{variant} is not available for {case.id}")
        benchmark.group = case.group
        benchmark.extra_info.update(
            kernel=case.kernel,
            variant=variant,
            shape=case.shape,
            tokens=case.tokens,
            dtype=case.dtype_name,
            device=case.device,
            bytes_moved=case.bytes_moved,
        )
        entry = _MEDIANS.setdefault(case.id, (case, {}, {}))
        try:
            if getattr(benchmark, "disabled", False):  # xdist / --benchmark-disable: run once
                benchmark.pedantic(fn, rounds=1)
            elif torch.device(case.device).type == "cuda":
                _run_cuda(benchmark, fn, case.device, settings.budget_s)
            else:
                _run_cpu(benchmark, fn, settings.budget_s)
        except bench.VariantUnavailable as exc:
            entry[2][variant] = str(exc)
            pytest.skip(str(exc))
        stats = getattr(benchmark, "stats", None)
        if stats is not None and getattr(stats, "stats", None) is not None:
            entry[1][variant] = stats.stats.median
            _IQRS.setdefault(case.id, {})[variant] = stats.stats.iqr

    return run


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """Versions, GPU name and capability, and whether the malloc settings were in effect,
    saved with every run (so `--benchmark-compare` shows what changed)."""
    settings = bench_config(config)
    machine_info.update(bench.machine_info(settings.device))
    machine_info["bench_device"] = settings.device
    machine_info["bench_dtype"] = str(settings.dtype)
    machine_info["bench_full"] = settings.full


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The speedup table (median unfused / median fused per case) after the benchmarks."""
    if not _MEDIANS:
        return
    settings = bench_config(config)
    gpu = torch.device(settings.device).type == "cuda" and torch.cuda.is_available()
    copy_bw = None
    if gpu and any(case.bytes_moved for case, _, _ in _MEDIANS.values()):
        copy_bw = _COPY_BW.setdefault(settings.device, bench.copy_bandwidth(settings.device))
    rows = []
    for case, medians, notes in _MEDIANS.values():
        if medians:
            iqrs = _IQRS.get(case.id, {})
            rows.extend(bench.rows_from_medians(case, medians, copy_bw, notes, iqrs))
    if not rows:
        return
    terminalreporter.write_sep("-", "fused vs unfused (medians; speedup = unfused / fused)")
    if not gpu and not bench.malloc_env_set():
        terminalreporter.write_line(
            "warning: MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ not set before start: "
            "CPU timings of large temporaries may be bimodal (see tests/bench/conftest.py)"
        )
    if copy_bw:
        terminalreporter.write_line(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    terminalreporter.write_line(bench.format_table(rows, bandwidth=bool(copy_bw)))
    path = os.environ.get("FUSION_BENCH_JSON")
    if path:
        document = {
            "machine": bench.machine_info(settings.device),
            "copy_bandwidth_gbs": copy_bw / 1e9 if copy_bw else None,
            "rows": [asdict(r) for r in rows],
        }
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")

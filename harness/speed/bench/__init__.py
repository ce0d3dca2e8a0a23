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

Layout: `timers` (the timers and the machine's copy bandwidth), `cases` (the case catalogue
and grids), `table` (running a case, the rows and the speedup table), `cli` (the run of the command; its options are harness.cli.bench's).
"""

from __future__ import annotations

from harness.speed.bench.cases import (
    COMPILED,
    DENSE_SHAPES,
    END_TO_END,
    END_TO_END_TOKENS,
    KERNELS,
    MODELS,
    MOE_SHAPES,
    REDUCED_TOKENS,
    TOKENS,
    UNFUSED,
    Case,
    Unavailable,
    VariantUnavailable,
    end_to_end_cases,
    fused_backends,
    kernel_cases,
    model_cases,
    moe_case,
    norm_eps,
)
from harness.speed.bench.cli import DTYPES, run_from_args
from harness.speed.bench.table import (
    Row,
    compiled_ratios,
    cpu_info,
    format_table,
    machine_info,
    rows_from_medians,
    run_case,
)
from harness.speed.bench.timers import (
    CLOCKS,
    MALLOC_ENV,
    CudaEventClock,
    copy_bandwidth,
    default_device,
    default_dtype,
    flush_cache,
    iqr,
    malloc_env_set,
    measure,
    read_bandwidth,
    time_cpu,
    time_cpu_interleaved,
    time_cuda,
)

__all__ = [
    "CLOCKS",
    "COMPILED",
    "DENSE_SHAPES",
    "DTYPES",
    "END_TO_END",
    "END_TO_END_TOKENS",
    "KERNELS",
    "MALLOC_ENV",
    "MODELS",
    "MOE_SHAPES",
    "REDUCED_TOKENS",
    "TOKENS",
    "UNFUSED",
    "Case",
    "CudaEventClock",
    "Row",
    "Unavailable",
    "VariantUnavailable",
    "compiled_ratios",
    "copy_bandwidth",
    "cpu_info",
    "default_device",
    "default_dtype",
    "end_to_end_cases",
    "flush_cache",
    "format_table",
    "fused_backends",
    "iqr",
    "kernel_cases",
    "machine_info",
    "malloc_env_set",
    "measure",
    "model_cases",
    "moe_case",
    "norm_eps",
    "read_bandwidth",
    "rows_from_medians",
    "run_case",
    "run_from_args",
    "time_cpu",
    "time_cpu_interleaved",
    "time_cuda",
]

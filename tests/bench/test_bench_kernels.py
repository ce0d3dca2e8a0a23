"""Per-kernel benchmarks: fused vs unfused eager at real model widths.

RMSNorm (Llama and Gemma variants; Transformers' eager module vs each backend's kernel),
SiLU-and-mul (eager `silu(gate) * up` vs the kernel on the merged projection), merged QKV and
gate_up GEMMs (separate projections vs one stacked GEMM), and the MoE experts (Transformers'
eager loop vs its `grouped_mm` experts vs the fused block). The grid is `harness.speed.bench`'s
(reduced by default, `--bench-full` / `FUSION_BENCH_FULL=1` for everything); see conftest.py
for how to run, compare and read the results.
"""

from __future__ import annotations

from typing import Any

from harness.speed import bench

BENCH_CASES = bench.kernel_cases


def test_kernel(benchmark: Any, bench_run, bench_case: bench.Case, bench_variant: str) -> None:
    bench_run(benchmark, bench_case, bench_variant)

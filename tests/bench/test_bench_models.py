"""Per-model benchmarks: 2-layer slices of a Llama-shaped and a Qwen3-MoE-shaped model at
real widths (built from configs on the fly, random weights, no downloads), the unfused
decoder forward vs the same model after `fusion.fuse`. See conftest.py for how to run.
"""

from __future__ import annotations

from typing import Any

from harness.speed import bench

BENCH_CASES = bench.model_cases


def test_model(benchmark: Any, bench_run, bench_case: bench.Case, bench_variant: str) -> None:
    bench_run(benchmark, bench_case, bench_variant)

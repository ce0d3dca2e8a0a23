"""End-to-end benchmarks of the speed issue's models: Llama-3.2-1B widths (2 layers),
Qwen3-0.6B widths (4 layers) and Qwen3-30B-A3B widths (32 experts, 2 layers), random weights
built from configs. One pytest-benchmark group per (model, token count), holding the four
variants side by side: unfused, fused, compiled (torch.compile of the unfused decoder) and
fused+compiled. Tokens 1 and 16 by default, `--bench-full` adds 128; compiling takes a few
minutes on a 2-core CPU. See conftest.py for how to run and compare with a saved run.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.speed import bench


def BENCH_CASES(device: str, dtype: torch.dtype, *, full: bool) -> list[bench.Case]:
    """`harness.speed.bench.end_to_end_cases` with the compiled variants."""
    tokens = bench.END_TO_END_TOKENS if full else (1, 16)
    return bench.end_to_end_cases(device, dtype, compiled=True, tokens=tokens)


def test_end_to_end(benchmark: Any, bench_run, bench_case: bench.Case, bench_variant: str) -> None:
    bench_run(benchmark, bench_case, bench_variant)

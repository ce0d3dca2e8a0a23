"""Residual add + RMSNorm, fused vs unfused, at Llama-3.2-1B width (hidden 2048).

`unfused` is what a Transformers decoder layer runs: `s = residual + out`, then the Llama
norm module on `s`. `fused_norm` is the same add followed by the `FusedRMSNorm` that
`fusion.fuse` installs for the norm alone; `fused_add` is the rewritten layer's one call,
`fused_add_rms_norm(residual, out, norm)` (the `auto` backend's `add_rms_norm`). Tokens 1,
16 and 512. See conftest.py for running the suite and reading the speedup table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from harness.speed import bench

HIDDEN = 2048
TOKENS = (1, 16, 512)


def _case(tokens: int, dtype: torch.dtype, device: str) -> bench.Case:
    def make() -> dict[str, Callable[[], Any]]:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        import fusion
        from fusion.fusers.residual_norm import add_rms_norm

        generator = torch.Generator().manual_seed(0)
        norm = LlamaRMSNorm(HIDDEN, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(0.1 * torch.randn(HIDDEN, generator=generator) + 1.0)
        norm = norm.to(device=device, dtype=dtype)
        holder = nn.Sequential(norm)
        report = fusion.fuse(holder)
        if report.counts() != {"rmsnorm": 1}:
            raise RuntimeError(f"the norm did not fuse: {report}")
        fused = holder[0]
        residual, out = (
            torch.randn(tokens, HIDDEN, generator=generator).to(device=device, dtype=dtype)
            for _ in range(2)
        )

        def unfused() -> tuple[torch.Tensor, torch.Tensor]:
            total = residual + out
            return total, norm(total)

        def fused_norm() -> tuple[torch.Tensor, torch.Tensor]:
            total = residual + out
            return total, fused(total)

        return {
            bench.UNFUSED: unfused,
            "fused_norm": fused_norm,
            "fused_add": lambda: add_rms_norm(residual, out, fused),
        }

    size = torch.tensor([], dtype=dtype).element_size()
    return bench.Case(
        kernel="add_rmsnorm_llama",
        shape=f"H{HIDDEN}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(bench.UNFUSED, "fused_norm", "fused_add"),
        # the fused kernel's traffic: read both inputs and the weight, write sum and norm
        bytes_moved=(4 * tokens * HIDDEN + HIDDEN) * size,
    )


def BENCH_CASES(device: str, dtype: torch.dtype, *, full: bool) -> list[bench.Case]:
    return [_case(tokens, dtype, device) for tokens in TOKENS]


def test_add_rmsnorm(benchmark: Any, bench_run, bench_case: bench.Case, bench_variant: str) -> None:
    bench_run(benchmark, bench_case, bench_variant)

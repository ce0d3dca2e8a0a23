"""FusedRMSNorm vs the eager Transformers norm it replaces (module to module).

Llama's norm (weight after the cast back) and Gemma's (1 + weight before it), hidden 512 and
2048, 16 and 512 tokens. `unfused` is the Transformers module; `fused` is what
`fusion.fuse` installed in its place (one `rms_norm` kernel call of the `auto` backend:
the torch reference on CPU, Triton on a GPU). See conftest.py for running the suite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from harness.speed import bench

HIDDENS = (512, 2048)
TOKENS = (16, 512)


def _norm_case(
    variant: str, hidden: int, tokens: int, dtype: torch.dtype, device: str
) -> bench.Case:
    def make() -> dict[str, Callable[[], Any]]:
        import fusion

        if variant == "llama":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm
        else:
            from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as Norm
        generator = torch.Generator().manual_seed(0)
        norm = Norm(hidden, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(0.1 * torch.randn(hidden, generator=generator) + 1.0)
        norm = norm.to(device=device, dtype=dtype)
        holder = nn.Sequential(norm)
        report = fusion.fuse(holder)
        if report.counts() != {"rmsnorm": 1}:
            raise RuntimeError(f"the norm did not fuse: {report}")
        fused = holder[0]
        x = torch.randn(tokens, hidden, generator=generator).to(device=device, dtype=dtype)
        return {bench.UNFUSED: lambda: norm(x), "fused": lambda: fused(x)}

    size = torch.tensor([], dtype=dtype).element_size()
    return bench.Case(
        kernel=f"rmsnorm_module_{variant}",
        shape=f"H{hidden}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(bench.UNFUSED, "fused"),
        bytes_moved=(2 * tokens * hidden + hidden) * size,
    )


def BENCH_CASES(device: str, dtype: torch.dtype, *, full: bool) -> list[bench.Case]:
    return [
        _norm_case(variant, hidden, tokens, dtype, device)
        for variant in ("llama", "gemma")
        for hidden in HIDDENS
        for tokens in TOKENS
    ]


def test_rmsnorm_module(
    benchmark: Any, bench_run, bench_case: bench.Case, bench_variant: str
) -> None:
    bench_run(benchmark, bench_case, bench_variant)

"""FusedMoE vs Transformers' MoE block: the eager expert loop and the `grouped_mm` experts.

One Mixtral-style block (softmax router, renormalised top-2 of 8 experts, hidden 512) with
expert intermediate 256 (the fine-grained ratio of OLMoE / Qwen3-MoE) and 1024 (Mixtral's
side of the ratio), at 16, 64 and 512 tokens, whole block timed (routing included):

- `unfused`: the block with `config._experts_implementation = "eager"` (a Python loop over
  the hit experts, one-hot mask, per-expert gather and `index_add_`);
- `hf[grouped_mm]`: the same block with Transformers' default `grouped_mm` experts;
- `fused`: the block after `fusion.fuse` (a `FusedMoE` on the `auto` backend: on CPU the
  oneDNN experts of `fusion.kernels.onednn` where available);
- `fused[torch]`: the same `FusedMoE` on the torch reference kernel (MKL `mm`, like both
  Transformers paths), which separates what grouping buys from what oneDNN's GEMMs buy.

All share one set of weights.

Measured (2-core AMD EPYC Zen 4 with AVX-512, torch 2.13.0+cpu, Transformers 5.24.0, float32,
one torch thread, `time.process_time`, glibc malloc thresholds as `tox -e bench` sets them,
another process busy on the other core; medians; ratio = other / `fused`), after the oneDNN
backend stopped caching packed weights (it copies each weight block per call, coherent with
any write; it takes only experts with 64+ rows):

    intermediate  tokens  vs eager loop  vs hf[grouped_mm]  fused[torch] vs eager
    256           16      1.43x          1.03x              1.30x
    256           64      1.18x          1.04x              1.17x
    256           512     1.40x          1.43x              1.03x
    1024          16      1.00x          1.05x              0.95x
    1024          64      1.02x          0.99x              1.05x
    1024          512     1.65x          1.60x              1.06x

With MKL's `mm` (`fused[torch]`, as both Transformers paths) the expert GEMMs are ~96% of
the block and grouping alone ties; the win at 512 tokens is oneDNN's GEMMs
(`fusion.kernels.onednn`). Below 64 rows per expert (16 and 64 tokens here: ~4 and
~16 rows) the backend runs `mm`/`grouped_mm`, a tie. (The cached-pack version measured
1.22-1.34x at 64 tokens, but went stale on `p.data` writes.)

See conftest.py for running and reading the results; on a shared CPU pass `--benchmark-timer=time.process_time` with `FUSION_BENCH_THREADS=1` so
time other processes take from the cores is not charged to the kernel.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from harness.speed import bench

HIDDEN, EXPERTS, TOP_K = 512, 8, 2
INTERMEDIATES = (256, 1024)
TOKENS = (16, 64, 512)


def _moe_block_case(inter: int, tokens: int, dtype: torch.dtype, device: str) -> bench.Case:
    def make() -> dict[str, Callable[[], Any]]:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        import fusion

        config = MixtralConfig(
            hidden_size=HIDDEN,
            intermediate_size=inter,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
        )
        with torch.device(device):
            block = MixtralSparseMoeBlock(config).to(dtype).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in block.parameters():
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        eager = _with_implementation(block, config, "eager")
        grouped = _with_implementation(block, config, "grouped_mm")
        holder = nn.Sequential(_with_implementation(block, config, "eager"))
        report = fusion.fuse(holder)
        if report.counts() != {"moe": 1}:
            raise RuntimeError(f"the block did not fuse: {report}")
        fused = holder[0]
        reference = copy.copy(fused)
        reference.backend = "torch"
        x = (torch.randn(1, tokens, HIDDEN, generator=generator)).to(device=device, dtype=dtype)
        return {
            bench.UNFUSED: lambda: eager(x),
            "hf[grouped_mm]": lambda: grouped(x),
            "fused": lambda: fused(x),
            "fused[torch]": lambda: reference(x),
        }

    return bench.Case(
        kernel="moe_block",
        shape=f"mixtral-like:H{HIDDEN}-I{inter}-E{EXPERTS}-top{TOP_K}",
        dtype=dtype,
        device=device,
        tokens=tokens,
        make=make,
        variants=(bench.UNFUSED, "hf[grouped_mm]", "fused", "fused[torch]"),
    )


def _with_implementation(block: nn.Module, config: Any, implementation: str) -> nn.Module:
    """A shallow copy of `block` sharing its weights, whose experts use `implementation`."""
    variant = copy.copy(block)
    variant._modules = dict(block._modules)
    experts = copy.copy(block.experts)
    experts.config = copy.copy(config)
    experts.config._experts_implementation = implementation
    variant.experts = experts
    return variant


def BENCH_CASES(device: str, dtype: torch.dtype, *, full: bool) -> list[bench.Case]:
    return [
        _moe_block_case(inter, tokens, dtype, device)
        for inter in INTERMEDIATES
        for tokens in TOKENS
    ]


def test_moe_block(benchmark: Any, bench_run, bench_case: bench.Case, bench_variant: str) -> None:
    bench_run(benchmark, bench_case, bench_variant)

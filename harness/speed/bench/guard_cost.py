"""What the per-call guards of rewritten forwards cost: microseconds per check, per module.

    python -m harness.bench.guard_cost [--arch GLOB ...] [--threads N] [--budget S]

A rewritten forward (`fusion.inspection.FusedForward` with `rewrite`) asks `failure()` before every call: its
child guards (identity, class, hooks), then the global names it reads; a fused MoE block
asks whether its experts still hold, fused experts whether their proof's premises do. This
times each such check alone, per fused module of a tiny corpus model fused on the CPU, and beside it the
whole decode step (one token through the fused model), so the closing figure is the share
of a decode step the guards take. The guard check's work does not depend on the model's
widths (it reads module dictionaries and global namespaces, never a tensor), but its cost
does: inside a real-width decode step each check runs after weight streams have emptied the
caches (a fused attention's check measured inside a Qwen3-0.6B-width step costs several
times its warm figure here), so the figures here are warm lower bounds, and the
share printed is the tiny model's (a real model's step is far longer).

Timings are `timers.time_cpu` medians (rounds of at least a millisecond) with the IQR.
Nothing is asserted about them here (performance claims come from runs, never tests).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

import fusion
from fusion import inspection
from harness.base import architectures
from harness.speed.bench.timers import iqr, time_cpu

DEFAULT_ARCHS = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")
"""Architectures timed when none are named: dense GQA, q/k-norm, MoE, MLA."""


@dataclass(frozen=True)
class GuardCost:
    """One fused module's guard check: `guards` child/method guards plus the global-name
    guard (`globals_watched` names), `median_us` / `iqr_us` per `failure()` call."""

    module: str
    cls: str
    guards: int
    globals_watched: int
    median_us: float
    iqr_us: float


@dataclass(frozen=True)
class ArchGuardCost:
    """Per architecture: every guarded module's cost, their sum per forward (each module is
    called once per decode step), and the one-token fused forward it is compared with."""

    arch: str
    modules: tuple[GuardCost, ...]
    step_median_us: float

    @property
    def per_step_us(self) -> float:
        return sum(m.median_us for m in self.modules)

    @property
    def share(self) -> float:
        return self.per_step_us / self.step_median_us if self.step_median_us else 0.0


@dataclass(frozen=True)
class Check:
    """One module's per-call guard check as the fused code asks it: `holds()` is True when
    the fused path may run. `guards` / `globals_watched`: what it compares (0 where the
    module's check is a fixed set of comparisons rather than a list)."""

    name: str
    module: nn.Module
    holds: Callable[[], bool]
    guards: int = 0
    globals_watched: int = 0


def guard_checks(model: nn.Module) -> list[Check]:
    """Every per-call guard check of a fused model, in module order
    (`fusion.inspection.guard_checks`): rewritten forwards, fused MoE blocks and fused
    experts; the root module is named "<root>"."""
    return [
        Check(c.qualname or "<root>", c.module, c.holds, c.guards, c.globals_watched)
        for c in inspection.guard_checks(model)
    ]


def module_cost(check: Check, budget_s: float) -> GuardCost:
    """Time `check.holds()` (it must hold: a failing guard would time the fallback)."""
    if not check.holds():
        raise RuntimeError(f"{check.name}: a guard fails before timing")
    times = time_cpu(check.holds, budget_s=budget_s, warmup_calls=10)
    return GuardCost(
        module=check.name,
        cls=type(check.module).__name__,
        guards=check.guards,
        globals_watched=check.globals_watched,
        median_us=statistics.median(times) * 1e6,
        iqr_us=iqr(times) * 1e6,
    )


def arch_cost(arch: str, budget_s: float) -> ArchGuardCost:
    """Build `arch` tiny (float32, CPU), fuse it, time each guard check and a decode step."""
    model = architectures.build(arch, seed=0, dtype=torch.float32, device="cpu").eval()
    fusion.fuse(model)
    modules = tuple(module_cost(check, budget_s) for check in guard_checks(model))
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.inference_mode():
        step = time_cpu(lambda: model(input_ids=ids, use_cache=False), budget_s=budget_s)
    return ArchGuardCost(arch, modules, statistics.median(step) * 1e6)


def format_rows(results: Sequence[ArchGuardCost]) -> str:
    """A markdown table: per architecture and fused class, guards and us per check."""
    lines = [
        "| arch | fused class | modules | guards | globals | us / check [IQR] |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        by_class: dict[str, list[GuardCost]] = {}
        for cost in result.modules:
            by_class.setdefault(cost.cls, []).append(cost)
        for cls, costs in by_class.items():
            med = statistics.median(c.median_us for c in costs)
            spread = statistics.median(c.iqr_us for c in costs)
            lines.append(
                f"| {result.arch} | {cls} | {len(costs)} | {costs[0].guards} | "
                f"{costs[0].globals_watched} | {med:.2f} [{spread:.2f}] |"
            )
        lines.append(
            f"| {result.arch} | per decode step | {len(result.modules)} | | | "
            f"{result.per_step_us:.1f} of {result.step_median_us:.0f} "
            f"({100 * result.share:.1f}% of the tiny model's step) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.bench.guard_cost",
        description="Microseconds per call the guards of rewritten forwards cost, per fused "
        "module of tiny corpus models (CPU, float32), beside a one-token forward.",
    )
    parser.add_argument(
        "--arch", action="append", default=[], help="glob over corpus names (repeatable)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per timing")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = architectures.available()
    try:
        archs = architectures.select(args.arch, names) if args.arch else list(DEFAULT_ARCHS)
    except architectures.UnknownArchitecture as exc:
        parser.error(str(exc))
    results = []
    for arch in archs:
        print(f"guard cost: {arch} ...", file=sys.stderr, flush=True)
        try:
            results.append(arch_cost(arch, args.budget))
        except Exception as exc:  # one architecture's failure is reported, not fatal
            print(f"guard cost: {arch}: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(format_rows(results))
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())

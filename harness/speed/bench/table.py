"""Running a case and reporting it: rows against the unfused baseline, the speedup table, and
the machine the numbers were measured on."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.reporting import table as text_table
from harness.speed.bench.cases import UNFUSED, Case, Unavailable, variant_of
from harness.speed.bench.timers import iqr, malloc_env_set, measure, time_cpu_interleaved


@dataclass
class Row:
    """The timings of one (case, variant) against the case's unfused baseline."""

    kernel: str
    variant: str
    shape: str
    tokens: int
    dtype: str
    device: str
    unfused_ms: float | None
    fused_ms: float | None
    speedup: float | None
    bandwidth_gbs: float | None = None
    copy_fraction: float | None = None
    note: str = ""
    unfused_iqr_ms: float | None = None
    fused_iqr_ms: float | None = None
    """Interquartile ranges of the per-round times (ms): the spread behind each median."""
    copies: int = 1
    unfused_copy_ms: list[float] | None = None
    fused_copy_ms: list[float] | None = None
    """With several copies of each variant (`Case.copies`): each copy's own median (ms); the
    medians above pool every copy's rounds. Their range is the placement spread."""


def rows_from_medians(
    case: Case,
    medians: dict[str, float],
    copy_bw: float | None,
    notes: dict[str, str],
    iqrs: dict[str, float] | None = None,
    per_copy: dict[str, list[float]] | None = None,
) -> list[Row]:
    """Table rows of `case`: each non-baseline variant against the unfused median (seconds;
    `iqrs` the interquartile ranges, seconds, when known; `per_copy` each copy's median,
    seconds, when the case has several). Bandwidth (GB/s and fraction of `copy_bw`) for
    memory-bound kernels when `copy_bw` is given."""
    base = medians.get(UNFUSED)
    spread = iqrs or {}
    copies = per_copy or {}
    rows = []
    for variant in case.variants[1:]:
        t = medians.get(variant)
        bw = case.bytes_moved / t if (t and case.bytes_moved) else None
        several = len(copies.get(variant, ())) > 1 or len(copies.get(UNFUSED, ())) > 1
        rows.append(
            Row(
                kernel=case.kernel,
                variant=variant,
                shape=case.shape,
                tokens=case.tokens,
                dtype=case.dtype_name,
                device=case.device,
                unfused_ms=base * 1e3 if base else None,
                fused_ms=t * 1e3 if t else None,
                speedup=base / t if (base and t) else None,
                bandwidth_gbs=bw / 1e9 if bw else None,
                copy_fraction=bw / copy_bw if (bw and copy_bw) else None,
                note=notes.get(variant, notes.get(UNFUSED, "")),
                unfused_iqr_ms=_ms(spread.get(UNFUSED)),
                fused_iqr_ms=_ms(spread.get(variant)),
                copies=max(1, len(copies.get(variant, ()))),
                unfused_copy_ms=_ms_list(copies.get(UNFUSED)) if several else None,
                fused_copy_ms=_ms_list(copies.get(variant)) if several else None,
            )
        )
    return rows


def _ms_list(seconds: list[float] | None) -> list[float] | None:
    return None if seconds is None else [s * 1e3 for s in seconds]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def run_case(
    case: Case, budget_s: float, copy_bw: float | None = None, clock: str = "wall"
) -> list[Row]:
    """Time every variant of `case` (same tensors) and return its rows. On CPU the variants
    take turns round by round (`time_cpu_interleaved`, read with `clock`), on GPU one after
    the other with CUDA events. A variant that cannot run here is reported with its reason
    instead of a time. Several copies of a variant (`Case.copies`) take their turns like
    variants of their own; the variant's median pools all their rounds, and each copy's
    median is kept beside it."""
    notes: dict[str, str] = {}
    try:
        fns = case.build()
    except Exception as exc:  # a case that cannot be built is reported, not fatal
        return rows_from_medians(case, {}, None, {UNFUSED: f"cannot build: {exc}"})
    for variant in case.variants:
        fn = fns.get(variant)
        if fn is None or isinstance(fn, Unavailable):
            notes[variant] = fn.reason if isinstance(fn, Unavailable) else "not available"
    runnable = {
        key: fn
        for key, fn in fns.items()
        if variant_of(key) in case.variants
        and variant_of(key) not in notes
        and not isinstance(fn, Unavailable)
    }
    notes.update(
        case.notes
    )  # after `runnable`: a note is said on the row, it does not bar a timing
    if torch.device(case.device).type == "cpu":
        times = time_cpu_interleaved(runnable, budget_s=budget_s, clock=clock)
    else:
        times = {key: measure(fn, case.device, budget_s) for key, fn in runnable.items()}
    del fns, runnable
    pooled, per_copy = pool_copies(times)
    medians = {variant: statistics.median(t) for variant, t in pooled.items()}
    spreads = {variant: iqr(t) for variant, t in pooled.items()}
    return rows_from_medians(case, medians, copy_bw, notes, spreads, per_copy)


def pool_copies(
    times: dict[str, list[float]],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-round times keyed by `make()` key (`fused`, `fused@1`, ...) -> (every round of each
    variant, pooled over its copies; each copy's median, in key order)."""
    pooled: dict[str, list[float]] = {}
    per_copy: dict[str, list[float]] = {}
    for key, rounds in times.items():
        pooled.setdefault(variant_of(key), []).extend(rounds)
        per_copy.setdefault(variant_of(key), []).append(statistics.median(rounds))
    return pooled, per_copy


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.4f}-{max(values):.4f}"


def format_table(rows: Sequence[Row], *, bandwidth: bool = False, ceiling: str = "copy") -> str:
    """The speedup table: kernel, variant, shape, tokens, dtype, unfused and fused medians
    with their interquartile ranges (ms), speedup (unfused / fused median), and achieved GB/s
    with the fraction of the `ceiling` bandwidth ('copy' on a GPU, 'read' on a CPU) when
    `bandwidth`."""
    header = ["kernel", "variant", "shape", "tokens", "dtype", "unfused ms", "IQR", "fused ms"]
    header += ["IQR", "speedup"]
    if bandwidth:
        header += ["GB/s", f"% {ceiling} BW"]
    table = [header]
    notes = []
    for r in rows:
        line = [
            r.kernel,
            r.variant,
            r.shape,
            str(r.tokens),
            r.dtype,
            _fmt(r.unfused_ms, ".4f"),
            _fmt(r.unfused_iqr_ms, ".4f"),
            _fmt(r.fused_ms, ".4f"),
            _fmt(r.fused_iqr_ms, ".4f"),
            _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
        ]
        if bandwidth:
            line += [
                _fmt(r.bandwidth_gbs, ".0f"),
                _fmt(r.copy_fraction and 100 * r.copy_fraction, ".0f"),
            ]
        table.append(line)
        if r.note:
            notes.append(f"{r.kernel} {r.variant} {r.shape} T={r.tokens}: {r.note}")
        if r.unfused_copy_ms and r.fused_copy_ms:
            notes.append(
                f"{r.kernel} {r.variant} {r.shape} T={r.tokens}: copies' medians "
                f"({len(r.unfused_copy_ms)} unfused, {len(r.fused_copy_ms)} {r.variant}): unfused {_span(r.unfused_copy_ms)} ms, {r.variant} {_span(r.fused_copy_ms)} ms"
            )
    numeric = set(range(3, len(header))) - {4}
    lines = [text_table.render(table[0], table[1:], right=numeric)]
    return "\n".join(lines + (["", *notes] if notes else []))


def machine_info(device: str) -> dict[str, Any]:
    """Versions and hardware the numbers were measured on."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "malloc_env": malloc_env_set(),
        "threads": torch.get_num_threads(),
    }
    info.update(cpu_info())
    for module in ("transformers", "triton", "vllm"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # optional packages may be missing or fail to import
            info[module] = None
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")
"""The x86 feature flags that decide which CPU kernels run (reported with every figure)."""


def cpu_info() -> dict[str, Any]:
    """The CPU the numbers were measured on: model name, the `VECTOR_FLAGS` it has (from
    /proc/cpuinfo; empty elsewhere), the vector ISA ATen dispatches to (which
    `ATEN_CPU_CAPABILITY` can lower, e.g. to emulate an AVX2-only machine), and whether the
    native CPU kernel runs here (`native_gemm.status()`: 'available' or why not), with its
    prefetch hint and how that was chosen (`native_gemm.prefetch_status()`)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the model and flags are simply unknown
        pass
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        capability = "unknown"
    # builds the kernel on first use (once per machine)
    from fusion.kernels.native import gemm as native_gemm

    info: dict[str, Any] = {
        "cpu_model": model,
        "cpu_flags": [f for f in VECTOR_FLAGS if f in flags],
        "aten_cpu_capability": capability,
        "native_kernel": native_gemm.status(),
    }
    info["native_prefetch"], info["native_prefetch_reason"] = native_gemm.prefetch_status()
    return info


def compiled_ratios(rows: Sequence[Row]) -> list[str]:
    """One line per model case and fused variant timed under torch.compile (`fused+compiled`,
    and `fused+calibrated+compiled` where the case has it): the compiled-unfused time over
    the compiled-fused time (above 1: the fused model is faster, compiled both)."""
    by_case: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        by_case.setdefault((row.kernel, row.shape, row.tokens, row.dtype), {})[row.variant] = row
    lines = []
    for (kernel, shape, tokens, dtype), variants in by_case.items():
        compiled = variants.get("compiled")
        for name in ("fused+compiled", "fused+calibrated+compiled"):
            both = variants.get(name)
            if compiled is None or both is None or not compiled.fused_ms or not both.fused_ms:
                continue
            ratio = compiled.fused_ms / both.fused_ms
            lines.append(
                f"  {kernel} {shape} T{tokens} {dtype}: compiled {compiled.fused_ms:.3f} ms, "
                f"{name} {both.fused_ms:.3f} ms, {ratio:.2f}x"
            )
    return lines

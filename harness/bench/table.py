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

from harness.bench.cases import UNFUSED, Case, Unavailable
from harness.bench.timers import malloc_env_set, measure


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


def rows_from_medians(
    case: Case, medians: dict[str, float], copy_bw: float | None, notes: dict[str, str]
) -> list[Row]:
    """Table rows of `case`: each non-baseline variant against the unfused median (seconds).
    Bandwidth (GB/s and fraction of `copy_bw`) for memory-bound kernels when `copy_bw` is given."""
    base = medians.get(UNFUSED)
    rows = []
    for variant in case.variants[1:]:
        t = medians.get(variant)
        bw = case.bytes_moved / t if (t and case.bytes_moved) else None
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
            )
        )
    return rows


def run_case(case: Case, budget_s: float, copy_bw: float | None = None) -> list[Row]:
    """Time every variant of `case` (same tensors, one after the other) and return its rows.
    A variant that cannot run here is reported with its reason instead of a time."""
    medians: dict[str, float] = {}
    notes: dict[str, str] = {}
    try:
        fns = case.build()
    except Exception as exc:  # a case that cannot be built is reported, not fatal
        return rows_from_medians(case, {}, None, {UNFUSED: f"cannot build: {exc}"})
    for variant in case.variants:
        fn = fns.get(variant)
        if fn is None or isinstance(fn, Unavailable):
            notes[variant] = fn.reason if isinstance(fn, Unavailable) else "not available"
            continue
        medians[variant] = statistics.median(measure(fn, case.device, budget_s))
    del fns
    return rows_from_medians(case, medians, copy_bw, notes)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[Row], *, bandwidth: bool = False) -> str:
    """The speedup table: kernel, variant, shape, tokens, dtype, unfused ms, fused ms, speedup
    (and achieved GB/s with the fraction of copy bandwidth when `bandwidth`)."""
    header = ["kernel", "variant", "shape", "tokens", "dtype", "unfused ms", "fused ms", "speedup"]
    if bandwidth:
        header += ["GB/s", "% copy BW"]
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
            _fmt(r.fused_ms, ".4f"),
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
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    numeric = set(range(3, len(header))) - {4}
    lines = []
    for n, row in enumerate(table):
        cells = [
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
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


def compiled_ratios(rows: Sequence[Row]) -> list[str]:
    """One line per model case timed under torch.compile: the compiled-unfused time over the
    compiled-fused time (above 1: the fused model is faster, compiled both)."""
    by_case: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        by_case.setdefault((row.kernel, row.shape, row.tokens, row.dtype), {})[row.variant] = row
    lines = []
    for (kernel, shape, tokens, dtype), variants in by_case.items():
        compiled, both = variants.get("compiled"), variants.get("fused+compiled")
        if compiled is None or both is None or not compiled.fused_ms or not both.fused_ms:
            continue
        ratio = compiled.fused_ms / both.fused_ms
        lines.append(
            f"  {kernel} {shape} T{tokens} {dtype}: compiled {compiled.fused_ms:.3f} ms, "
            f"fused+compiled {both.fused_ms:.3f} ms, {ratio:.2f}x"
        )
    return lines

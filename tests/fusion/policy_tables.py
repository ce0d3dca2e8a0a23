"""Calibration tables written by hand for the kernel policy's tests (nothing timed): an entry
with the ratios a test needs, a table of entries, and the ratios that win, lose or tie."""

from __future__ import annotations

import torch

from fusion.kernels.calibration import Entry, Ratio, Table
from fusion.kernels.native import gemm as native_gemm
from fusion.kernels.policy import row_bucket

WIN = Ratio(1.4, 1.2, 1.6)
NOISE = Ratio(1.02, 0.97, 1.08)  # faster on average, within noise: not a win
LOSS = Ratio(0.6, 0.5, 0.7)


def entry(op: str, shape: tuple[int, ...], rows: int, **ratios: Ratio) -> Entry:
    """A float32 entry at this process's thread count, measured against `reference`."""
    return Entry(
        op=op,
        shape=shape,
        dtype="float32",
        rows=row_bucket(rows),
        threads=torch.get_num_threads(),
        median_us={"reference": 100.0, **{k: 100.0 / r.median for k, r in ratios.items()}},
        ratios=dict(ratios),
        rounds=9,
        native_build=native_gemm.build_id() if "native" in ratios else "",
    )


def table(*entries: Entry) -> Table:
    out = Table("test")
    for e in entries:
        out.add(e)
    return out

"""Which software prefetch the native kernel's loops issue on this machine, chosen by
measurement and kept beside the library it was measured with.

Both loops of `csrc/rowmajor_gemm.c` (`row_block`, a decode step's one row, and
`weight_block`, a few rows) prefetch the next block of weight rows while they read the
current one. Where the prefetched lines wait
decides how many can be in flight: into L1 (`L1`, `prefetcht0`) each holds an L1 miss buffer
until it arrives; only as far as L2 (`L2`, `prefetcht2`) it holds one of L2's more numerous
slots. Which streams faster is a property of the core's memory pipeline, not of the model:
on a Zen 4 the L2 hint streamed one-row products much faster, in bf16 most (docs/benchmarks.md,
"Figures behind design choices"); other cores are not known, so each machine measures its own
(`measure`) rather than following a rule fitted on one. It is measured on the one-row loop,
which decode runs; the multi-row loop takes the same hint (on the Zen 4 the L2 hint was as
fast or faster there too, at 4 to 16 rows).

Why it is safe: a prefetch hint changes where lines wait, never what is computed, so either
choice gives the same bits (the build's probe checks every hint against float64, and the two
against each other). Only the speed depends on the choice: a wrong one (a noisy measurement)
costs time, never correctness.

The choice is measured once per built library (the library's file name embeds its cache key:
source, compiler, flags, CPU flags) and saved beside it as `<library>.prefetch`, so every
later process on the machine runs the same code path without measuring; `FUSION_NATIVE_PREFETCH`
(`l1` or `l2`) pins it instead, for a reproduction or a test. Fail closed: a cache file that
cannot be read or written, or a measurement that cannot run, leaves the loop as it always ran
(`L1`), with the reason in the `Choice`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fusion.kernels import memory

L1 = 0
"""`hint` argument of the kernel's entry points: prefetch into L1 (what the loop always did)."""
L2 = 1
"""`hint` argument: prefetch only as far as L2."""
HINTS = {"l1": L1, "l2": L2}
"""The names `PREFETCH_ENV` and the cache file use, and the hints they stand for."""

PREFETCH_ENV = "FUSION_NATIVE_PREFETCH"
"""`l1` or `l2` pins the hint (no measurement, no cache file read or written)."""

SHAPE = (3072, 576)
"""The weight the measurement streams (a 576-wide model's GLU projection, as a decode step
reads it): short rows, where a block's next rows are closest and the hint matters most."""
ROUNDS = 5
"""Rounds of the measurement; each times one pass over every copy with each hint and dtype,
in alternating order, and the median of the rounds decides."""
MAX_STREAM_BYTES = 1 << 30
"""At most this much memory is filled for the measurement (the stream covers the machine's
last-level cache `memory.STREAM_FACTOR` times, up to this)."""

Kernel = Callable[..., int]
"""A typed ctypes entry point of the kernel (`gemm._declare`'s signature, hint last)."""


@dataclass(frozen=True)
class Choice:
    """The hint the kernel runs with, and how it was chosen."""

    hint: int
    """`L1` or `L2`: the last argument of every kernel call."""
    reason: str
    """'measured: ...' (the medians), 'cached in FILE', 'pinned by ...', or why the default
    `L1` was kept."""


def name(hint: int) -> str:
    """The name of `hint` (`HINTS`' key)."""
    return "l2" if hint == L2 else "l1"


def choose(kernels: tuple[Kernel, Kernel], library: Path | None) -> Choice:
    """The hint for `kernels` (the float32 and bf16 entry points of `library`): pinned by
    `PREFETCH_ENV`, else read from the file beside `library`, else measured and saved there.
    Never raises for an environment problem (fail closed: `L1`, the reason in the result)."""
    pinned = os.environ.get(PREFETCH_ENV, "").strip().lower()
    if pinned:
        if pinned in HINTS:
            return Choice(HINTS[pinned], f"pinned by {PREFETCH_ENV}={pinned}")
        return Choice(L1, f"{PREFETCH_ENV}={pinned!r} is not one of {sorted(HINTS)}: l1 kept")
    cache = None if library is None else library.with_name(library.name + ".prefetch")
    if cache is not None:
        try:
            text = cache.read_text().strip()
        except OSError:
            text = ""
        if text in HINTS:
            return Choice(HINTS[text], f"cached in {cache}")
    try:
        hint, medians = measure(kernels)
    except (RuntimeError, MemoryError) as exc:
        return Choice(L1, f"not measured ({exc}): l1 kept")
    reason = "measured: " + ", ".join(f"{name(h)} {s * 1e3:.2f} ms" for h, s in medians.items())
    if cache is not None:
        problem = _save(cache, name(hint))
        if problem:
            reason += f" (not saved: {problem})"
    return Choice(hint, reason)


def _save(path: Path, text: str) -> str:
    """Write `text` to `path` through a temporary file in its directory (atomic: concurrent
    processes read a whole file or none); '' on success, else why not."""
    try:
        handle, temporary = tempfile.mkstemp(prefix=".prefetch-", dir=path.parent)
        with os.fdopen(handle, "w") as out:
            out.write(text + "\n")
        os.replace(temporary, path)
        return ""
    except OSError as exc:
        return str(exc)


def measure(kernels: tuple[Kernel, Kernel]) -> tuple[int, dict[int, float]]:
    """Time one-row products on copies of a `SHAPE` weight that together cover the stream
    (each call reads its weight from memory, as a decode step does), in float32 and bf16,
    with each hint, one thread, rounds alternating the order. Returns the hint with the
    lower median time of a round (float32 and bf16 passes together; `L1` on a tie) and each
    hint's median seconds. RuntimeError where a kernel call refuses its operands."""
    n, k = SHAPE
    stream = min(memory.stream_bytes(), MAX_STREAM_BYTES)
    passes: list[tuple[Kernel, torch.dtype, list[torch.Tensor], torch.Tensor]] = []
    for kernel, dtype in zip(kernels, (torch.float32, torch.bfloat16)):
        size = n * k * torch.empty((), dtype=dtype).element_size()
        copies = max(2, stream // 2 // size)
        # written, not only allocated: untouched pages all read one zero page, from cache
        pool = torch.empty(copies, n, k, dtype=dtype, device="cpu").fill_(0.01)
        x = torch.full((1, k), 0.5, dtype=dtype, device="cpu")
        passes.append((kernel, dtype, list(pool.unbind(0)), x))
    out = torch.empty(1, n, dtype=torch.float32, device="cpu")
    outs = {torch.float32: out, torch.bfloat16: out.to(torch.bfloat16)}
    times: dict[int, list[float]] = {L1: [], L2: []}
    for r in range(ROUNDS):
        for hint in (L1, L2) if r % 2 == 0 else (L2, L1):
            start = time.perf_counter()
            for kernel, dtype, weights, x in passes:
                y = outs[dtype]
                for w in weights:
                    code = kernel(
                        x.data_ptr(), k, w.data_ptr(), k, None, y.data_ptr(), n, 1, n, k, 1, hint
                    )
                    if code != 0:
                        raise RuntimeError(f"the kernel returned {code} on a {n}x{k} weight")
            times[hint].append(time.perf_counter() - start)
    medians = {h: statistics.median(t) for h, t in times.items()}
    return (L2 if medians[L2] < medians[L1] else L1), medians

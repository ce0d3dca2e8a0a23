"""Timers that can be trusted (the rules are in `harness.speed.bench`'s docstring): CUDA events
after warm-up with the L2 flushed on GPU, `perf_counter` over batched calls on CPU, the glibc
settings that keep CPU timings unimodal, and the card's copy bandwidth."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
"""glibc settings that keep large freed blocks mapped, so CPU timings are not bimodal."""


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """float32 on CPU, bfloat16 on GPU (what each is used with)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def malloc_env_set(environ: dict[str, str] | None = None) -> bool:
    """Whether the glibc malloc settings of `MALLOC_ENV` are in the environment."""
    environ = os.environ if environ is None else environ
    return all(environ.get(key) == value for key, value in MALLOC_ENV.items())


_FLUSH: dict[str, torch.Tensor] = {}


def flush_cache(device: torch.device | str) -> None:
    """On CUDA, overwrite a 256 MiB buffer (larger than any L2) so the next call starts cold;
    queued on the current stream, no synchronisation. On CPU: nothing."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    key = str(device)
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)
    _FLUSH[key].zero_()


def time_cuda(
    fn: Callable[[], Any],
    *,
    budget_s: float = 0.5,
    warmup_s: float = 0.05,
    min_rounds: int = 10,
    max_rounds: int = 500,
    device: torch.device | str = "cuda",
) -> list[float]:
    """Seconds per call of `fn` on the GPU, one value per round (as `triton.testing.do_bench`).

    Each round: flush the L2, record a start event, call `fn`, record an end event; every
    round is queued before one final synchronisation, so the host's own speed only shows
    where the GPU really waits for it (launch-bound eager code). Warm-up first (compilation,
    allocator, clocks).
    """
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    while True:  # warm-up, also an estimate of the time per call
        fn()
        torch.cuda.synchronize(device)
        if time.perf_counter() - start >= warmup_s:
            break
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    per_call = max(begin.elapsed_time(end) / 5e3, 1e-7)
    rounds = int(min(max_rounds, max(min_rounds, budget_s / per_call)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rounds)]
    for i in range(rounds):
        flush_cache(device)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def time_cpu(
    fn: Callable[[], Any],
    *,
    budget_s: float = 0.5,
    warmup_calls: int = 2,
    min_rounds: int = 5,
    max_rounds: int = 1000,
) -> list[float]:
    """Seconds per call of `fn` on the CPU, one value per round of `n` calls (n sized so a
    round lasts at least a millisecond), after `warmup_calls` calls."""
    for _ in range(warmup_calls):
        fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, math.ceil(1e-3 / one))
    rounds = int(min(max_rounds, max(min_rounds, budget_s / (one * calls))))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return times


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "process": time.process_time,
}
"""CPU clocks a benchmark can read: `wall` (elapsed time, what a user waits) and `process`
(CPU time of this process, all its threads: on a machine shared with other work it does not
count the time the process waited for a core, so it is the steadier measure of work;
with several threads it also counts time spent spinning at OpenMP barriers)."""


def time_cpu_interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    budget_s: float = 0.5,
    clock: str = "wall",
    warmup_calls: int = 2,
    min_rounds: int = 5,
    max_rounds: int = 1000,
) -> dict[str, list[float]]:
    """Seconds per call of each of `fns`, one value per round, the variants taking turns
    round by round (A, B, C, C, B, A, ...): a change in the machine's load during the run
    (other work on a shared machine) then falls on every variant alike, so their ratio
    stays fair. Each variant's calls per round are sized to at least a millisecond; the
    number of rounds fits `budget_s` per variant. `clock` names one of `CLOCKS`."""
    now = CLOCKS[clock]
    calls: dict[str, int] = {}
    per_call: dict[str, float] = {}
    for name, fn in fns.items():
        for _ in range(warmup_calls):
            fn()
        t0 = time.perf_counter()
        fn()
        per_call[name] = max(time.perf_counter() - t0, 1e-7)
        calls[name] = max(1, math.ceil(1e-3 / per_call[name]))
    slowest = max(per_call[n] * calls[n] for n in fns) if fns else 1.0
    rounds = int(min(max_rounds, max(min_rounds, budget_s / slowest)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for round_ in range(rounds):
        # the turn order reverses every round (A, B, C, C, B, A, ...), so no variant always
        # runs right after the same other one: what a call leaves behind (caches, the
        # allocator's free lists) would otherwise favour one side every round
        for name, fn in order if round_ % 2 == 0 else reversed(order):
            t0 = now()
            for _ in range(calls[name]):
                fn()
            times[name].append((now() - t0) / calls[name])
    return times


def iqr(values: list[float]) -> float:
    """Interquartile range (75th minus 25th percentile) of `values`; 0.0 for fewer than 2."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def measure(fn: Callable[[], Any], device: torch.device | str, budget_s: float) -> list[float]:
    """Per-round seconds per call of `fn`: `time_cuda` on a GPU, else `time_cpu`."""
    device = torch.device(device)
    if device.type == "cuda":
        return time_cuda(fn, budget_s=budget_s, device=device)
    return time_cpu(fn, budget_s=budget_s)


class CudaEventClock:
    """A pytest-benchmark timer that reads the GPU's clock instead of the host's.

    pytest-benchmark's pedantic runner calls its timer exactly twice per round, before and
    after the target. The first call records a start event and returns 0.0; the second
    records an end event, waits for it and returns the GPU time between the two, in seconds.
    So a round's duration is the device time of the target, and (with the cache flush queued
    by `setup`, not waited for) the host never sits idle-timed between flush and target.
    """

    def __init__(self) -> None:
        self._start: torch.cuda.Event | None = None

    def __call__(self) -> float:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._start is None:
            self._start = event
            return 0.0
        start, self._start = self._start, None
        event.synchronize()
        return start.elapsed_time(event) / 1e3


def copy_bandwidth(device: torch.device | str, nbytes: int = 1 << 30) -> float:
    """Bytes per second a large `Tensor.copy_` moves on `device` (read + write), the ceiling
    the memory-bound kernels are compared with; median of timed rounds."""
    device = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = measure(lambda: dst.copy_(src), device, budget_s=0.3)
    return 2 * nbytes / statistics.median(times)


def read_bandwidth(nbytes: int, budget_s: float = 0.3) -> float:
    """Bytes per second `torch.sum` reads from a CPU tensor of `nbytes` (float32), at torch's
    current thread count; median of timed rounds. The floor a decode step's weight streaming
    is compared with: `nbytes` should exceed the last-level cache several times
    (`fusion.kernels.calibration.stream_bytes`), or this measures the cache."""
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    times = time_cpu(lambda: data.sum(), budget_s=budget_s)
    return data.numel() * 4 / statistics.median(times)

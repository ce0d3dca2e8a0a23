"""Progress of a sweep: a tqdm bar on a terminal, one plain line per result otherwise (CI logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from harness.base.results import ArchResult


class Progress:
    """Reports each finished architecture: `start`, then `advance` per result, then `close`.

    On a TTY a bar shows counts and the last architecture, and anything that is not a pass is
    also printed above the bar so it is not lost; elsewhere every result gets one line.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = 0
        self.count = 0
        self._bar = None

    def start(self, total: int, initial: int = 0) -> None:
        """`total` architectures selected, `initial` of them already done (a resume)."""
        self.total, self.count = total, initial
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, unit="arch", file=self.stream, dynamic_ncols=True
            )

    def advance(self, result: ArchResult) -> None:
        self.count += 1
        line = f"{result.architecture}: {result.status} ({result.seconds:.2f} s)"
        if result.status != "pass" and result.message:
            line += f": {result.message}"
        if self._bar is None:
            width = len(str(self.total))
            print(f"[{self.count:>{width}}/{self.total}] {line}", file=self.stream, flush=True)
            return
        if result.status != "pass":
            self._bar.write(line, file=self.stream)
        self._bar.set_postfix_str(result.architecture, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Steps:
    """Reports the steps of one long command (`check`'s build, forwards and lifecycle
    operations) on `stream` (stderr): called with each step as it starts.

    On a terminal one status line is rewritten in place ("check: lifecycle train (2/15),
    41 s") and erased by `close`, so the command's own output stays as it was; elsewhere
    (a CI log, a file) each step is one plain line, nothing more. Never writes to stdout.
    """

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self._shown = False

    def __call__(self, step: str) -> None:
        elapsed = time.perf_counter() - self.started
        line = f"{self.label}: {step}, {elapsed:.0f} s"
        if self.tty:
            self.stream.write(f"\r\x1b[K{line}")
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Erase the status line on a terminal (nothing to do elsewhere)."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

"""Progress of a sweep: a tqdm bar on a terminal, one plain line per result otherwise (CI logs)."""

from __future__ import annotations

import sys
from typing import TextIO

from harness.results import ArchResult


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

"""Warnings raised while a block runs, as short comparable lines (recorded per architecture).

Two channels reach a user: Python's `warnings` (torch's C++ `TORCH_WARN` arrives as one)
and the `logging` records of Transformers and torch at WARNING or above. `capture` collects
both, whatever filters and verbosity the process has set (the sweep's workers silence both
for their terminal output), and without printing anything: the records are the output.

A line is `Category: first line of the message` (`logging.WARNING: ...` for a log record),
hexadecimal addresses replaced by `0x?`, so the same warning from two model objects is one
line. `harness.check` compares the unfused forward's lines with the fused forward's: a line
only the fused model raises is something a user of the fused model sees that a user of the
unfused one does not.

Limits, stated rather than hidden: a warning emitted once per process (Transformers'
`warning_once`, torch's `TORCH_WARN_ONCE`, a Python "once" filter inside library code) is
seen by the first block that triggers it only, so such a line can be missing from a later
block's record; it never appears in one that did not trigger it.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

LOGGERS = ("transformers", "torch")
"""Library loggers whose WARNING records count (their children propagate to them)."""

LIMIT = 20
"""Distinct lines kept per block (the rest are counted in a last line)."""

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def line(category: str, message: object) -> str:
    """The comparable line of one warning: its category and the first line of its message."""
    text = str(message).strip().splitlines()[0] if str(message).strip() else ""
    return f"{category}: {_ADDRESS.sub('0x?', text)[:300]}"


class _Collector(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(line(f"logging.{record.levelname}", record.getMessage()))
        except Exception:  # a record that cannot format itself is not worth a crash
            self.lines.append(line(f"logging.{record.levelname}", record.msg))


@contextmanager
def capture() -> Iterator[list[str]]:
    """Yields a list that holds, once the block exits (normally or by an exception), the
    distinct warning lines the block raised, in order of first appearance.

    The process's warning filters, its library loggers' levels and handlers are restored
    on exit; nothing is printed meanwhile."""
    found: list[str] = []
    logged: list[str] = []
    saved = []
    collector = _Collector(logged)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.handlers[:], logger.propagate))
        logger.handlers = [collector]
        logger.setLevel(logging.WARNING)
        logger.propagate = False
    raw: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield found
            finally:
                raw = [line(w.category.__name__, w.message) for w in caught]
    finally:
        for logger, level, handlers, propagate in saved:
            logger.handlers = handlers
            logger.setLevel(level)
            logger.propagate = propagate
        distinct = list(dict.fromkeys([*raw, *logged]))
        if len(distinct) > LIMIT:
            distinct = [*distinct[:LIMIT], f"... and {len(distinct) - LIMIT} more"]
        found.extend(distinct)


def only_in(lines: list[str], baseline: list[str]) -> list[str]:
    """The lines of `lines` that `baseline` does not hold (truncation lines excepted)."""
    seen = set(baseline)
    return [w for w in lines if w not in seen and not w.startswith("... and ")]

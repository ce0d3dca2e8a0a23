"""Warnings raised while a block runs, as short comparable lines (recorded per architecture).

Two channels reach a user: Python's `warnings` (torch's C++ `TORCH_WARN` arrives as one)
and the `logging` records of Transformers and torch at WARNING or above. `capture` collects
both, whatever filters and verbosity the process has set (the sweep's workers silence both
for their terminal output), and without printing anything: the records are the output.

A line is `Category: first line of the message` (`logging.WARNING: ...` for a log record),
hexadecimal addresses replaced by `0x?`, so the same warning from two model objects is one
line. `harness.runner.arch_check` compares the unfused forward's lines with the fused forward's: a line
only the fused model raises is something a user of the fused model sees that a user of the
unfused one does not.

Each line also keeps where it came from (`Lines.origins`): the dotted module that raised it
(a warning's file, a log record's logger name). A system under test that compiles names the
modules whose warnings are its compiler's own diagnostics (`harness.runner.systems.System.diagnostics`),
which `split_by_origin` sets apart.

Limits, stated rather than hidden: a warning emitted once per process (Transformers'
`warning_once`, torch's `TORCH_WARN_ONCE`, a Python "once" filter inside library code) is
seen by the first block that triggers it only, so such a line can be missing from a later
block's record; it never appears in one that did not trigger it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

LOGGERS = ("transformers", "torch")
"""Library loggers whose WARNING records count, their children's included (those that do not
propagate to them, as torch's `torch._inductor`, are collected where they stop)."""

LIMIT = 20
"""Distinct lines kept per block (the rest are counted in a last line)."""

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def line(category: str, message: object) -> str:
    """The comparable line of one warning: its category and the first line of its message."""
    text = str(message).strip().splitlines()[0] if str(message).strip() else ""
    return f"{category}: {_ADDRESS.sub('0x?', text)[:300]}"


class Lines(list):
    """The distinct lines a block raised (a list of str), and `origins`: line -> the dotted
    module that raised it first ("" when unknown)."""

    def __init__(self, lines: Iterable[str] = (), origins: dict[str, str] | None = None) -> None:
        super().__init__(lines)
        self.origins: dict[str, str] = dict(origins or {})


def module_of(path: str, search: Sequence[str] | None = None) -> str:
    """The dotted module name of source file `path`, read against the import path `search`
    (default `sys.path`; the longest entry that holds it wins); "" when none holds it."""
    full = os.path.abspath(path)
    best = ""
    for entry in sys.path if search is None else search:
        root = os.path.abspath(entry or os.curdir)
        if full.startswith(root + os.sep) and len(root) > len(best):
            best = root
    if not best:
        return ""
    relative = os.path.splitext(full[len(best) + 1 :])[0]
    parts = relative.split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def from_modules(origin: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted module `origin` is one of `prefixes` or inside one of them."""
    return any(origin == p or origin.startswith(p + ".") for p in prefixes)


def split_by_origin(
    lines: Sequence[str], origins: dict[str, str], prefixes: Sequence[str]
) -> tuple[list[str], list[str]]:
    """`lines` -> (those not raised from `prefixes`' modules, those that were), order kept. A
    line whose origin is unknown stays with the first group: only a proven origin sets a
    warning apart."""
    own = [w for w in lines if prefixes and from_modules(origins.get(w, ""), prefixes)]
    return [w for w in lines if w not in own], own


class _Collector(logging.Handler):
    def __init__(self, lines: list[tuple[str, str]]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = line(f"logging.{record.levelname}", record.getMessage())
        except Exception:  # a record that cannot format itself is not worth a crash
            text = line(f"logging.{record.levelname}", record.msg)
        self.lines.append((text, record.name))


def _library_loggers() -> list[logging.Logger]:
    """The `LOGGERS` roots and every logger already made below them."""
    made = logging.Logger.manager.loggerDict
    below = [
        made[name]
        for name in list(made)
        if isinstance(made[name], logging.Logger)
        and name not in LOGGERS
        and from_modules(name, LOGGERS)
    ]
    return [*(logging.getLogger(name) for name in LOGGERS), *below]


@contextmanager
def capture() -> Iterator[Lines]:
    """Yields a `Lines` that holds, once the block exits (normally or by an exception), the
    distinct warning lines the block raised, in order of first appearance, with their
    origins.

    The process's warning filters, its library loggers' levels and handlers are restored
    on exit; nothing is printed meanwhile."""
    found = Lines()
    logged: list[tuple[str, str]] = []
    collector = _Collector(logged)
    saved = [(lg, lg.level, lg.handlers[:], lg.propagate) for lg in _library_loggers()]
    for logger, level, handlers, propagate in saved:
        if logger.name in LOGGERS or level > logging.WARNING:  # a silenced child counts too
            logger.setLevel(logging.WARNING)
        if logger.name in LOGGERS or handlers or not propagate:
            # Every record then reaches the collector exactly once: at the nearest logger
            # that would have stopped or handled it (torch's own `torch._dynamo` and
            # `torch._inductor` loggers do not propagate to `torch`).
            logger.handlers = [collector]
            logger.propagate = False
    raw: list[tuple[str, str]] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield found
            finally:
                raw = [
                    (line(w.category.__name__, w.message), module_of(w.filename)) for w in caught
                ]
    finally:
        for logger, level, handlers, propagate in saved:
            logger.handlers = handlers
            logger.setLevel(level)
            logger.propagate = propagate
        for text, origin in [*raw, *logged]:
            found.origins.setdefault(text, origin)
        distinct = list(found.origins)
        if len(distinct) > LIMIT:
            distinct = [*distinct[:LIMIT], f"... and {len(distinct) - LIMIT} more"]
        found.extend(distinct)


def only_in(lines: list[str], baseline: list[str]) -> list[str]:
    """The lines of `lines` that `baseline` does not hold (truncation lines excepted)."""
    seen = set(baseline)
    return [w for w in lines if w not in seen and not w.startswith("... and ")]

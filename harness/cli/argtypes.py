"""Option parsing shared by every `fusion-harness` command: one-line usage errors and argparse
types that validate ranges, so a value that cannot work (`--tokens 0`, `-j 0`, `--budget -1`)
is refused before anything is built or timed.

Imports nothing but the standard library: `--help` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose usage error is one line on stderr, exit 2.

    "PROG: error: MESSAGE (see `PROG --help`)": the message names the option and the problem
    (argparse writes "argument --tokens: must be at least 1, got 0"); the usage block argparse
    prints before it is left out, so every bad input of every command reads the same. Its
    subparsers are of this class too (argparse makes them with `type(self)`).
    """

    def error(self, message: str) -> NoReturn:
        sys.stdout.flush()
        line = " ".join(message.split())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {line} (see `{self.prog} --help`)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    return _at_least(_int(text), 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    return _at_least(_int(text), 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers of at least 1 ("1,16,128")."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    try:
        values = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated positive integers"
        ) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _at_least(value: int, least: int) -> int:
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value

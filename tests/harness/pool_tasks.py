"""Task handlers for the pool tests (module-level, so worker processes can import them)."""

from __future__ import annotations

import os
import time


def work(payload: tuple[str, object]) -> object:
    """("value", x) -> x; ("pid", _) -> the worker's pid; abort, hang, raise, exit on demand."""
    kind, value = payload
    if kind == "abort":
        os.abort()
    if kind == "hang":
        time.sleep(3600)
    if kind == "raise":
        raise ValueError(value)
    if kind == "exit":
        os._exit(int(value))
    if kind == "pid":
        return os.getpid()
    return value


def broken_setup() -> None:
    raise RuntimeError("setup broke on purpose")

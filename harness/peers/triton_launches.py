"""Count Triton kernel launches, by kernel, while a block runs: did a system's kernels run?

A patch that replaces a model's forwards but never launches a kernel (a path that falls back
to torch, a replaced module that is never called) would pass every parity check while
testing nothing. `counting(prefix)` wraps the launch entry of Triton's compiled kernels
(`JITFunction.run`) and of interpreted ones (`InterpretedFunction.run`) and counts every
launch of a kernel whose module starts with `prefix` (`liger_kernel.`). An autotuned kernel
launches through its inner function's `run`, so it is counted once per launch too.

Fail closed: the wrappers count and then call the original; both are put back on exit, also
after an error; where Triton does not import nothing is counted (and the caller sees zero).
"""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

LAUNCHERS = (
    ("triton.runtime.jit", "JITFunction"),
    ("triton.runtime.interpreter", "InterpretedFunction"),
)
"""(module, class) whose `run` is the launch of one kernel grid."""


def kernel_name(kernel: Any) -> str:
    """`module.function` of a jitted kernel (its Python function's), "" when unknown."""
    fn = getattr(kernel, "fn", None)
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__name__", None) or ""
    return f"{module}.{name}" if module and name else ""


@contextlib.contextmanager
def counting(prefix: str) -> Iterator[Counter[str]]:
    """Yield a Counter {kernel name: launches} of the kernels under `prefix` launched inside
    the block (warm-up calls that launch nothing are not counted)."""
    launches: Counter[str] = Counter()
    saved: list[tuple[type, Callable[..., Any]]] = []
    try:
        for module_name, class_name in LAUNCHERS:
            try:
                owner = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                continue
            saved.append((owner, owner.__dict__["run"]))
            owner.run = _counted(owner.__dict__["run"], prefix, launches)
        yield launches
    finally:
        for owner, run in reversed(saved):
            owner.run = run


def _counted(run: Callable[..., Any], prefix: str, launches: Counter[str]) -> Callable[..., Any]:
    """`run` that counts a launch (not a warm-up) of a kernel under `prefix`, then runs."""

    def counted_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = kernel_name(self)
        if name.startswith(prefix) and not kwargs.get("warmup", False):
            launches[name] += 1
        return run(self, *args, **kwargs)

    return counted_run

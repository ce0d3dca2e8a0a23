"""Comparisons the fuzzing oracle makes: relative errors with NaN as a value, snapshots of
everything a forward may mutate, and the structure that must not change when nothing is applied.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

from fusion import numerics

# -- comparisons ----------------------------------------------------------------------------------


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """`fusion.numerics.relative_error` with NaN as a value (`matching_nans`): the unfused
    output of a generated module may hold NaN, and the fused one must hold it in the same
    places. Infinite when shapes, dtypes or NaN positions differ, or where the measure says
    NaN (never a NaN here: `max` over errors must see the worst); exact for integer tensors."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return math.inf
    if not expected.is_floating_point():
        return 0.0 if torch.equal(expected, actual) else math.inf
    error = numerics.relative_error(actual.detach(), expected.detach(), matching_nans=True)
    return math.inf if math.isnan(error) else error


def state(value: Any, depth: int = 0) -> Any:
    """A comparable snapshot of everything reachable from `value`: tensors (cloned), and
    the contents of containers and plain objects (a KV cache's attributes)."""
    if depth > 6:
        return repr(type(value))
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [state(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {key: state(item, depth + 1) for key, item in value.items()}
    if isinstance(value, nn.Module):
        return f"<{type(value).__name__}>"
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {key: state(item, depth + 1) for key, item in vars(value).items()}
    return value


def compare(expected: Any, actual: Any, where: str = "") -> tuple[float, str]:
    """The largest relative error between two snapshots and where it occurs."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return math.inf, f"{where or 'value'}: tensor vs {type(actual).__name__}"
        return relative_error(expected, actual), where or "value"
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return math.inf, f"{where}: {len(expected)} vs {len(actual)} items"
        worst: tuple[float, str] = (0.0, where)
        for index, (a, b) in enumerate(zip(expected, actual)):
            worst = max(worst, compare(a, b, f"{where}[{index}]"), key=lambda pair: pair[0])
        return worst
    if isinstance(expected, dict) and isinstance(actual, dict):
        if expected.keys() != actual.keys():
            return math.inf, f"{where}: keys {sorted(expected)} vs {sorted(actual)}"
        worst = (0.0, where)
        for key in expected:
            worst = max(
                worst, compare(expected[key], actual[key], f"{where}.{key}"), key=lambda p: p[0]
            )
        return worst
    return (
        (0.0, where) if expected == actual else (math.inf, f"{where}: {expected!r} vs {actual!r}")
    )


def structure(module: nn.Module) -> list[tuple[str, type, tuple[str, ...], bool]]:
    """What must not change when nothing is applied: every submodule's name, type, own
    parameter/buffer names, and whether it has an instance-level forward."""
    return [
        (
            name,
            type(child),
            tuple(
                n
                for n, _ in itertools.chain(
                    child.named_parameters(recurse=False), child.named_buffers(recurse=False)
                )
            ),
            "forward" in child.__dict__,
        )
        for name, child in module.named_modules()
    ]


def same_state(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold the same state-dict keys and bit-identical tensors."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

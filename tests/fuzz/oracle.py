"""The fuzzing oracle: import a generated module, fuse a copy, and judge the result.

`check(generated, seed)` answers one question per example: after `fusion.fuse`, is the
module either untouched, or computing the same function? Concretely, with float32 weights
and fresh random inputs:

- `fusion.fuse` returns (never raises);
- when nothing was applied, the module is exactly as it was (children, parameters, no
  instance-level forward);
- the fused forward does not raise where the unfused one did not;
- every output agrees with the unfused output to a relative error of `TOLERANCE`, and so
  does every input the forward mutates (tensors, and the state of objects such as a KV
  cache passed in).

Forwards run with autograd enabled (the default mode a user calls a model in), which is the
stricter mode: in-place writes to views are checked there.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import linecache
import math
import sys
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

import fusion
from fusion import numerics, registry
from fusion.report import FusionReport
from tests.fuzz.strategies import SHAPES, GeneratedModule

TOLERANCE = 1e-5
"""Largest relative error (max |fused - unfused| / max |unfused|) a fused output may show."""

FAILURE_KINDS = (
    "fuse-error",  # fusion.fuse raised
    "refused-but-changed",  # nothing applied, yet the module changed
    "fused-forward-error",  # the fused forward raised where the unfused one did not
    "module-parity",  # an output differs beyond TOLERANCE
    "input-state",  # an input the forward mutates ends in a different state
)

_COUNTER = itertools.count()


@dataclass(frozen=True)
class Failure:
    """Why one example violates the fusion property."""

    kind: str
    message: str
    detail: str = ""
    observed: float | None = None
    tolerance: float | None = None

    @property
    def signature(self) -> str:
        """What makes two failures "the same" for de-duplicating repro bundles."""
        return f"{self.kind}|{self.message.splitlines()[0][:120]}"


@dataclass
class Outcome:
    """The verdict on one example: `status` is fused, refused or crashed (the unfused
    forward itself raised: a generator bug, counted but not a fusion failure)."""

    status: str
    report: FusionReport | None = None
    failure: Failure | None = None
    crash: str = ""

    @property
    def fusers(self) -> tuple[str, ...]:
        return tuple(sorted({r.fuser for r in self.report.applied})) if self.report else ()


# -- loading --------------------------------------------------------------------------------------


@contextmanager
def loaded(generated: GeneratedModule, directory: Path) -> Iterator[ModuleType]:
    """Write `generated.source` to a uniquely named file in `directory`, import it, and
    forget it afterwards (module table, line cache, file, fusion's match cache), so that
    thousands of examples do not accumulate memory."""
    name = f"fuzz_generated_{next(_COUNTER)}"
    path = directory / f"{name}.py"
    path.write_text(generated.source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        linecache.cache.pop(str(path), None)
        path.unlink(missing_ok=True)
        registry.clear_cache()


def build(module: ModuleType, seed: int) -> nn.Module:
    """The generated module's `build()`, with weights drawn from `seed`."""
    torch.manual_seed(seed)
    built = module.build()
    built.float()
    return built


def make_inputs(module: ModuleType, seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh random inputs for one forward, from `seed`."""
    return module.make_inputs(torch.Generator().manual_seed(seed + 1))


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


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _plan(module: nn.Module) -> FusionReport | None:
    """What `fusion.plan` decides for a copy (the forward sources for a repro bundle when
    `fuse` itself raised), or None when planning raises too."""
    try:
        return fusion.plan(copy.deepcopy(module))
    except Exception:
        return None


def _tail(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])


# -- the check ------------------------------------------------------------------------------------


def check(generated: GeneratedModule, seed: int, directory: Path) -> Outcome:
    """Build, fuse a deep copy, run both on the same fresh inputs, and judge."""
    with loaded(generated, directory) as module:
        original = build(module, seed)
        fused = copy.deepcopy(original)
        before = structure(fused)
        try:
            report = fusion.fuse(fused)
        except Exception as exc:
            failure = Failure("fuse-error", f"{type(exc).__name__}: {exc}", _tail(exc))
            return Outcome("fused", _plan(original), failure)
        status = "fused" if report.applied else "refused"
        if not report.applied and (structure(fused) != before or not _same_state(original, fused)):
            return Outcome(
                status,
                report,
                Failure("refused-but-changed", "nothing was applied but the module changed"),
            )
        args, kwargs = make_inputs(module, seed)
        args_fused, kwargs_fused = copy.deepcopy((args, kwargs))
        try:
            expected = original(*args, **kwargs)
        except Exception as exc:
            return Outcome("crashed", report, crash=f"{type(exc).__name__}: {exc}")
        try:
            actual = fused(*args_fused, **kwargs_fused)
        except Exception as exc:
            return Outcome(
                status,
                report,
                Failure("fused-forward-error", f"{type(exc).__name__}: {exc}", _tail(exc)),
            )
        error, where = compare(state(expected), state(actual), "output")
        if error > TOLERANCE:
            return Outcome(
                status,
                report,
                Failure(
                    "module-parity",
                    f"{where} differs (relative error {error:.3g})",
                    observed=error,
                    tolerance=TOLERANCE,
                ),
            )
        error, where = compare(state((args, kwargs)), state((args_fused, kwargs_fused)), "inputs")
        if error > TOLERANCE:
            return Outcome(
                status,
                report,
                Failure(
                    "input-state",
                    f"{where} ends in another state (relative error {error:.3g})",
                    observed=error,
                    tolerance=TOLERANCE,
                ),
            )
        return Outcome(status, report)


# -- the tally ------------------------------------------------------------------------------------


@dataclass
class Tally:
    """fused / refused / crashed counts per shape, for all modules and for safe ones, and
    which fusers applied. Shared by the property tests and the pytest terminal summary.

    A module counts as fused when any fuser applied anywhere in it (a decoder layer whose
    norms fused counts, whatever its attention did); `fusers` says which. When a property
    fails, the calls Hypothesis makes while shrinking are counted too."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    fusers: dict[str, Counter[str]] = field(default_factory=dict)

    def record(self, generated: GeneratedModule, outcome: Outcome) -> None:
        row = self.counts.setdefault(generated.shape, Counter())
        row[outcome.status] += 1
        row["examples"] += 1
        if generated.safe:
            row["safe"] += 1
            row[f"safe_{outcome.status}"] += 1
        if outcome.failure is not None:
            row["failures"] += 1
        for name in outcome.fusers:
            self.fusers.setdefault(generated.shape, Counter())[name] += 1

    def merge(self, other: dict[str, Any]) -> None:
        """Add a `to_json()` dict (e.g. from an xdist worker)."""
        for shape, row in other.get("counts", {}).items():
            self.counts.setdefault(shape, Counter()).update(row)
        for shape, row in other.get("fusers", {}).items():
            self.fusers.setdefault(shape, Counter()).update(row)

    def safe_fused_ratio(self, shape: str) -> float:
        row = self.counts.get(shape, Counter())
        return row["safe_fused"] / row["safe"] if row["safe"] else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": {shape: dict(row) for shape, row in self.counts.items()},
            "fusers": {shape: dict(row) for shape, row in self.fusers.items()},
            "safe_fused_ratio": {shape: self.safe_fused_ratio(shape) for shape in self.counts},
        }

    def lines(self) -> list[str]:
        """A small table: one row per shape."""
        out = [
            f"{'shape':<14}{'examples':>9}{'fused':>7}{'refused':>8}{'crashed':>8}{'failed':>7}"
            f"{'safe':>6}{'safe fused':>11}  fusers"
        ]
        for shape in [s for s in SHAPES if s in self.counts] + sorted(
            set(self.counts) - set(SHAPES)
        ):
            row = self.counts[shape]
            fusers = ", ".join(f"{k}={v}" for k, v in sorted(self.fusers.get(shape, {}).items()))
            out.append(
                f"{shape:<14}{row['examples']:>9}{row['fused']:>7}{row['refused']:>8}"
                f"{row['crashed']:>8}{row['failures']:>7}{row['safe']:>6}"
                f"{self.safe_fused_ratio(shape):>10.0%}  {fusers}"
            )
        return out


SESSION_TALLY = Tally()
"""Every example checked in this process (printed at the end of the pytest session)."""


def outcome_summary(outcome: Outcome) -> dict[str, Any]:
    """A JSON-ready summary of an outcome (for bundles and notes)."""
    report = outcome.report
    return {
        "status": outcome.status,
        "failure": dataclasses.asdict(outcome.failure) if outcome.failure else None,
        "applied": [
            {"qualname": r.qualname, "fuser": r.fuser, "description": r.description}
            for r in (report.applied if report else [])
        ],
        "skipped": [
            {"qualname": r.qualname, "fuser": r.fuser, "reason": r.reason}
            for r in (report.skipped if report else [])
        ],
    }

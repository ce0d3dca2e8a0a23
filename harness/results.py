"""Result records of a sweep and their JSON Lines file.

One `ArchResult` per architecture, appended to the results file as soon as it is known, one
JSON object per line written with a single `write` and flushed: a crash or Ctrl-C loses at most
the line being written, and `read_results` skips such a torn last line. Non-finite floats are
stored as the strings "nan"/"inf"/"-inf" so every line is strict JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

STATUSES = (
    "pass",  # parity green (model and every fused module)
    "inconclusive",  # nothing failed, but something could not be judged (see message)
    "fail",  # parity failure: model logits or a fused module out of tolerance, or NaN
    "fused-error",  # the fused model's forward raised
    "fuse-error",  # fusion.fuse raised
    "forward-error",  # the unfused or float64 forward raised: the model itself does not run
    "build-error",  # the tiny model could not be built (or its inputs made)
    "crashed",  # the worker process died (segfault, abort, OOM kill)
    "timeout",  # the worker exceeded the per-architecture timeout and was killed
)

GREEN = frozenset({"pass"})
FUSION_FAILURES = frozenset({"fail", "fused-error", "fuse-error"})
UNEXPECTED = frozenset({"forward-error", "build-error", "crashed", "timeout"})
"""Statuses that make a sweep red although no parity check failed: the corpus promises that
every architecture it lists builds and runs, and a worker death is never expected."""


@dataclass(frozen=True)
class ModuleResult:
    """The per-module verdict of one fused module (see `harness.localise`)."""

    qualname: str
    source_class: str
    fuser: str
    status: str
    fused_error: float
    unfused_error: float
    tolerance: float
    reason: str = ""
    calls: int = 0


@dataclass(frozen=True)
class Refusal:
    """Skipped records of one (fuser, class, reason), counted; `example` is one qualname."""

    fuser: str | None
    source_class: str
    reason: str
    count: int
    example: str


@dataclass(frozen=True)
class Failure:
    """One thing a fix must address; each becomes (at most) one repro bundle.

    `kind` is one of fuse-error, fused-forward-error, model-parity, module-parity,
    module-error; `detail` is the traceback tail when something raised. `signature` identifies "the same failure" for de-duplication and replay
    (architecture-independent; layer indices folded). `bundle` is the bundle directory
    written for it, if any.
    """

    kind: str
    qualname: str | None
    fuser: str | None
    source_class: str | None
    message: str
    detail: str = ""
    observed: float | None = None
    tolerance: float | None = None
    signature: str = ""
    bundle: str | None = None


@dataclass(frozen=True)
class ArchResult:
    """Everything the sweep records about one architecture."""

    architecture: str
    status: str
    dtype: str
    device: str
    seed: int
    seconds: float
    message: str = ""
    applied: dict[str, int] = field(default_factory=dict)
    applied_by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    """{module class: {fuser: instances}} of the applied fusions (the plan, harness.plans)."""
    refusals: list[Refusal] = field(default_factory=list)
    unfused_error: float | None = None
    fused_error: float | None = None
    tolerance: float | None = None
    modules: list[ModuleResult] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def built(self) -> bool:
        return self.status not in {"build-error", "crashed", "timeout"}

    @property
    def ran(self) -> bool:
        """The unfused model ran (fusion is applied before the forwards, see harness.check)."""
        return self.built and self.status not in {"fuse-error", "forward-error"}

    @property
    def fusions(self) -> int:
        return sum(self.applied.values())


class ResultsError(ValueError):
    """A results file that cannot be used (bad line, other dtype/device/seed)."""


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats (also inside dicts and lists) as "nan"/"inf"/"-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def to_dict(result: ArchResult) -> dict[str, Any]:
    """A strict-JSON-safe dict of the result (non-finite floats as strings)."""
    return json_safe(dataclasses.asdict(result))


def to_json_line(result: ArchResult) -> str:
    return json.dumps(to_dict(result), allow_nan=False, sort_keys=False) + "\n"


def from_dict(data: dict[str, Any]) -> ArchResult:
    """Rebuild a result from `to_dict` output; raises ResultsError naming the bad field."""
    try:
        numbers = {k: _number(data.get(k)) for k in ("unfused_error", "fused_error", "tolerance")}
        modules = [
            ModuleResult(
                **{
                    **m,
                    **{k: float(m[k]) for k in ("fused_error", "unfused_error", "tolerance")},
                }
            )
            for m in data.get("modules", [])
        ]
        failures = [
            Failure(
                **{
                    **f,
                    "observed": _number(f.get("observed")),
                    "tolerance": _number(f.get("tolerance")),
                }
            )
            for f in data.get("failures", [])
        ]
        refusals = [Refusal(**r) for r in data.get("refusals", [])]
        rest = {
            k: v for k, v in data.items() if k not in {"modules", "failures", "refusals", *numbers}
        }
        return ArchResult(**rest, **numbers, modules=modules, failures=failures, refusals=refusals)
    except (TypeError, KeyError, ValueError) as exc:
        raise ResultsError(f"not a result record: {exc}") from None


def read_results(path: Path) -> list[ArchResult]:
    """Every complete result in a JSONL file, in file order.

    A torn final line (the process died mid-write) is ignored; a bad line anywhere else raises
    ResultsError with its line number, since silently dropping it would re-run or lose work.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    results = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            results.append(from_dict(json.loads(line)))
        except (json.JSONDecodeError, ResultsError) as exc:
            if number == len(lines):
                break  # torn last line: the writer was interrupted mid-line
            raise ResultsError(f"{path}:{number}: {exc}") from None
    return results


class ResultsWriter:
    """Appends results to a JSONL file, one flushed line each.

    Opened in append mode for a resume; a fresh run truncates. A torn last line left by an
    earlier crash is cut off first, so appended lines never join onto it.
    """

    def __init__(self, path: Path, *, append: bool) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if append and path.exists():
            _drop_torn_tail(path)
        self._file: IO[str] = path.open("a" if append else "w", encoding="utf-8")

    def write(self, result: ArchResult) -> None:
        self._file.write(to_json_line(result))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_torn_tail(path: Path) -> None:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])

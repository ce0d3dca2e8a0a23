"""Result records of a sweep and their JSON Lines file.

One `ArchResult` per architecture, appended to the results file as soon as it is known, one
JSON object per line written with a single `write` and flushed: a crash or Ctrl-C loses at most
the line being written, and `read_results` skips such a torn last line (one without its
newline). Non-finite floats are stored as the strings "nan"/"inf"/"-inf" so every line is
strict JSON.

A results file is input as well as output (`--resume` reads it back), so every line is
validated field by field (`from_dict`): a wrong type, an unknown status or a foreign JSON
document is a `ResultsError` naming the line and the field, never a traceback later on. One
sweep writes a file at a time: `ResultsWriter` holds an exclusive lock on it (see there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from harness.base.errors import InputError

try:  # POSIX only; elsewhere a results file is not locked (see ResultsWriter)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

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
    "compile-error",  # an Inductor system: compiling (or the compiled forward) raised
)

GREEN = frozenset({"pass"})
FUSION_FAILURES = frozenset({"fail", "fused-error", "fuse-error", "compile-error"})
"""Fusion broke something the unfused model does: parity (logits, a fused module or a
lifecycle operation, harness.runner.arch_check records those as "fail"), the fused forward, fusion.fuse.
For another system under test (harness.runner.systems) the same statuses are that system's failures,
and "compile-error" is torch.compile raising where the eager model runs."""
CORPUS_PROBLEMS = frozenset({"build-error", "forward-error"})
"""The unfused side cannot be built or run (the tiny model, its inputs, the unfused or float64
forward): a problem of the corpus on this Transformers release, never one of fusion, whose
code has not run yet (build) or is not involved (the unfused forward)."""
WORKER_DEATHS = frozenset({"crashed", "timeout"})
"""The worker died or hung: nothing says on which side, so it counts as a fusion failure
(fail closed; a native kernel can crash a process)."""
UNEXPECTED = CORPUS_PROBLEMS | WORKER_DEATHS
"""Statuses that make a sweep red although no parity check failed: the corpus promises that
every architecture it lists builds and runs, and a worker death is never expected."""

LIFECYCLE_VERDICTS = ("pass", "fail", "n/a")
"""Verdicts of a lifecycle check (`ArchResult.lifecycle`: generate, a training step, save and
load, ... after fusing; see docs/design.md, oracle 6)."""


@dataclass(frozen=True)
class ModuleResult:
    """The per-module verdict of one fused module (see `harness.oracles.localise`)."""

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
    module-error, lifecycle, fused-warning (`harness.runner.repro.KINDS`); `detail` is the traceback
    tail when something raised. `signature` identifies "the same failure" for de-duplication
    and replay (architecture-independent; layer indices folded). `bundle` is the bundle directory
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
    """{module class: {fuser: instances}} of the applied fusions (the plan, harness.reporting.plans)."""
    refusals: list[Refusal] = field(default_factory=list)
    unfused_error: float | None = None
    fused_error: float | None = None
    tolerance: float | None = None
    modules: list[ModuleResult] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    lifecycle: dict[str, dict[str, str]] = field(default_factory=dict)
    """{operation: {"verdict": "pass"|"fail"|"n/a", "detail": str}} of the lifecycle checks
    (empty when none ran)."""
    versions: dict[str, str] = field(default_factory=dict)
    """{"transformers": ..., "torch": ...} of the process that judged it (stamped by the sweep;
    empty in records written before it was, or made outside a sweep): `merge` refuses to mix
    results of different versions, and `report` picks the golden line by it."""
    kernels: list[str] = field(default_factory=list)
    """Which kernel each fused product runs on this machine at decode and prefill sizes,
    and why (`fusion.FusionReport.kernels`, one line per distinct product)."""
    machine: dict[str, str] = field(default_factory=dict)
    """What decided those kernels: CPU, ATen capability, native kernel status, kernel policy
    mode and calibration table (`fusion.kernels.policy.describe`)."""
    warnings: dict[str, list[str]] = field(default_factory=dict)
    """Warning lines (harness.oracles.warned) by where they were raised: `unfused` (the unfused
    forward), `fusing` (the system under test preparing the model), `fused-only` (the fused
    forward, lines the unfused forward did not raise), `compiler` (of those, the ones raised
    from the system's own diagnostics modules, `harness.runner.systems.System.diagnostics`: named,
    not a failure); empty lists left out."""
    system: str = "fusion"
    """The system under test that was judged (harness.runner.systems); "fusion" in records written
    before systems existed."""

    @property
    def built(self) -> bool:
        return self.status not in {"build-error", "crashed", "timeout"}

    @property
    def corpus_problem(self) -> bool:
        """The unfused model could not be built or run (see CORPUS_PROBLEMS)."""
        return self.status in CORPUS_PROBLEMS

    @property
    def fusion_failure(self) -> bool:
        """A fusion failure or a worker death, which the exit status counts as one."""
        return self.status in FUSION_FAILURES | WORKER_DEATHS

    @property
    def ran(self) -> bool:
        """The unfused model ran (fusion is applied before the forwards, see harness.runner.arch_check)."""
        return self.built and self.status not in {"fuse-error", "forward-error"}

    @property
    def fusions(self) -> int:
        return sum(self.applied.values())


class ResultsError(ValueError, InputError):
    """A results file that cannot be used (bad line, other dtype/device/seed, locked, not
    writable); the message is one line meant for the user."""


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats (also inside dicts and lists) as "nan"/"inf"/"-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def to_dict(result: ArchResult) -> dict[str, Any]:
    """A strict-JSON-safe dict of the result (non-finite floats as strings)."""
    return json_safe(dataclasses.asdict(result))


def to_json_line(result: ArchResult) -> str:
    return json.dumps(to_dict(result), allow_nan=False, sort_keys=False) + "\n"


# ------------------------------------------------------------------------------ validation


class _Bad(Exception):
    """A field that does not fit the schema (caught in `from_dict`, never escapes)."""


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{where} must be a string, found {_kind(value)}")
    return value


def _optional_string(where: str, value: Any) -> str | None:
    return None if value is None else _string(where, value)


def _integer(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{where} must be an integer, found {_kind(value)}")
    return value


def _number(where: str, value: Any) -> float:
    """A float from a JSON number or the strings "nan"/"inf"/"-inf" (how json_safe wrote it)."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"{where} must be a number, found {_kind(value)} {_short(value)}")
    return float(value)


def _optional_number(where: str, value: Any) -> float | None:
    return None if value is None else _number(where, value)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else ""
    return text if len(text) <= 40 else text[:37] + "..."


def _mapping(where: str, value: Any, item: Callable[[str, Any], Any]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{where} must be an object, found {_kind(value)}")
    return {k: item(f"{where}[{k!r}]", v) for k, v in value.items()}


def _array(where: str, value: Any, item: Callable[[str, Any], Any]) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"{where} must be an array, found {_kind(value)}")
    return [item(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _record(
    where: str,
    value: Any,
    cls: type,
    fields: dict[str, Callable[[str, Any], Any]],
    required: tuple[str, ...],
) -> Any:
    """`cls(**checked fields)` from a JSON object; unknown or missing fields are errors."""
    if not isinstance(value, dict):
        raise _Bad(f"{where} must be an object, found {_kind(value)}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise _Bad(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}")
    missing = [name for name in required if name not in value]
    if missing:
        raise _Bad(f"{where} lacks field(s) {', '.join(map(repr, missing))}")
    return cls(**{k: check(f"{where}.{k}", value[k]) for k, check in fields.items() if k in value})


def _status(where: str, value: Any) -> str:
    if _string(where, value) not in STATUSES:
        raise _Bad(f"{where} is {_short(value)}, not one of {', '.join(STATUSES)}")
    return value


def _lifecycle_entry(where: str, value: Any) -> dict[str, str]:
    entry = _record(
        where, value, dict, {"verdict": _string, "detail": _string}, ("verdict", "detail")
    )
    if entry["verdict"] not in LIFECYCLE_VERDICTS:
        raise _Bad(f"{where}.verdict is {_short(entry['verdict'])}, not one of pass, fail, n/a")
    return entry


def _counts(where: str, value: Any) -> dict[str, int]:
    return _mapping(where, value, _integer)


_MODULE = {
    "qualname": _string,
    "source_class": _string,
    "fuser": _string,
    "status": _string,
    "fused_error": _number,
    "unfused_error": _number,
    "tolerance": _number,
    "reason": _string,
    "calls": _integer,
}
_REFUSAL = {
    "fuser": _optional_string,
    "source_class": _string,
    "reason": _string,
    "count": _integer,
    "example": _string,
}
_FAILURE = {
    "kind": _string,
    "qualname": _optional_string,
    "fuser": _optional_string,
    "source_class": _optional_string,
    "message": _string,
    "detail": _string,
    "observed": _optional_number,
    "tolerance": _optional_number,
    "signature": _string,
    "bundle": _optional_string,
}
_RESULT: dict[str, Callable[[str, Any], Any]] = {
    "architecture": _string,
    "status": _status,
    "dtype": _string,
    "device": _string,
    "seed": _integer,
    "seconds": _number,
    "message": _string,
    "applied": _counts,
    "applied_by_class": lambda w, v: _mapping(w, v, _counts),
    "refusals": lambda w, v: _array(
        w, v, lambda w2, v2: _record(w2, v2, Refusal, _REFUSAL, tuple(_REFUSAL))
    ),
    "unfused_error": _optional_number,
    "fused_error": _optional_number,
    "tolerance": _optional_number,
    "modules": lambda w, v: _array(
        w, v, lambda w2, v2: _record(w2, v2, ModuleResult, _MODULE, tuple(_MODULE)[:7])
    ),
    "failures": lambda w, v: _array(
        w, v, lambda w2, v2: _record(w2, v2, Failure, _FAILURE, tuple(_FAILURE)[:5])
    ),
    "lifecycle": lambda w, v: _mapping(w, v, _lifecycle_entry),
    "versions": lambda w, v: _mapping(w, v, _string),
    "kernels": lambda w, v: _array(w, v, _string),
    "machine": lambda w, v: _mapping(w, v, _string),
    "warnings": lambda w, v: _mapping(w, v, lambda w2, v2: _array(w2, v2, _string)),
    "system": _string,
}
_RESULT_REQUIRED = ("architecture", "status", "dtype", "device", "seed", "seconds")


def from_dict(data: Any) -> ArchResult:
    """Rebuild a result from `to_dict` output, checking every field's JSON type.

    Returns the ArchResult; raises ResultsError naming the first field that does not fit
    (a non-object, a missing or unknown field, a wrong type, an unknown status), so a damaged
    or foreign file is refused before anything is computed from it.
    """
    try:
        return _record("record", data, ArchResult, _RESULT, _RESULT_REQUIRED)
    except _Bad as exc:
        raise ResultsError(f"not a result record: {exc}") from None


# ------------------------------------------------------------------------------- the file


def _regular_or_absent(path: Path) -> bool:
    """Is `path` a regular file or nothing at all (following symlinks)?"""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except FileNotFoundError:
        return True


def read_results(path: Path) -> list[ArchResult]:
    """Every complete result in a JSONL file, in file order.

    A torn final line (no newline: the process died mid-write) is ignored. Any other bad line,
    the last complete one included, raises ResultsError with its line number: silently
    dropping it would re-run or lose work, and appending after it would leave the damage in
    the middle of the file. A path that is not a regular file (a directory, a FIFO, a device
    that never ends) is refused before it is read.
    """
    if not path.exists():
        raise ResultsError(f"{path}: no such results file")
    if not _regular_or_absent(path):
        raise ResultsError(f"{path} is not a regular file, so not a results file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ResultsError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline, else an unfinished line
    del torn  # only ever the interrupted write of the last result: skipped by design
    results = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            results.append(from_dict(json.loads(raw.decode("utf-8"))))
        except UnicodeDecodeError:
            raise ResultsError(_bad_line(path, number, "not UTF-8 text")) from None
        except json.JSONDecodeError as exc:
            raise ResultsError(_bad_line(path, number, f"not JSON ({exc.msg})")) from None
        except (ResultsError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ResultsError(_bad_line(path, number, reason)) from None
    return results


def _bad_line(path: Path, number: int, reason: str) -> str:
    hint = (
        "; is it a fusion-harness results file?"
        if number == 1
        else "; fix or delete that line, or start a fresh file with --results"
    )
    return f"{path}:{number}: {reason}{hint}"


class ResultsWriter:
    """Appends results to a JSONL file, one flushed line each, as the file's only writer.

    The file is opened without truncating and locked (an exclusive `flock`, released by the
    kernel however the process ends) before anything else: a second sweep on the same file
    gets a ResultsError instead of truncating, interleaving or re-running the first one's
    work. Then a fresh run truncates; a resume cuts a torn last line left by an earlier crash,
    so appended lines never join onto it. Only regular files are accepted (a results file is
    re-read by --resume); failures to open, lock, read or write are ResultsError with the
    reason. A resume's earlier results are in `previous`.
    """

    def __init__(self, path: Path, *, append: bool) -> None:
        self.path = path
        if not _regular_or_absent(path):
            raise ResultsError(f"{path} is not a regular file; --results needs a file path")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Read and append: a resume re-reads the tail; writes always land at the end.
            self._file: IO[bytes] = path.open("a+b")
        except OSError as exc:
            raise ResultsError(f"cannot write results file {path}: {_why(exc)}") from None
        self.previous: list[ArchResult] = []
        """The results already in the file (a resume), read and validated under the lock."""
        try:
            self._lock()
            if append:
                # Validate before changing anything: a file that is not a results file (or
                # has a bad line) is refused untouched, not cut at its "torn" last line.
                self.previous = read_results(path)
                _drop_torn_tail(self._file)
            else:
                self._file.truncate(0)
        except BaseException:
            self._file.close()
            raise

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover - no advisory locks here: one sweep per file, please
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise ResultsError(
                    f"{self.path} is being written by another sweep; wait for it to finish, "
                    "or give this one another --results file"
                ) from None
            raise ResultsError(f"cannot lock results file {self.path}: {_why(exc)}") from None

    def write(self, result: ArchResult) -> None:
        """Append one result as one line; ResultsError (the file keeps its earlier lines,
        at worst a torn last line that a resume cuts) if the file system refuses it."""
        try:
            self._file.write(to_json_line(result).encode("utf-8"))
            self._file.flush()
        except OSError as exc:
            raise ResultsError(f"cannot write results file {self.path}: {_why(exc)}") from None

    def close(self) -> None:
        # A failed flush at close (a full disk) must not mask the error already reported.
        with contextlib.suppress(OSError):
            self._file.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _why(exc: OSError) -> str:
    """The system's words for an OSError ("No space left on device"), without the path."""
    if exc.errno is not None:
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


def _drop_torn_tail(file: IO[bytes]) -> None:
    """Cut everything after the last newline of the open (locked) file."""
    file.seek(0)
    data = file.read()
    if data and not data.endswith(b"\n"):
        file.truncate(data.rfind(b"\n") + 1)

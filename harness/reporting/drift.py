"""Drift: what a run fuses that a golden plan of another (or the same) Transformers line did not,
and what it no longer fuses, per module class, with the reasons the fusers recorded.

A Transformers release without a golden plan (corpus/expected/<line>.json, harness.reporting.plans) is
still judged: `reference_line` picks the nearest line that has one (the newest older line, so
a new release is judged against the one before it; else the oldest newer line), and `drift`
compares this run's plan entries with it. A *loss* is a (module class, fuser) that the
reference fuses on more instances than this run; a *gain* the reverse. Each loss carries its
reasons: this run's refusals of that class (the fuser's own first, with the full reason the
fuser recorded), the fuser that took the class instead, or why there is no plan at all (the
architecture did not build or fuse). A loss with no recorded refusal says so: that a fuser
skipped a candidate silently is itself a finding.

Only architectures this run holds are compared (a run of `--arch llama` judges llama), and
only under the golden options (harness.reporting.plans.GOLDEN_OPTIONS): plans made under another
dtype or device are not comparable. Pure functions over parsed results and golden files;
`fusion-harness run` prints `format_drift` and exits EXIT_DRIFT_LOSS on a loss when asked
(`--fail-on-drift-loss`), `fusion-harness report` renders the same data as Markdown.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.base.results import ArchResult
from harness.reporting import plans

EXIT_DRIFT_LOSS = 4
"""Exit status of a sweep with no fusion failure whose plan lost fusions against its reference
golden plan, under `--fail-on-drift-loss` (distinct from 1: nothing fusion did was found
wrong; fusion reaches less than it did)."""

REASON_WIDTH = 400
"""A reason is cut to this many characters in text output (full reasons hold graph dumps)."""

SILENT = "no refusal recorded for this class (a fuser skipped it without a reason: report it)"


@dataclass(frozen=True)
class ClassDrift:
    """One (module class, fuser) whose fused instances changed: `before` in the reference plan,
    `after` in this run, over `architectures`; `reasons` say why (for a loss: this run's
    refusals of the class, the fuser that took it instead, or why no plan was made)."""

    cls: str
    fuser: str
    before: int
    after: int
    architectures: tuple[str, ...]
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Drift:
    """This run against one golden file.

    `own` is True when the file is the golden plan of the run's own line (then any change is
    also a conformance failure, tests/conformance); `losses` and `gains` per (class, fuser);
    `statuses`: "<architecture>: <status> (was <status>)" lines of architectures whose status
    changed; `new`: architectures the reference does not hold; `compared`: architectures held
    by both.
    """

    path: str
    reference_line: str
    line: str
    own: bool
    compared: int
    losses: list[ClassDrift] = field(default_factory=list)
    gains: list[ClassDrift] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- the reference


def _line_key(line: str) -> tuple[int, int]:
    major, minor = line.split(".")
    return int(major), int(minor)


def golden_lines(directory: Path) -> list[str]:
    """The "major.minor" lines that have a golden file in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    lines = [p.stem for p in directory.glob("*.json") if re.fullmatch(r"\d+\.\d+", p.stem)]
    return sorted(lines, key=_line_key)


def reference_line(line: str, available: Sequence[str]) -> str | None:
    """The line whose golden plan judges `line`: itself when it has one, else the newest older
    line (a new release is judged against the one before it), else the oldest newer line;
    None when there is no golden plan at all."""
    if line in available:
        return line
    key = _line_key(line)
    older = [a for a in available if _line_key(a) < key]
    if older:
        return max(older, key=_line_key)
    newer = [a for a in available if _line_key(a) > key]
    return min(newer, key=_line_key) if newer else None


def load_reference(line: str, directory: Path | None = None) -> plans.Golden | None:
    """The golden file that judges `line` (see `reference_line`), or None when there is none;
    PlanError when the chosen file is unreadable."""
    directory = directory or plans.expected_dir()
    chosen = reference_line(line, golden_lines(directory))
    return None if chosen is None else plans.load(directory / f"{chosen}.json")


# ---------------------------------------------------------------------------------- the drift


def drift(results: Iterable[ArchResult], golden: plans.Golden, *, line: str) -> Drift:
    """`results` (run on Transformers `line`) against `golden`: the losses and gains of fused
    instances per (module class, fuser), summed over the architectures both hold, with the
    reasons of each loss (see the module docstring)."""
    losses: dict[tuple[str, str], _Tally] = {}
    gains: dict[tuple[str, str], _Tally] = {}
    statuses, new, compared = [], [], 0
    for result in results:
        expected = golden.architectures.get(result.architecture)
        if expected is None:
            new.append(result.architecture)
            continue
        compared += 1
        actual = plans.entry_of(result)
        if actual["status"] != expected["status"]:
            why = f": {actual['reason']}" if actual.get("reason") else ""
            statuses.append(
                f"{result.architecture}: {actual['status']} (was {expected['status']}){why}"
            )
        for (cls, fuser), (before, after) in _applied_changes(expected, actual).items():
            if after < before:
                tally = losses.setdefault((cls, fuser), _Tally())
                reasons = _loss_reasons(cls, fuser, actual, plans.details_of(result))
                tally.add(result.architecture, before, after, reasons)
            else:
                gains.setdefault((cls, fuser), _Tally()).add(result.architecture, before, after)
    return Drift(
        path=str(golden.path),
        reference_line=golden.line,
        line=line,
        own=golden.line == line,
        compared=compared,
        losses=[t.drift(cls, fuser) for (cls, fuser), t in sorted(losses.items())],
        gains=[t.drift(cls, fuser) for (cls, fuser), t in sorted(gains.items())],
        statuses=statuses,
        new=new,
    )


@dataclass
class _Tally:
    before: int = 0
    after: int = 0
    architectures: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def add(self, arch: str, before: int, after: int, reasons: Sequence[str] = ()) -> None:
        self.before += before
        self.after += after
        self.architectures.append(arch)
        self.reasons += [r for r in reasons if r not in self.reasons]

    def drift(self, cls: str, fuser: str) -> ClassDrift:
        return ClassDrift(
            cls, fuser, self.before, self.after, tuple(self.architectures), tuple(self.reasons)
        )


def _applied_changes(
    expected: Mapping[str, Any], actual: Mapping[str, Any]
) -> dict[tuple[str, str], tuple[int, int]]:
    """{(class, fuser): (instances in `expected`, in `actual`)} where they differ; an entry
    without a plan (fusion never ran) fuses nothing."""

    def applied(entry: Mapping[str, Any]) -> dict[tuple[str, str], int]:
        return {
            (cls, fuser): n
            for cls, decisions in (entry.get("plan") or {}).items()
            for fuser, n in decisions.get("applied", {}).items()
        }

    was, now = applied(expected), applied(actual)
    return {
        key: (was.get(key, 0), now.get(key, 0))
        for key in sorted(set(was) | set(now))
        if was.get(key, 0) != now.get(key, 0)
    }


def _loss_reasons(
    cls: str,
    fuser: str,
    actual: Mapping[str, Any],
    details: Mapping[tuple[str, str, str], str],
) -> list[str]:
    """Why this run fuses fewer instances of `cls` with `fuser`: no plan (the status and its
    reason), the class missing from the plan, its refusals (`fuser`'s first, each with the
    full reason the fuser recorded, `details` as harness.reporting.plans.details_of; fusers giving the
    same reason share one line), and which fuser took it instead; SILENT when nothing was
    recorded."""
    plan = actual.get("plan")
    if plan is None:
        return [f"no fusion plan: {actual['status']} ({actual.get('reason', '')})"]
    decisions = plan.get(cls)
    if decisions is None:
        return [f"{cls} is not in this run's plan (renamed, or no longer in the model)"]
    refused = decisions.get("refused", {})
    by_reason: dict[str, list[str]] = {}  # one line per reason, naming every fuser giving it
    for f in [fuser, *sorted(f for f in refused if f != fuser)]:
        for category in sorted(refused.get(f, {})):
            by_reason.setdefault(details.get((cls, f, category), category), []).append(f)
    reasons = [
        f"{', '.join(fusers)} refuse{'s' if len(fusers) == 1 else ''}: {reason}"
        for reason, fusers in by_reason.items()
    ]
    reasons += [
        f"now fused by {other} ({n})"
        for other, n in sorted(decisions.get("applied", {}).items())
        if other != fuser
    ]
    return reasons or [SILENT]


# ---------------------------------------------------------------------------------- text


def _cut(text: str, width: int = REASON_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _archs(names: Sequence[str], limit: int = 4) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def describe(change: ClassDrift) -> str:
    """ "LlamaAttention: qkv 2 -> 0 instances (llama)"."""
    return (
        f"{change.cls}: {change.fuser} {change.before} -> {change.after} instances "
        f"({_archs(change.architectures)})"
    )


def format_drift(drift_: Drift, *, gate: bool = False) -> str:
    """The drift section `run` prints: the reference, the losses with their reasons, the gains,
    changed statuses and new architectures; the last line says whether a loss fails the run
    (`gate`: --fail-on-drift-loss)."""
    which = (
        f"the golden plan of Transformers {drift_.line}"
        if drift_.own
        else f"Transformers {drift_.reference_line}'s golden plan, the nearest line "
        f"(no golden plan for {drift_.line})"
    )
    lines = [f"drift against {which}: {drift_.path}; {drift_.compared} architectures compared"]
    for change in drift_.losses:
        lines.append(f"  lost   {describe(change)}")
        lines += [f"           - {_cut(r)}" for r in change.reasons]
    lines += [f"  gained {describe(change)}" for change in drift_.gains]
    lines += [f"  status {_cut(s)}" for s in drift_.statuses]
    if drift_.new:
        lines.append(f"  new    not in the reference: {_archs(drift_.new, 8)}")
    lines.append("  " + verdict(drift_, gate=gate))
    return "\n".join(lines)


def verdict(drift_: Drift, *, gate: bool) -> str:
    """One line: no drift, or how many (class, fuser) pairs were lost and what that does to
    the exit status."""
    lost = sum(c.before - c.after for c in drift_.losses)
    gained = sum(c.after - c.before for c in drift_.gains)
    if not drift_.losses:
        return f"no fusion lost ({gained} instances gained)" if gained else "no drift"
    effect = (
        f"exit {EXIT_DRIFT_LOSS} (--fail-on-drift-loss)"
        if gate
        else "not a failure without --fail-on-drift-loss"
    )
    return (
        f"{lost} fused instances lost over {len(drift_.losses)} (class, fuser) pairs, "
        f"{gained} gained: {effect}"
    )


def exit_status(status: int, drift_: Drift | None, *, gate: bool) -> int:
    """The run's exit status with the drift gate: EXIT_DRIFT_LOSS when `gate` is on, fusions
    were lost and the sweep is otherwise green or only has corpus problems (a fusion failure,
    1, and any non-verdict status such as 2 or 130 keep theirs)."""
    if gate and drift_ is not None and drift_.losses and status in (0, 3):
        return EXIT_DRIFT_LOSS
    return status

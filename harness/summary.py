"""What a sweep's results add up to: totals, the final table, the JSON document, the exit code."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.results import STATUSES, ArchResult, to_dict

EXIT_GREEN = 0
EXIT_FUSION_FAILURE = 1
"""Exit status of a sweep with a fusion failure: parity (logits, a fused module, a lifecycle
operation), a fused-only error, a fuse error, or a worker that crashed or timed out."""
EXIT_CORPUS_PROBLEM = 3
"""Exit status of a sweep whose only problems are the corpus's: an unfused model that could
not be built or run (`ArchResult.corpus_problem`). Distinct from 1 so that a gate can tell
"fusion broke" from "the corpus cannot build this model on this release"."""


@dataclass(frozen=True)
class Totals:
    """Counts over a set of results.

    built: the tiny model was built; ran: the unfused model ran; fused: at least one fusion was
    applied; green: parity passed. statuses and fusions count per status and per fuser.
    """

    architectures: int
    built: int
    ran: int
    fused: int
    green: int
    statuses: dict[str, int]
    fusions: dict[str, int]
    seconds: float
    lifecycle: dict[str, dict[str, int]] = field(default_factory=dict)
    """{operation: {verdict: architectures}} of the lifecycle checks (harness.lifecycle)."""


def totals(results: Sequence[ArchResult]) -> Totals:
    fusions: Counter[str] = Counter()
    cycle: dict[str, Counter[str]] = {}
    for result in results:
        fusions.update(result.applied)
        for op, verdict in result.lifecycle.items():
            cycle.setdefault(op, Counter())[verdict["verdict"]] += 1
    return Totals(
        architectures=len(results),
        built=sum(r.built for r in results),
        ran=sum(r.ran for r in results),
        fused=sum(r.fusions > 0 for r in results),
        green=sum(r.status == "pass" for r in results),
        statuses={s: n for s in STATUSES if (n := sum(r.status == s for r in results))},
        fusions=dict(sorted(fusions.items())),
        seconds=round(sum(r.seconds for r in results), 3),
        lifecycle={op: dict(sorted(c.items())) for op, c in cycle.items()},
    )


def exit_status(results: Sequence[ArchResult], *, strict_corpus: bool = False) -> int:
    """EXIT_FUSION_FAILURE (1) if any result is a fusion failure (or a worker death), else
    EXIT_CORPUS_PROBLEM (3) if any unfused model could not be built or run (1 with
    `strict_corpus`), else EXIT_GREEN (0).

    A fusion failure wins over corpus problems, so 3 always means "nothing fusion did was
    found wrong". "inconclusive" does not fail a sweep: nothing was found wrong, and the table
    says what could not be judged.
    """
    if any(r.fusion_failure for r in results):
        return EXIT_FUSION_FAILURE
    if any(r.corpus_problem for r in results):
        return EXIT_FUSION_FAILURE if strict_corpus else EXIT_CORPUS_PROBLEM
    return EXIT_GREEN


def explain_exit(status: int, results: Sequence[ArchResult]) -> str:
    """One line saying why a sweep exits with `status` (exit_status's codes), naming the
    architectures behind it (at most five); "" for a green sweep or a status that is not a
    verdict (2, 130)."""
    if status not in (EXIT_FUSION_FAILURE, EXIT_CORPUS_PROBLEM):
        return ""
    if status == EXIT_CORPUS_PROBLEM:
        names = [r.architecture for r in results if r.corpus_problem]
        return (
            f"exit {status}: no fusion failure; the corpus cannot build or run the unfused "
            f"model of {_some(names)} (--strict-corpus makes that exit 1)"
        )
    fusion = [r.architecture for r in results if r.fusion_failure]
    if fusion:
        return f"exit {status}: fusion failure(s) in {_some(fusion)}"
    names = [r.architecture for r in results if r.corpus_problem]
    return f"exit {status}: corpus problem(s) in {_some(names)} (--strict-corpus)"


def _some(names: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _error(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.1e}"


NO_FUSION_STATUSES = frozenset({"build-error", "crashed", "timeout", "fuse-error"})
"""Statuses where fusion never ran to completion, so there is no refusal to show."""

REASON_WIDTH = 60


def main_refusal(result: ArchResult) -> str:
    """Why nothing was fused, in a few words: the refusal covering the most modules.

    Returns "fuser: reason category" (harness.plans.reason_category: the stable head of the
    reason, without graph dumps), cut to REASON_WIDTH characters, or "no candidate module"
    when no fuser even considered a module.
    """
    from harness.plans import reason_category

    if not result.refusals:
        return "no candidate module"
    top = max(result.refusals, key=lambda r: r.count)  # first of equals: report order
    text = f"{top.fuser or 'none'}: {reason_category(top.reason)}"
    return text if len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 3] + "..."


def _fusions(result: ArchResult) -> str:
    fused = " ".join(f"{f}:{n}" for f, n in sorted(result.applied.items()))
    if fused:
        return fused
    if result.status in NO_FUSION_STATUSES:
        return "-"
    return f"none ({main_refusal(result)})"


def _lifecycle(result: ArchResult) -> str:
    """`-` when no lifecycle check ran; else the failed operations, or `N pass` (and how many
    were not applicable)."""
    if not result.lifecycle:
        return "-"
    verdicts = {op: v["verdict"] for op, v in result.lifecycle.items()}
    failed = [op for op, v in verdicts.items() if v == "fail"]
    if failed:
        return "fail: " + ", ".join(failed)
    passed = sum(v == "pass" for v in verdicts.values())
    other = len(verdicts) - passed
    return f"{passed} pass" + (f", {other} n/a" if other else "")


def format_table(results: Sequence[ArchResult]) -> str:
    """One row per architecture: fusions by fuser (or, when none, the main refusal reason),
    verdict, worst errors, seconds."""
    header = (
        "architecture",
        "fusions",
        "verdict",
        "lifecycle",
        "unfused err",
        "fused err",
        "seconds",
    )
    rows = [
        (
            r.architecture,
            _fusions(r),
            r.status,
            _lifecycle(r),
            _error(r.unfused_error),
            _error(r.fused_error),
            f"{r.seconds:.2f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {4, 5, 6}

    def line(row: Sequence[str]) -> str:
        cells = (
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def format_problems(
    results: Sequence[ArchResult], *, golden: Mapping[str, Any] | None = None
) -> str:
    """Every result that is not a plain pass, with its message and bundle directories.

    `golden` ({"path": file, "entries": {architecture: plan entry}}, harness.plans) adds, for
    a status the golden file already records for that architecture, whether it is an expected
    break of this Transformers line or a fusion failure that stays a failure even so.
    """
    from harness.plans import accepted

    entries = (golden or {}).get("entries") or {}
    lines = []
    for r in results:
        if r.status == "pass":
            continue
        entry = entries.get(r.architecture)
        note = ""
        if entry is not None and entry.get("status") == r.status:
            where = golden["path"] if golden else "the golden file"
            note = (
                f" (expected: recorded in {where})"
                if accepted(entry)
                else f" (recorded in {where}, but a fusion failure is never expected)"
            )
        lines.append(f"{r.architecture}: {r.status}{note}: {r.message}")
        bundles = dict.fromkeys(f.bundle for f in r.failures if f.bundle)
        lines.extend(f"    repro bundle: {b}" for b in bundles)
    return "\n".join(lines)


def format_totals(t: Totals, *, wall: float | None = None, jobs: int | None = None) -> str:
    """Two or three lines: counts, statuses, fusions per fuser, and the wall time."""
    statuses = ", ".join(f"{n} {s}" for s, n in t.statuses.items()) or "none"
    fusions = ", ".join(f"{f} {n}" for f, n in t.fusions.items()) or "none"
    lines = [
        f"{t.architectures} architectures: {t.built} built, {t.ran} ran, "
        f"{t.fused} fused (at least one fusion), {t.green} parity-green",
        f"statuses: {statuses}",
        f"fusions applied: {sum(t.fusions.values())} ({fusions})",
    ]
    if t.lifecycle:
        per_op = "; ".join(
            f"{op} " + " / ".join(f"{n} {v}" for v, n in counts.items())
            for op, counts in t.lifecycle.items()
        )
        lines.append(f"lifecycle: {per_op}")
    if wall is not None:
        on = f" with -j {jobs}" if jobs else ""
        lines.append(
            f"wall time {wall:.1f} s{on} (sum of per-architecture times {t.seconds:.1f} s)"
        )
    return "\n".join(lines)


def json_document(
    results: Sequence[ArchResult],
    *,
    options: dict[str, Any],
    wall: float | None,
    interrupted: bool,
    status: int | None = None,
) -> dict[str, Any]:
    """The --json output: options, totals, exit status and every result (strict JSON).

    `status` is the process's real exit status (130 for an interrupted run, 2 for a failed
    output), stored as "exit_status"; by default the sweep's verdict (`exit_status`). `wall`
    None (a merge of shards, whose wall times overlap) is stored as null.
    """
    if status is None:
        status = exit_status(results)
    return {
        "options": options,
        "wall_seconds": None if wall is None else round(wall, 3),
        "interrupted": interrupted,
        "exit_status": status,
        "totals": asdict(totals(results)),
        "results": [to_dict(r) for r in results],
    }

"""What a sweep's results add up to: totals, the final table, the JSON document, the exit code."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from harness.results import FUSION_FAILURES, STATUSES, UNEXPECTED, ArchResult, to_dict


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


def totals(results: Sequence[ArchResult]) -> Totals:
    fusions: Counter[str] = Counter()
    for result in results:
        fusions.update(result.applied)
    return Totals(
        architectures=len(results),
        built=sum(r.built for r in results),
        ran=sum(r.ran for r in results),
        fused=sum(r.fusions > 0 for r in results),
        green=sum(r.status == "pass" for r in results),
        statuses={s: n for s in STATUSES if (n := sum(r.status == s for r in results))},
        fusions=dict(sorted(fusions.items())),
        seconds=round(sum(r.seconds for r in results), 3),
    )


def exit_status(results: Sequence[ArchResult]) -> int:
    """0 only if no parity failure and nothing unexpected (crash, timeout, build/forward error).

    "inconclusive" does not fail a sweep: nothing was found wrong, and the table says what
    could not be judged.
    """
    bad = FUSION_FAILURES | UNEXPECTED
    return 1 if any(r.status in bad for r in results) else 0


def _error(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.1e}"


def _fusions(result: ArchResult) -> str:
    return " ".join(f"{f}:{n}" for f, n in sorted(result.applied.items())) or "-"


def format_table(results: Sequence[ArchResult]) -> str:
    """One row per architecture: fusions by fuser, verdict, worst errors, seconds."""
    header = ("architecture", "fusions", "verdict", "unfused err", "fused err", "seconds")
    rows = [
        (
            r.architecture,
            _fusions(r),
            r.status,
            _error(r.unfused_error),
            _error(r.fused_error),
            f"{r.seconds:.2f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {3, 4, 5}

    def line(row: Sequence[str]) -> str:
        cells = (
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def format_problems(results: Sequence[ArchResult]) -> str:
    """Every result that is not a plain pass, with its message and bundle directories."""
    lines = []
    for r in results:
        if r.status == "pass":
            continue
        lines.append(f"{r.architecture}: {r.status}: {r.message}")
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
    wall: float,
    interrupted: bool,
) -> dict[str, Any]:
    """The --json output: options, totals, exit status and every result (strict JSON)."""
    return {
        "options": options,
        "wall_seconds": round(wall, 3),
        "interrupted": interrupted,
        "exit_status": exit_status(results),
        "totals": asdict(totals(results)),
        "results": [to_dict(r) for r in results],
    }

"""What a sweep's results add up to: totals, the final table, the JSON document, the exit code."""

from __future__ import annotations

import math
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.base.results import STATUSES, ArchResult, to_dict
from harness.reporting import table as text_table

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
    """{operation: {verdict: architectures}} of the lifecycle checks (harness.oracles.lifecycle), verdicts
    as `shown_verdict` words: a `compile` the mode skipped counts as "not run", not "n/a"."""


def totals(results: Sequence[ArchResult]) -> Totals:
    fusions: Counter[str] = Counter()
    cycle: dict[str, Counter[str]] = {}
    for result in results:
        fusions.update(result.applied)
        for op, verdict in result.lifecycle.items():
            cycle.setdefault(op, Counter())[shown_verdict(op, verdict)] += 1
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


def _error(value: float | None, *, short: bool = False) -> str:
    """`value` with two significant digits (`2.8e-07`; `short`: `2.8e-7`), "nan", or "-" when
    nothing was measured."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    text = f"{value:.1e}"
    return text.replace("e-0", "e-").replace("e+0", "e+") if short else text


NO_FUSION_STATUSES = frozenset({"build-error", "crashed", "timeout", "fuse-error"})
"""Statuses where fusion never ran to completion, so there is no refusal to show."""

REASON_WIDTH = 60


def main_refusal(result: ArchResult) -> str:
    """Why nothing was fused, in a few words: the refusal covering the most modules.

    Returns "fuser: reason category" (harness.reporting.plans.reason_category: the stable head of the
    reason, without graph dumps), cut to REASON_WIDTH characters, or "no candidate module"
    when no fuser even considered a module.
    """
    from harness.reporting.plans import reason_category

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


LIFECYCLE_SHOWN = ("pass", "fail", "n/a", "not run")
"""How the table and the totals show a lifecycle verdict. `n/a` is what the unfused model cannot
do (README); `not run` is what the lifecycle mode did not try (harness.reporting.report_md counts the
same way)."""


def shown_verdict(op: str, entry: Mapping[str, str]) -> str:
    """The LIFECYCLE_SHOWN word for one recorded lifecycle verdict.

    Returns "not run" for a `compile` the mode skipped: it is recorded as `n/a` with the detail
    `harness.oracles.lifecycle.NOT_COMPILED` (so results files and golden plans keep their format), but
    nothing was tried, and calling it `n/a` would say the unfused model cannot compile. The
    same for an operation whose optional package is not installed (`lifecycle.NOT_INSTALLED`):
    `not_run_reasons` says which package.
    """
    from harness.oracles.lifecycle import (
        NOT_COMPILED,  # torch: only once a lifecycle verdict exists
    )

    if op == "compile" and entry.get("detail") == NOT_COMPILED:
        return "not run"
    if entry.get("verdict") == "n/a" and _missing_package(entry):
        return "not run"
    verdict = entry.get("verdict", "")
    return verdict if verdict in LIFECYCLE_SHOWN else "n/a"


def _missing_package(entry: Mapping[str, str]) -> bool:
    from harness.oracles.lifecycle import NOT_INSTALLED

    return str(entry.get("detail", "")).startswith(NOT_INSTALLED)


def not_run_reasons(results: Sequence[ArchResult]) -> list[str]:
    """One line per lifecycle operation that did not run for a reason the harness knows and
    the table cannot show ("lifecycle lora-after-fuse not run: not installed: peft (pip
    install peft)", with how many architectures when more than one), in operation order:
    what turns a bare count into something the user can act on."""
    found: dict[str, tuple[str, int]] = {}
    for result in results:
        for op, entry in result.lifecycle.items():
            if entry.get("verdict") == "n/a" and _missing_package(entry):
                detail, count = found.get(op, (str(entry["detail"]), 0))
                found[op] = (detail, count + 1)
    lines = []
    for op, (detail, count) in found.items():
        where = f" ({count} architectures)" if count > 1 else ""
        lines.append(f"lifecycle {op} not run{where}: {detail}")
    return lines


def _lifecycle(result: ArchResult, *, wide: bool = False) -> str:
    """`-` when no lifecycle check ran; else the failed operations (`fail: op, ...`), or the
    counts (`14 pass, 1 not run`). `wide` adds the counts to a failure and names every
    operation that did not pass (`; n/a: op` ...), so nothing is left to the results file."""
    if not result.lifecycle:
        return "-"
    shown = {op: shown_verdict(op, entry) for op, entry in result.lifecycle.items()}
    named = {v: [op for op, w in shown.items() if w == v] for v in LIFECYCLE_SHOWN}
    counts = ", ".join(f"{len(named[v])} {v}" for v in LIFECYCLE_SHOWN if named[v])
    if not wide:
        return "fail: " + ", ".join(named["fail"]) if named["fail"] else counts
    details = "; ".join(f"{v}: {', '.join(named[v])}" for v in LIFECYCLE_SHOWN[1:] if named[v])
    return counts + (f" ({details})" if details else "")


TABLE_WIDTH = 100
"""Columns the default (narrow) table fits in; `--wide` prints every cell in full."""

ELLIPSIS = "..."

_SHRINK = ((0, 20), (1, 16), (0, 12), (3, 14), (1, 12))
"""(column, narrowest) in the order a narrow table cuts cells to fit TABLE_WIDTH: an over-long
architecture name to 20 first, then the fusions, then the name again, then the lifecycle.
The narrowest widths plus the fixed columns fit in 100 for any result (see test_summary)."""

_GAP = text_table.GAP


def _fit(cell: str, width: int) -> str:
    """`cell` cut to `width` characters, the cut marked by ELLIPSIS."""
    return cell if len(cell) <= width else cell[: width - len(ELLIPSIS)] + ELLIPSIS


def _narrow_widths(widths: list[int], limit: int) -> list[int]:
    """`widths` with the shrinkable columns (_SHRINK) cut until the row fits `limit`
    characters, or as far as their narrowest widths allow."""
    widths = list(widths)
    for column, narrowest in _SHRINK:
        excess = sum(widths) + len(_GAP) * (len(widths) - 1) - limit
        if excess <= 0:
            break
        widths[column] -= max(0, min(excess, widths[column] - narrowest))
    return widths


def format_table(
    results: Sequence[ArchResult], *, wide: bool = False, width: int = TABLE_WIDTH
) -> str:
    """One row per architecture: fusions by fuser (or, when none, the main refusal reason),
    verdict, lifecycle, worst errors, seconds.

    By default the table fits `width` columns: short headers ("arch" for the architecture, whose
    names are mostly shorter than the word), the lifecycle as counts, and
    over-long names, fusions and lifecycle cells cut with an ellipsis. `wide` prints every cell
    in full and adds the tolerance, whatever the width. `format_legend` says what it all means.
    """
    header = ["architecture" if wide else "arch", "fusions", "verdict", "lifecycle"]
    header += ["unfused err", "fused err", "tol", "seconds"] if wide else ["unfused", "fused", "s"]
    rows = []
    for r in results:
        row = [r.architecture, _fusions(r), r.status, _lifecycle(r, wide=wide)]
        row += [_error(r.unfused_error, short=not wide), _error(r.fused_error, short=not wide)]
        row += [_error(r.tolerance), f"{r.seconds:.2f}"] if wide else [f"{r.seconds:.1f}"]
        rows.append(row)
    widths = text_table.column_widths([header, *rows])
    if not wide:
        widths = _narrow_widths(widths, width)
    right = set(range(4, len(header)))
    return text_table.render(header, rows, right=right, widths=widths, fit=_fit)


def format_legend(*, wide: bool = False) -> str:
    """What the table's columns and words mean, a few lines under TABLE_WIDTH each: the error
    columns (what is compared with what, and the allowance), the lifecycle words (`n/a` versus
    `not run`), `-`, and, in the narrow table, that `...` cuts a cell and `--wide` shows it."""
    errors = "unfused err / fused err" if wide else "unfused / fused"
    seconds = "seconds" if wide else "s"
    lines = [
        "legend:",
        f"  {'architecture' if wide else 'arch'}: the corpus architecture (or your model) checked",
        "  fusions: fuser:instances applied; none (fuser: reason): the refusal covering most "
        "modules",
        "  verdict: the forward's parity status (pass, fail, inconclusive, fused-error, ...)",
        f"  {errors}: worst relative error of the unfused / fused logits against float64",
        "  lifecycle: counts of operations after fusing (generate, train, compile, ...): pass;",
        "    fail (named); n/a: the unfused model cannot do it; not run: not tried in this",
        "    --lifecycle mode (compile: `full` compiles a selection, `all` every model) or",
        "    without its optional package (a note under the table names it)",
        f"  {seconds}: wall time of the check; -: nothing to show (not measured, nothing ran)",
    ]
    if wide:
        lines.insert(5, "  tol: what the fused error may reach, max(2 x unfused err, dtype floor)")
    else:
        lines.append("  ...: cut to fit 100 columns; --wide shows every cell and the tolerance")
    return "\n".join(lines)


def format_problems(
    results: Sequence[ArchResult], *, golden: Mapping[str, Any] | None = None
) -> str:
    """Every result that is not a plain pass, with its message and bundle directories.

    `golden` ({"path": file, "entries": {architecture: plan entry}}, harness.reporting.plans) adds, for
    a status the golden file already records for that architecture, whether it is an expected
    break of this Transformers line or a fusion failure that stays a failure even so.
    """
    from harness.reporting.plans import accepted

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
    """Counts, statuses, fusions per fuser, lifecycle verdicts per operation and the wall time,
    one item each, wrapped at TABLE_WIDTH (continuations indented) so no line wraps."""
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
    wrap = textwrap.TextWrapper(
        TABLE_WIDTH, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )
    return "\n".join(part for line in lines for part in wrap.wrap(line))


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

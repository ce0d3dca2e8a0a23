"""A sweep's results as Markdown for a reviewer (a PR comment, a CI job summary).

`render` turns parsed results (harness.base.results) and, optionally, the golden plans of their
Transformers line (harness.reporting.plans) into one document: the gate's verdict (the exit status a
sweep with these results has, harness.reporting.summary), counts per status, reach per fuser family
(harness.reporting.reach), lifecycle verdicts per operation, what changed against the golden plan, the
slowest architectures and every problem with its message. Pure functions: no file, no
process state; `fusion-harness report` (harness.cli) reads the files and writes the text.

Text from results (messages, reasons, tracebacks) is untrusted as Markdown: it is put in code
spans or fenced blocks sized to the backticks it holds, table cells have `|` escaped and no
line breaks, so a message can neither break the layout nor inject HTML or links.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from harness.base.results import STATUSES, ArchResult
from harness.oracles.lifecycle import OPERATIONS
from harness.reporting import drift, plans, reach, summary

LIFECYCLE_COLUMNS = ("pass", "fail", "n/a", "not run")
"""Lifecycle verdict columns: `n/a` is what the unfused model cannot do; `not run` is what was
not tried (lifecycle off, `compile` outside the mode's selection, a model that never ran)."""

SLOWEST = 10
MESSAGE_WIDTH = 400
DETAIL_LINES = 15
MAX_PROBLEMS = 100
"""Architectures listed under Problems at most (a PR comment holds 65,536 characters)."""

_MEANING = {
    "pass": "parity green",
    "inconclusive": "nothing failed; something could not be judged",
    "fail": "fusion failure: parity (logits, a fused module or a lifecycle operation)",
    "fused-error": "fusion failure: the fused forward raised",
    "fuse-error": "fusion failure: fusion.fuse raised",
    "forward-error": "corpus problem: the unfused or float64 forward raised",
    "build-error": "corpus problem: the tiny model could not be built",
    "crashed": "worker died (counted as a fusion failure)",
    "timeout": "worker timed out (counted as a fusion failure)",
    "compile-error": "failure of the system under test: torch.compile raised",
}


@dataclass(frozen=True)
class GoldenComparison:
    """What changed against a golden file: {architecture: the changes in words} of the
    architectures that differ, how many were compared, and golden architectures these
    results do not hold (a partial sweep; known-unbuildable ones left out)."""

    path: str
    changes: dict[str, list[str]]
    compared: int
    missing: list[str]


# --------------------------------------------------------------------------------- markdown


def code(text: str) -> str:
    """`text` as one inline code span: white space collapsed, fenced by one backtick more
    than its longest run of backticks (padded when it starts or ends with one)."""
    text = " ".join(text.split())
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def cell(text: str) -> str:
    """`text` fit for a table cell as a code span (no line break; `|` escaped)."""
    return code(text).replace("|", "\\|")


def fenced(text: str) -> str:
    """`text` as a fenced block, the fence longer than any backtick run inside."""
    fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}text\n{text.rstrip()}\n{fence}"


def _cut(text: str, width: int = MESSAGE_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """A GitHub-flavoured Markdown table; columns in `right` are right-aligned. Cells are
    taken as written (escape them with `cell`)."""
    rules = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(row) + " |" for row in [header, rules, *rows]]
    return "\n".join(lines)


# --------------------------------------------------------------------------------- sections


def lifecycle_counts(results: Sequence[ArchResult]) -> dict[str, dict[str, int]]:
    """{operation: {column: architectures}} over every result, columns LIFECYCLE_COLUMNS.

    Each operation's counts add up to the number of results: an operation a result has no
    verdict for, or a `compile` its mode skipped, is "not run" (never "n/a", which says the
    unfused model cannot do it), and so is one whose optional package is not installed
    (harness.reporting.summary.shown_verdict). Operations in harness.oracles.lifecycle's order; none when no result
    has any lifecycle verdict.
    """
    seen = {op for r in results for op in r.lifecycle}
    order = [op for op in OPERATIONS if op in seen] + sorted(seen - set(OPERATIONS))
    counts = {op: dict.fromkeys(LIFECYCLE_COLUMNS, 0) for op in order}
    for result in results:
        for op in order:
            entry = result.lifecycle.get(op)
            column = "not run" if entry is None else summary.shown_verdict(op, entry)
            counts[op][column] += 1
    return counts


def compare_with_golden(results: Sequence[ArchResult], golden: plans.Golden) -> GoldenComparison:
    """Each result's plan entry against `golden` (harness.reporting.plans.diff_entry, in words)."""
    changes = {}
    for result in results:
        lines = plans.diff_entry(
            golden.architectures.get(result.architecture),
            plans.entry_of(result),
            plans.details_of(result),
        )
        if lines:
            changes[result.architecture] = lines
    ran = {r.architecture for r in results}
    missing = sorted(
        name
        for name, entry in golden.architectures.items()
        if name not in ran and entry.get("status") != "unbuildable"
    )
    return GoldenComparison(str(golden.path), changes, len(results), missing)


def _overview(results: Sequence[ArchResult], source: str, strict_corpus: bool) -> list[str]:
    configs = sorted(
        {
            f"{r.dtype} on {r.device}, seed {r.seed}"
            + ("" if r.system == "fusion" else f", system {r.system}")
            for r in results
        }
    )
    versions = sorted(
        {", ".join(f"{k} {v}" for k, v in sorted(r.versions.items())) for r in results} - {""}
    )
    status = summary.exit_status(results, strict_corpus=strict_corpus)
    gate = summary.explain_exit(status, results) or f"exit {status}: green"
    seconds = sum(r.seconds for r in results)
    lines = [
        f"{code(source)}: {len(results)} architectures; {'; '.join(configs) or 'no results'}; "
        f"{'; '.join(versions) or 'versions not recorded'}; "
        f"{seconds:.1f} s of per-architecture time.",
        "",
        f"**Gate:** {gate.replace('--strict-corpus', '`--strict-corpus`')}.",
    ]
    return lines


def _statuses(results: Sequence[ArchResult]) -> list[str]:
    rows = [
        [status, str(n), _MEANING.get(status, "")]
        for status in STATUSES
        if (n := sum(r.status == status for r in results))
    ]
    if not rows:
        return ["No results."]
    t = summary.totals(results)
    return [
        table(["status", "architectures", "meaning"], rows, right=[1]),
        "",
        f"{t.built} built, {t.ran} ran unfused, {t.fused} with at least one fusion; "
        f"{sum(t.fusions.values())} fusions applied"
        + (f" ({', '.join(f'{f} {n}' for f, n in t.fusions.items())})" if t.fusions else "")
        + ".",
    ]


def _reach(results: Sequence[ArchResult], top: int = 3) -> list[str]:
    rows = []
    for family, r in reach.reach(results).items():
        if not r.candidates:
            continue
        refusals = "; ".join(f"{cell(c)} ({n})" for c, n in r.refusals.most_common(top))
        more = len(r.refusals) - top
        refusals += f"; {more} more" if more > 0 else ""
        rows.append(
            [family, f"{len(r.reached)}/{len(r.candidates)}", f"{r.share:.0%}", refusals or "-"]
        )
    if not rows:
        return ["No module class was fused or refused."]
    header = ["family", "classes fused / candidates", "share", "main refusals of the rest"]
    return [
        table(header, rows, right=[1, 2]),
        "",
        "Refusals are counted in module classes (harness.reporting.reach).",
    ]


def _lifecycle(results: Sequence[ArchResult]) -> list[str]:
    counts = lifecycle_counts(results)
    if not counts:
        return ["Not run (`--lifecycle off`, or no model ran)."]
    rows = [[op, *(str(c[col]) for col in LIFECYCLE_COLUMNS)] for op, c in counts.items()]
    reasons = [
        f"- {code(line.split(':', 1)[0])}:{line.split(':', 1)[1]}"
        for line in summary.not_run_reasons(results)
    ]
    return [
        table(["operation", *LIFECYCLE_COLUMNS], rows, right=[1, 2, 3, 4]),
        "",
        "n/a: the unfused model cannot do it; not run: not tried (the lifecycle mode, an "
        "optional package not installed, or a model that did not run).",
        *(["", *reasons] if reasons else []),
    ]


def _golden(comparison: GoldenComparison | None, note: str) -> list[str]:
    if comparison is None:
        return [f"Not compared: {note or 'no golden plan given'}."]
    where = code(comparison.path)
    lines = []
    if not comparison.changes:
        lines.append(f"All {comparison.compared} architectures match {where}.")
    else:
        lines.append(
            f"{len(comparison.changes)} of {comparison.compared} architectures differ from {where}:"
        )
        lines.append("")
        for name, changes in comparison.changes.items():
            lines.append(f"- {code(name)}")
            lines.extend(f"  - {code(_cut(change))}" for change in changes)
    if comparison.missing:
        lines += [
            "",
            f"{len(comparison.missing)} architectures of the golden plan are not in these "
            "results (not compared).",
        ]
    return lines


def _drift(found: drift.Drift) -> list[str]:
    """The drift section: the reference line, each lost (class, fuser) with its reasons,
    the gains, changed statuses and new architectures (harness.reporting.drift)."""
    lines = [
        f"No golden plan for Transformers {found.line}: judged against Transformers "
        f"{found.reference_line}'s, the nearest line ({code(found.path)}), on "
        f"{found.compared} architectures held by both.",
        "",
    ]
    if found.losses:
        lines += [f"**Lost** ({len(found.losses)})", ""]
        for change in found.losses:
            lines.append(f"- {code(drift.describe(change))}")
            lines += [f"  - {code(_cut(reason))}" for reason in change.reasons]
        lines.append("")
    if found.gains:
        lines += [f"**Gained** ({len(found.gains)})", ""]
        lines += [f"- {code(drift.describe(change))}" for change in found.gains]
        lines.append("")
    if found.statuses:
        lines += ["**Status changed**", ""]
        lines += [f"- {code(_cut(text))}" for text in found.statuses]
        lines.append("")
    if found.new:
        lines += [f"Not in the reference (new): {', '.join(code(n) for n in found.new)}.", ""]
    lost = sum(c.before - c.after for c in found.losses)
    gained = sum(c.after - c.before for c in found.gains)
    lines.append(
        f"{lost} fused instances lost, {gained} gained"
        + (" (`run --fail-on-drift-loss` fails on a loss)." if lost else ".")
    )
    return lines


def _warnings(results: Sequence[ArchResult], top: int = 5) -> list[str]:
    """Warning lines by where they were raised (harness.oracles.warned), each with the number of
    architectures that raised it, most common first."""
    lines: list[str] = []
    for where, title in (
        ("fused-only", "Only the fused model (a verdict: fails its architecture)"),
        ("compiler", "The compiler's own diagnostics (named, not a failure)"),
        ("fusing", "While fusing"),
        ("unfused", "The unfused model itself"),
    ):
        counts: dict[str, list[str]] = {}
        for result in results:
            for text in result.warnings.get(where, []):
                counts.setdefault(text, []).append(result.architecture)
        if not counts:
            continue
        ranked = sorted(counts.items(), key=lambda item: (-len(item[1]), item[0]))
        rows = [
            [code(_cut(text, 120)), str(len(archs)), ", ".join(sorted(archs)[:3])]
            for text, archs in ranked[:top]
        ]
        more = f" ({len(ranked) - top} more lines in the results file)" if len(ranked) > top else ""
        lines += [f"**{title}**{more}", "", table(["warning", "archs", "e.g."], rows, [1]), ""]
    return lines or ["None recorded."]


def _slowest(results: Sequence[ArchResult], count: int) -> list[str]:
    ranked = sorted(results, key=lambda r: (-r.seconds, r.architecture))[:count]
    rows = [[code(r.architecture), f"{r.seconds:.2f}", r.status] for r in ranked]
    return [table(["architecture", "seconds", "status"], rows, right=[1])] if rows else []


def _problem(result: ArchResult) -> list[str]:
    lines = [f"- {code(result.architecture)} **{result.status}**: {code(_cut(result.message))}"]
    for failure in result.failures:
        where = f" at {failure.qualname}" if failure.qualname else ""
        fuser = f" [{failure.fuser}]" if failure.fuser else ""
        head = f"{failure.kind}{where}{fuser}"
        text = failure.message if failure.message.startswith(head) else f"{head}: {failure.message}"
        lines.append(f"  - {code(_cut(text))}")
        if failure.bundle:
            lines.append(f"    - repro bundle: {code(failure.bundle)}")
        if failure.detail.strip():
            tail = "\n".join(failure.detail.strip().splitlines()[-DETAIL_LINES:])
            lines += ["", "    <details><summary>detail</summary>", ""]
            lines += ["    " + line for line in fenced(tail).splitlines()]
            lines += ["", "    </details>", ""]
    return lines


def _problems(results: Sequence[ArchResult]) -> list[str]:
    groups = (
        ("Fusion failures", [r for r in results if r.fusion_failure]),
        (
            "Corpus problems (the unfused model cannot be built or run)",
            [r for r in results if r.corpus_problem],
        ),
        ("Inconclusive (nothing failed)", [r for r in results if r.status == "inconclusive"]),
    )
    lines: list[str] = []
    shown = 0
    for title, group in groups:
        if not group:
            continue
        lines += [f"**{title}** ({len(group)})", ""]
        for result in group:
            if shown == MAX_PROBLEMS:
                break
            lines += _problem(result)
            shown += 1
        lines.append("")
    listed = sum(len(group) for _, group in groups)
    if listed > shown:
        lines.append(f"... and {listed - shown} more (see the results file).")
    return lines or ["None."]


def render(
    results: Sequence[ArchResult],
    *,
    source: str,
    golden: GoldenComparison | None = None,
    golden_note: str = "",
    slowest: int = SLOWEST,
    strict_corpus: bool = False,
    drifted: drift.Drift | None = None,
) -> str:
    """The Markdown report of `results` (read from `source`, named in the text).

    `golden` is `compare_with_golden`'s answer, or None with `golden_note` saying why there
    is none; `drifted` (harness.reporting.drift) the comparison with the nearest line's golden plan
    for a line without its own, a section of its own; `strict_corpus` judges the gate as
    `run --strict-corpus` would. Returns the text, ending in a newline.
    """
    sections: list[tuple[str, list[str]]] = [
        ("Statuses", _statuses(results)),
        ("Reach per fuser family", _reach(results)),
        ("Lifecycle verdicts", _lifecycle(results)),
        ("Against the golden plan", _golden(golden, golden_note)),
        ("Drift against the nearest line", _drift(drifted) if drifted else []),
        ("Warnings", _warnings(results)),
        (f"Slowest {min(slowest, len(results))} architectures", _slowest(results, slowest)),
        ("Problems", _problems(results)),
    ]
    lines = ["## fusion-harness report", "", *_overview(results, source, strict_corpus)]
    for title, body in sections:
        if body:
            lines += ["", f"### {title}", "", *body]
    return "\n".join(lines).rstrip() + "\n"


def golden_note_for_options(results: Sequence[ArchResult], golden: plans.Golden) -> str:
    """Why `golden` cannot judge `results` (recorded under other options), or ""."""
    mismatched = sorted(
        {
            f"{r.dtype}/{r.device}/seed {r.seed}"
            for r in results
            if not plans.matches_options(golden, r)
        }
    )
    if not mismatched:
        return ""
    ours = golden.options
    return (
        f"{golden.path} records plans under {ours.get('dtype')}/{ours.get('device')}/seed "
        f"{ours.get('seed')}, these results are {', '.join(mismatched)}"
    )


def transformers_versions(results: Sequence[ArchResult]) -> list[str]:
    """The distinct Transformers versions the results record, sorted (none for old files)."""
    return sorted({r.versions["transformers"] for r in results if "transformers" in r.versions})

"""What `run` and `merge` print and decide once results exist: the summary table, golden plans,
the drift report against the nearest line's plan, the line explaining the exit status."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from harness.cli import common


def print_summary(
    results: Sequence[Any],
    options: Any,
    *,
    wall: float | None = None,
    jobs: int | None = None,
    wide: bool = False,
) -> None:
    """The table (in full with `wide`) and its legend, the problems (with what the golden file already expects), the totals and
    the per-family reach of a finished (or interrupted) sweep, or of merged shards (`options`:
    anything with dtype, device and seed attributes). The first line names the system under
    test; golden plans and fusion reach describe only the `fusion` system, so another system
    gets neither."""
    from harness.reporting import reach, summary

    system = getattr(options, "system", common.SYSTEM_NAMES[0])
    ours = system == common.SYSTEM_NAMES[0]
    print(f"system under test: {system}")
    print(summary.format_table(results, wide=wide))
    print(summary.format_legend(wide=wide))
    golden = golden_entries(options) if ours else None
    problems = summary.format_problems(results, golden=golden)
    if problems:
        print("\n" + problems)
    print("\n" + summary.format_totals(summary.totals(results), wall=wall, jobs=jobs))
    for reason in summary.not_run_reasons(results):
        print(f"note: {reason}")
    if ours:
        print(reach.format_reach(reach.reach(results)))


def golden_entries(options) -> dict[str, Any] | None:
    """{"path": the golden file, "entries": its plan entries by architecture} of the installed
    Transformers line when recorded under these options; None otherwise, or when there is no
    usable golden file (the table then just does not say what is expected)."""
    from harness.reporting import plans

    try:
        golden = plans.load()
    except plans.PlanError:
        return None
    if not plans.matches_options(golden, options):
        return None
    return {"path": str(golden.path), "entries": golden.architectures}


def check_golden_options(options) -> None:
    from harness.reporting import plans

    if options.system != common.SYSTEM_NAMES[0]:
        raise common.UsageError(
            f"--update-expected records fusion plans; system {options.system} has none"
        )
    chosen = {k: getattr(options, k) for k in plans.GOLDEN_OPTIONS}
    if chosen != plans.GOLDEN_OPTIONS:
        raise common.UsageError(
            f"--update-expected records golden plans with {plans.GOLDEN_OPTIONS}, not {chosen}"
        )


def installed_line() -> str:
    from harness.reporting import plans

    return plans.transformers_line()


def drift_reference(options: Any, line: str, *, gate: bool) -> Any:
    """The golden file (harness.reporting.plans.Golden) a run on Transformers `line` is judged against
    for drift (harness.reporting.drift.reference_line), or None when there is none usable: another
    system, other options, no golden file at all, or (a warning) an unreadable one. With
    `gate` (--fail-on-drift-loss) each of those is a common.UsageError or PlanError (exit 2) before
    the sweep: a gate that cannot judge must not pass."""
    from harness.reporting import drift, plans

    system = getattr(options, "system", common.SYSTEM_NAMES[0])
    why = ""
    if system != common.SYSTEM_NAMES[0]:
        why = f"golden plans describe the fusion system, not {system}"
    else:
        chosen = {k: getattr(options, k) for k in plans.GOLDEN_OPTIONS}
        if chosen != plans.GOLDEN_OPTIONS:
            why = f"golden plans are recorded with {plans.GOLDEN_OPTIONS}, not {chosen}"
    try:
        golden = None if why else drift.load_reference(line)
    except plans.PlanError as exc:
        if gate:
            raise
        print(f"fusion-harness: warning: no drift report: {exc}", file=sys.stderr)
        return None
    if not why and golden is None:
        why = f"no golden plan in {plans.expected_dir()} to judge Transformers {line} against"
    if why and gate:
        raise common.UsageError(f"--fail-on-drift-loss: {why}")
    return golden


def print_drift(found: Any, *, gate: bool) -> None:
    """The drift section (harness.reporting.drift.format_drift) when there is something to say: always
    for a line judged against another line's plan, else only when the plans differ."""
    from harness.reporting import drift

    if found is None:
        return
    if found.own and not (found.losses or found.gains or found.statuses):
        return
    print("\n" + drift.format_drift(found, gate=gate))


def explain(status: int, results: Sequence[Any], found: Any) -> str:
    """summary.explain_exit's line, or the drift gate's when it decided the status."""
    from harness.reporting import drift, summary

    if status == drift.EXIT_DRIFT_LOSS and found is not None:
        pairs = sorted({f"{c.cls} {c.fuser}" for c in found.losses})
        lost = ", ".join(pairs[:5]) + (f" and {len(pairs) - 5} more" if len(pairs) > 5 else "")
        return (
            f"exit {status}: no fusion failure; fusions lost against {found.path} "
            f"(--fail-on-drift-loss): {lost}"
        )
    return summary.explain_exit(status, results)


def update_expected(results, options) -> None:
    from harness.base import architectures
    from harness.reporting import plans

    path, changes = plans.update(
        results,
        unbuildable=architectures.unbuildable(),
        known=architectures.available(options.plugins),
    )
    if not changes:
        print(f"\n{path}: no change")
        return
    print(f"\n{path}: {len(changes)} architecture(s) changed (review with `git diff {path}`):")
    for name, lines in changes.items():
        print(f"{name}:")
        print("\n".join(f"  - {line}" for line in lines))

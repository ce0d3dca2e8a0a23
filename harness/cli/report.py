"""`fusion-harness report FILE`: a results file as Markdown for a reviewer; bench or perf JSON
as a table and, with --plot, a PNG."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.cli import common, verdicts


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `report` subcommand and its options."""
    report = commands.add_parser(
        "report",
        help="a results file as Markdown for a reviewer",
        description="Write a Markdown summary of a results file (what `fusion-harness run` "
        "writes) for a PR comment or a CI job summary: the gate's verdict, counts per status, "
        "reach per fuser family, lifecycle verdicts (pass / fail / n/a / not run), what changed "
        "against the golden plan of the results' Transformers line "
        "(corpus/expected/MAJOR.MINOR.json), the slowest architectures and every problem with "
        "its message. Given the JSON of `bench --json` or `perf --json` instead, a table of "
        "fused / unfused per token count (and with --plot a PNG). Exit status 0 when written, "
        "2 when a file cannot be read or written.",
    )
    report.add_argument(
        "results",
        type=Path,
        metavar="RESULTS",
        help="JSONL results file, or the JSON of `bench --json` / `perf --json` (then a table of "
        "fused / unfused per token count)",
    )
    report.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="for bench or perf JSON: also draw fused / unfused per token count as a PNG here "
        "(needs matplotlib: the [plot] extra)",
    )
    report.add_argument(
        "--out", type=Path, default=None, metavar="FILE", help="write here (default: stdout)"
    )
    report.add_argument(
        "--expected",
        type=Path,
        default=None,
        metavar="GOLDEN",
        help="golden plan file to compare with (default: the one of the Transformers line the "
        "results record, else of the installed one)",
    )
    common.add_flag(report, "--strict-corpus", common.STRICT_CORPUS_HELP)
    return report


def run(args: argparse.Namespace) -> int:
    """`fusion-harness report`: the Markdown summary of a results file (harness.reporting.report_md)
    on stdout or in --out; 0 once written. An unreadable results or golden file, or an --out
    that cannot be written, is a usage error (2)."""
    from harness.base.results import read_results
    from harness.reporting import report_md, speed_report

    try:
        speed = speed_report.read_speed_document(args.results)
    except speed_report.SpeedDocumentError as exc:
        raise common.UsageError(f"{args.results} is not a readable speed document: {exc}") from None
    except OSError:  # read_results names what is wrong with the path
        speed = None
    if speed is not None:
        return _report_speed(args, speed)
    if args.plot is not None:
        raise common.UsageError(
            f"--plot draws bench or perf JSON (`bench --json`, `perf --json`); {args.results} "
            "is a results file"
        )
    results = read_results(args.results)
    if not results:
        raise common.UsageError(
            f"{args.results} holds no results (an empty file); nothing to report"
        )
    comparison, note = _golden_comparison(results, args.expected)
    found = None if comparison or args.expected else _report_drift(results)
    text = report_md.render(
        results,
        source=str(args.results),
        golden=comparison,
        golden_note=note,
        strict_corpus=args.strict_corpus,
        drifted=found,
    )
    _emit_report(args.out, text)
    return 0


def _emit_report(out: Path | None, text: str) -> None:
    """`text` on stdout (a closed stdout costs nothing) or in `out`; an `out` that cannot be
    written is a usage error."""
    if out is None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            common.stdout_closed()
        return
    try:
        common.write_text(out, text)
    except OSError as exc:
        raise common.UsageError(f"--out {out} cannot be written: {exc.strerror or exc}") from None
    print(f"report: {out}", file=sys.stderr)


def _report_speed(args: argparse.Namespace, document: Any) -> int:
    """`report` of a bench or perf JSON document: the Markdown table of fused / unfused per
    series and token count, and with --plot the PNG (harness.reporting.speed_plot); 0 once written, 2
    (a usage error) without matplotlib or where a file cannot be written. The Markdown is
    written even when the plot cannot be (it says so)."""
    from harness.reporting import speed_plot, speed_report

    plot_error = ""
    if args.plot is not None:
        try:
            speed_plot.write_png(document, args.plot)
            print(f"plot: {args.plot}", file=sys.stderr)
        except speed_plot.PlotUnavailable as exc:
            plot_error = str(exc)
        except OSError as exc:
            plot_error = f"--plot {args.plot} cannot be written: {exc.strerror or exc}"
    link = None
    if args.plot is not None and not plot_error:
        link = os.path.relpath(args.plot, args.out.parent) if args.out else str(args.plot)
    text = speed_report.render(document, source=str(args.results), plot=link)
    _emit_report(args.out, text)
    if plot_error:
        raise common.UsageError(plot_error)
    return 0


def _golden_comparison(results: Sequence[Any], expected: Path | None) -> tuple[Any, str]:
    """(report_md.GoldenComparison, "") of `results` against --expected, or against the golden
    file of the Transformers line the results record (the installed line when they record
    none); (None, why not) when there is no such file or it holds other options. A bad
    --expected file is a PlanError (exit 2): the user named it."""
    from harness.reporting import plans, report_md

    others = sorted({r.system for r in results} - {common.SYSTEM_NAMES[0]})
    if others:
        return None, f"golden plans describe the fusion system, these results {', '.join(others)}"
    if expected is not None:
        if not expected.is_file():
            raise common.UsageError(f"--expected {expected}: no such golden plan file")
        golden = plans.load(expected)
    else:
        recorded = report_md.transformers_versions(results)
        if len(recorded) > 1:
            return None, f"the results mix Transformers {', '.join(recorded)}"
        try:
            golden = plans.load(plans.golden_path(plans.transformers_line(*recorded[:1])))
        except plans.PlanError as exc:
            return None, str(exc)
    note = report_md.golden_note_for_options(results, golden)
    if note:
        return None, note
    comparison = report_md.compare_with_golden(results, golden)
    with contextlib.suppress(ValueError):  # shown relative to here when it lies below
        comparison = dataclasses.replace(
            comparison, path=str(Path(comparison.path).resolve().relative_to(Path.cwd()))
        )
    return comparison, ""


def _report_drift(results: Sequence[Any]) -> Any:
    """harness.reporting.drift.Drift of `results` against the nearest line's golden plan when their
    Transformers line has none of its own (one recorded line, the golden options, the fusion
    system); None otherwise (the golden section then says why it compared nothing)."""
    from harness.reporting import drift, plans, report_md

    recorded = report_md.transformers_versions(results)
    if not results or len(recorded) > 1:
        return None
    line = plans.transformers_line(*recorded[:1])
    reference = verdicts.drift_reference(results[0], line, gate=False)
    if reference is None or reference.line == line:
        return None
    if report_md.golden_note_for_options(results, reference):
        return None
    if {r.system for r in results} != {common.SYSTEM_NAMES[0]}:
        return None
    return drift.drift(results, reference, line=line)

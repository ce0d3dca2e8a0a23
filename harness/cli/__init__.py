"""The `fusion-harness` command line (also `python -m harness`).

    fusion-harness run    sweep the corpus: build, fuse, compare with a float64 reference
                          (--update-expected: record the golden fusion plans, harness.reporting.plans)
    fusion-harness list   the corpus with the build status of every architecture
    fusion-harness show   the fusion plan of one architecture and the diff of every rewrite
    fusion-harness repro  replay a repro bundle (exit 1 if the failure reproduces)
    fusion-harness bench  fused vs unfused timings (harness.speed.bench)
    fusion-harness perf   performance verdict per architecture at real widths (harness.speed.perf;
                          also `run --perf`): exit 1 if fused is measurably slower
    fusion-harness report a results file as Markdown for a reviewer (harness.reporting.report_md); bench
                          or perf JSON as a table and, with --plot, a PNG (harness.reporting.speed_report,
                          harness.reporting.speed_plot)
    fusion-harness merge  shards' results files (run --shard K/N) into one (harness.runner.shard)
    fusion-harness check  your own model: a local checkpoint or config.json (harness.runner.own_model_check)

Exit status: 0 success; 1 a fusion failure (run, merge: parity of the logits, a fused module
or a lifecycle operation, a fused-only error, a fuse error, a crashed or timed-out worker) or a
reproducing failure (repro); 3 (run, merge, check, list, show) no fusion failure, but the
corpus could not build or run an unfused model (build-error, forward-error; 1 with
--strict-corpus); 2 bad usage or
unusable input or output (unknown architecture, malformed bundle, unusable or unwritable
results file, shards that do not merge, an output that could not be written); 4 (run, merge
with --fail-on-drift-loss) no fusion failure, but fusions were lost against the golden plan
of the line or of the nearest line (harness.reporting.drift); 130 interrupted. Errors are one line on stderr, "fusion-harness: error: ...", never a traceback.

Imports are lazy: torch, Transformers and the corpus load only in the command that needs them,
so `--help` and usage errors answer at once.

Layout: one module per command (`run`, `listing` for `list`, `show`, `repro`, `bench`, `perf`,
`calibrate`, `report`, `merge`, `check`), each with `add_parser(commands)` and `run(args) ->
int`; `COMMANDS` below is the one table of them and `main` the one dispatch. `common` holds
what several commands share, `verdicts` what `run` and `merge` print once results exist.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from harness.base.errors import InputError
from harness.cli import (
    bench,
    calibrate,
    check,
    listing,
    merge,
    perf,
    report,
    repro,
    run,
    show,
)
from harness.cli.argtypes import Parser
from harness.cli.common import (
    DTYPE_NAMES,
    EXIT_CORPUS,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    SYSTEM_NAMES,
    UsageError,
)

__all__ = [
    "COMMANDS",
    "DTYPE_NAMES",
    "EXIT_CORPUS",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "SYSTEM_NAMES",
    "UsageError",
    "build_parser",
    "main",
]

COMMANDS: dict[str, ModuleType] = {
    "run": run,
    "list": listing,
    "show": show,
    "repro": repro,
    "bench": bench,
    "calibrate": calibrate,
    "perf": perf,
    "report": report,
    "merge": merge,
    "check": check,
}
"""Every subcommand, in `--help` order: name -> its module (`add_parser`, `run`)."""

ALIASES: dict[str, Callable[[list[str]], list[str] | None]] = {
    # `run --perf ...` is `perf ...` (its --perf-* spellings are perf's own option names)
    "run": lambda argv: (
        ["perf", *(a for a in argv[1:] if a != "--perf")] if "--perf" in argv else None
    ),
}
"""Spellings of one command as another: argv rewritten before parsing (None: not this one)."""


def build_parser() -> Parser:
    parser = Parser(
        prog="fusion-harness",
        description="Differential testing of fused vs unfused Transformers models: every "
        "causal-LM architecture as a tiny random model, fused with fusion.fuse and compared "
        "with the unfused model and a float64 reference.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (see the module docstring).

    Started as a program (`argv` None), the first Ctrl-C interrupts and any further one is
    ignored, so the bounded clean-up (workers killed, table printed, results kept) finishes
    without "Exception ignored" noise or a traceback. An exception marked as the user's input
    (`harness.base.errors.InputError`: a bad option value, an unknown architecture, an
    unreadable results file...) is one line on stderr and exit 2; any other propagates.
    """
    if argv is None:
        signal.signal(signal.SIGINT, _interrupt_once)
        status = main(sys.argv[1:])
        if status == EXIT_INTERRUPTED:
            # Everything is reported and every worker stopped; skip interpreter clean-up,
            # where a late signal could still end the process with another status.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status
    argv = list(argv)
    alias = ALIASES.get(argv[0]) if argv else None
    argv = (alias(argv) if alias else None) or argv
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return COMMANDS[args.command].run(args)
    except InputError as exc:
        sys.stdout.flush()
        print(f"fusion-harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("fusion-harness: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT handler: raise KeyboardInterrupt once, then ignore SIGINT for the rest of the run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt

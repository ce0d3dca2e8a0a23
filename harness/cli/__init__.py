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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.base.results import ResultsError
from harness.cli.argtypes import Parser, non_negative_int, positive_float, positive_int

EXIT_USAGE = 2
EXIT_CORPUS = 3
"""A corpus problem and no fusion failure (see the module docstring)."""
EXIT_INTERRUPTED = 130

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""--dtype choices: the keys of harness.runner.arch_check.DTYPES (a test keeps them equal), spelled out here
so that building the parser does not import torch."""

SYSTEM_NAMES = ("fusion", "inductor", "inductor-freezing", "vllm")
"""--system choices: harness.runner.systems.NAMES (a test keeps them equal), spelled out here for the
same reason; the first is the default."""

DEFAULT_REPRO_DIR = Path("repro-bundles")


class UsageError(ValueError):
    """Options that cannot work together or on this machine."""


def _device(text: str) -> str:
    """argparse type of --device: cpu, cuda or cuda:N."""
    if text == "cpu" or re.fullmatch(r"cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        type=_device,
        help="torch device to build and run on: cpu, cuda or cuda:N (default cpu)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPE_NAMES),
        help="dtype of the unfused and fused models (the reference is always float64)",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the weights and inputs (default 0)",
    )


def _add_arch_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        nargs="+",
        action="extend",
        default=[],
        metavar="A",
        help="architectures to include: names or globs such as 'qwen*' (default: all); repeatable",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fusion-harness",
        description="Differential testing of fused vs unfused Transformers models: every "
        "causal-LM architecture as a tiny random model, fused with fusion.fuse and compared "
        "with the unfused model and a float64 reference.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_run_parser(commands)
    _add_other_parsers(commands)
    _add_results_parsers(commands)
    _add_check_parser(commands)
    return parser


def _add_run_parser(commands: Any) -> None:
    """The `run` subcommand and its options."""
    run = commands.add_parser(
        "run",
        help="sweep the corpus and judge parity",
        description="For each architecture: build the tiny model, fuse a deep copy, run the "
        "unfused, fused and float64 forwards on identical seeded inputs (batch 2, 6 tokens, one "
        "padded row), judge the logits and every fused module, and record a result. Results "
        "are appended to a JSONL file as they finish; Ctrl-C keeps them and --resume continues. "
        "Exit status: 0 green (inconclusive included); 1 a fusion failure (parity, a fused-only "
        "error, a fuse error, a lifecycle failure, a crashed or timed-out worker); 3 no fusion "
        "failure but a corpus problem (the unfused model could not be built or run: "
        "build-error, forward-error), 1 too with --strict-corpus; 4 with --fail-on-drift-loss: "
        "fusions lost against the golden plan (of this Transformers line, else of the "
        "nearest line); 2 bad usage; 130 interrupted.",
    )
    _add_arch_option(run)
    _add_model_options(run)
    run.add_argument(
        "--perf",
        action="store_true",
        help="the performance verdict instead of the parity sweep: the same as "
        "`fusion-harness perf` with the other options (see `fusion-harness perf --help`)",
    )
    run.add_argument(
        "-j",
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="worker processes (default: number of CPUs)",
    )
    run.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="seconds one architecture may take before its worker is killed (default 120; "
        "600 for the inductor systems, whose first call compiles; 300 for vllm)",
    )
    run.add_argument(
        "--system",
        choices=list(SYSTEM_NAMES),
        default=SYSTEM_NAMES[0],
        help="the system under test (harness.runner.systems): 'fusion' (default) fuses with "
        "fusion.fuse; 'inductor' compiles the unfused model with torch.compile (Inductor) and "
        "'inductor-freezing' with Inductor's freezing; 'vllm' applies vLLM's own fusers with "
        "its layers' native forwards (only where vLLM imports: tox -e vllm-peer's "
        "environment); all are judged by the same parity oracle",
    )
    run.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSONL results file, rewritten by a fresh run "
        "(default results/sweep-DTYPE-DEVICE.jsonl, with --shard "
        "results/sweep-DTYPE-DEVICE-shardKofN.jsonl)",
    )
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="FILE",
        help="continue the sweep recorded in this JSONL file: skip what it holds, append the rest",
    )
    run.add_argument("--json", type=Path, metavar="FILE", help="also write a JSON summary here")
    run.add_argument(
        "--repro-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where repro bundles of failures go (default {DEFAULT_REPRO_DIR})",
    )
    run.add_argument(
        "--lifecycle",
        choices=("off", "quick", "full", "all"),
        default="quick",
        help="lifecycle parity after the forward verdict (harness.oracles.lifecycle): generate, a "
        "training step, save_pretrained -> stock from_pretrained, load_state_dict and in-place "
        "weight edits after a forward, deepcopy, torch.save. 'quick' (default) runs them all "
        "but torch.compile; 'full' also compiles a selection of architectures (what "
        "`tox -e conformance` runs); 'all' compiles every architecture (seconds each); 'off' "
        "skips them",
    )
    run.add_argument(
        "--update-expected",
        action="store_true",
        help="write the fusion plans of this run into the golden file of the installed "
        "Transformers line, corpus/expected/MAJOR.MINOR.json (only the architectures run are "
        "replaced), and print what changed; review it as a git diff",
    )
    _add_flag(run, "--strict-corpus", STRICT_CORPUS_HELP)
    _add_flag(run, "--fail-on-drift-loss", DRIFT_HELP)
    _add_flag(run, "--wide", WIDE_HELP)
    run.add_argument(
        "--shard",
        metavar="K/N",
        default=None,
        help="run only shard K (1-based) of N of the selected architectures: a stable "
        "partition (sorted names round-robin, or balanced by --balance), the same on every "
        "machine; merge the shards' results files with `fusion-harness merge`",
    )
    run.add_argument(
        "--balance",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --shard: balance the shards by the per-architecture seconds recorded in "
        "this earlier results file (every shard must be given the same file)",
    )
    run.set_defaults(handler=cmd_run)


STRICT_CORPUS_HELP = (
    "exit 1, not 3, when the only problems are the corpus's (an unfused model that could not "
    "be built or run)"
)
DRIFT_HELP = (
    "exit 4 (when nothing else failed) if this run fuses fewer instances of a module class "
    "than the golden plan it is judged against: the plan of the installed Transformers line, "
    "or, for a line without one, of the nearest line (the newest older one); the drift "
    "section, printed after the table whenever the plans differ and always for a line "
    "without its own plan, lists what was gained and lost per module class with the "
    "fusers' reasons. Needs the golden options (float32, cpu, seed 0) and the fusion system"
)
WIDE_HELP = (
    "print the table in full: whole names, fusions and per-operation lifecycle verdicts, and "
    "the tolerance column (default: cut to fit 100 columns)"
)


def _add_flag(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """A boolean option shared by several subcommands (`--strict-corpus`, `--wide`)."""
    parser.add_argument(flag, action="store_true", help=help_text)


def _add_other_parsers(commands: Any) -> None:
    """The `list`, `show`, `repro` and (for --help) `bench` subcommands."""
    listing = commands.add_parser(
        "list",
        help="the corpus with build status",
        description="Every causal-LM architecture of the installed Transformers: those the "
        "corpus builds (each is built, in worker processes) and those it knows it cannot "
        "build, with the reason.",
    )
    _add_arch_option(listing)
    _add_model_options(listing)
    listing.add_argument(
        "-j",
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="worker processes",
    )
    listing.add_argument(
        "--timeout", type=positive_float, default=120.0, metavar="S", help="seconds per build"
    )
    listing.set_defaults(handler=cmd_list)

    show = commands.add_parser(
        "show",
        help="the fusion plan and rewritten forwards of one architecture",
        description="Build ARCH, print its fusion plan (what would be fused, what was refused "
        "and why), then fuse it and print a unified diff of every rewritten forward.",
    )
    show.add_argument("arch", metavar="ARCH", help="architecture name (see `fusion-harness list`)")
    _add_model_options(show)
    show.set_defaults(handler=cmd_show)

    replay = commands.add_parser(
        "repro",
        help="replay a repro bundle",
        description="Rebuild the tiny model of the bundle in DIR from its JSON config and seed, "
        "fuse and check it. Exit status 1 if the recorded failure reproduces, 0 if not, 2 if the "
        "bundle is malformed (the message names the missing or bad field).",
    )
    replay.add_argument("dir", type=Path, metavar="DIR", help="bundle directory")
    replay.set_defaults(handler=cmd_repro)

    # Listed for --help only: `main` hands `bench ...` to harness.speed.bench, which owns its options
    # (building them here would import torch for every command).
    commands.add_parser(
        "bench",
        help="fused vs unfused timings",
        description="see `fusion-harness bench --help`",
    )
    commands.add_parser(
        "calibrate",
        help="measure which kernels are faster on this machine",
        description="see `fusion-harness calibrate --help`",
    )
    commands.add_parser(
        "perf",
        help="performance verdict per architecture (fused vs unfused at real widths)",
        description="see `fusion-harness perf --help`",
    )


def _add_results_parsers(commands: Any) -> None:
    """The `report` and `merge` subcommands: results files in, no sweep."""
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
    _add_flag(report, "--strict-corpus", STRICT_CORPUS_HELP)
    report.set_defaults(handler=cmd_report)

    merge = commands.add_parser(
        "merge",
        help="merge shards' results files into one",
        description="Merge the results files of `fusion-harness run --shard K/N` runs into "
        "one sweep's results and print the summary a whole sweep prints. Refuses (exit 2) "
        "files of different dtype, device, seed, system or Transformers/torch versions, and an "
        "architecture with different results in two files. Otherwise exits as `run` would "
        "on the merged results: 0, 1 (a fusion failure) or 3 (corpus problems only).",
    )
    merge.add_argument("inputs", type=Path, nargs="+", metavar="FILE", help="results files")
    merge.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the merged results file here (JSONL, as `run` writes)",
    )
    merge.add_argument("--json", type=Path, metavar="FILE", help="also write a JSON summary here")
    _add_flag(merge, "--strict-corpus", STRICT_CORPUS_HELP)
    _add_flag(merge, "--fail-on-drift-loss", DRIFT_HELP)
    _add_flag(merge, "--wide", WIDE_HELP)
    merge.set_defaults(handler=cmd_merge)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (see the module docstring).

    Started as a program (`argv` None), the first Ctrl-C interrupts and any further one is
    ignored, so the bounded clean-up (workers killed, table printed, results kept) finishes
    without "Exception ignored" noise or a traceback.
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
    try:
        if argv[:1] == ["bench"]:
            return _bench(argv[1:])
        if argv[:1] == ["perf"] or (argv[:1] == ["run"] and "--perf" in argv):
            from harness.speed import perf  # imports torch: only for this command

            return perf.main([a for a in argv[1:] if a != "--perf"])
        if argv[:1] == ["calibrate"]:
            from harness.speed import calibration  # imports torch: only for this command

            return calibration.main(argv[1:])
        args = build_parser().parse_args(argv)
        args.argv = argv
        return args.handler(args)
    except Exception as exc:
        if not isinstance(exc, _usage_errors()):
            raise
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


def _usage_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are the user's input, not a bug: a one-line message and exit 2.

    Classes of modules not imported yet cannot have been raised, so they are not imported here.
    """
    errors: list[type[BaseException]] = [UsageError, ResultsError]
    if "harness.base.architectures" in sys.modules:
        from harness.base import architectures

        errors += [architectures.UnknownArchitecture, architectures.PluginError]
    if "harness.reporting.plans" in sys.modules:
        from harness.reporting import plans

        errors.append(plans.PlanError)
    if "harness.runner.shard" in sys.modules:
        from harness.runner import shard

        errors.append(shard.ShardError)
    if "harness.runner.own_model_check" in sys.modules:
        from harness.runner import own_model_check

        errors.append(own_model_check.OwnModelError)
    return tuple(errors)


def _bench(argv: list[str]) -> int:
    """`fusion-harness bench ...`: harness.speed.bench parses its own options and runs."""
    if any(a == "--arch" or a.startswith("--arch=") for a in argv):
        raise UsageError(
            "bench does not take --arch: it times kernels and model slices at real model "
            "widths, not corpus architectures; choose them with --kernel K "
            "(see `fusion-harness bench --help`)"
        )
    from harness.speed import bench

    return bench.main(argv)


def _check_options(args: argparse.Namespace):
    """harness.runner.arch_check.CheckOptions from the parsed options (imports torch)."""
    from harness.base import architectures
    from harness.runner import arch_check

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available here")
    return arch_check.CheckOptions(
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        plugins=architectures.plugins_from_env(),
        lifecycle=getattr(args, "lifecycle", "quick"),
        system=getattr(args, "system", SYSTEM_NAMES[0]),
    )


def _selected(args: argparse.Namespace, plugins: Sequence[str]) -> list[str]:
    from harness.base import architectures

    return architectures.select(args.arch, architectures.available(plugins))


def cmd_run(args: argparse.Namespace) -> int:
    """`fusion-harness run`: sweep, print the table, write --json; returns the exit status.

    Every output is checked before the sweep starts (a results file that is a directory,
    locked or not writable; a --json or --repro-dir that cannot be created), so a bad path
    costs seconds, not a sweep. An output that fails later (a full disk) never changes a
    verdict: the table is printed first, the failure is one line on stderr, and the exit
    status is the sweep's (1 or 130) or, for a sweep that was green, 2.
    """
    if args.resume and args.results and args.resume != args.results:
        raise UsageError(
            "--resume FILE is also the results file; do not pass a different --results"
        )
    if args.jobs < 1 or (args.timeout is not None and args.timeout <= 0):
        raise UsageError("-j must be at least 1 and --timeout positive")
    part, durations = _shard_of(args)
    results_path = args.resume or args.results or _default_results(args, part)
    if results_path.is_dir():
        raise UsageError(f"{results_path} is a directory; the results file must be a file")
    if args.json is not None:
        _probe_file(args.json, "--json")
    repro_dir = _repro_dir(args)

    from harness.reporting import drift, summary
    from harness.runner import pool, progress, shard, sweep, systems

    pool.start_server()  # its imports overlap with ours (corpus enumeration below)
    options = _check_options(args)
    problem = systems.unavailable(options.system)
    if problem is not None:
        raise UsageError(f"--system {options.system}: {problem}")
    timeout = args.timeout if args.timeout is not None else systems.get(options.system).timeout
    if args.update_expected:
        _check_golden_options(options)
    line = _installed_line()
    reference = _drift_reference(options, line, gate=args.fail_on_drift_loss)
    names = _selected(args, options.plugins)
    if part is not None:
        chosen = shard.pick(names, part, durations)
        print(f"shard {part}: {len(chosen)} of {len(names)} architectures", file=sys.stderr)
        names = chosen
    sweep_options = sweep.SweepOptions(
        architectures=names,
        check=options,
        jobs=args.jobs,
        timeout=timeout,
        results=results_path,
        resume=args.resume is not None,
        repro_dir=repro_dir,
    )
    bar = progress.Progress()
    try:
        run = sweep.sweep(sweep_options, on_start=bar.start, on_result=bar.advance)
    finally:
        bar.close()
    verdict = summary.exit_status(run.results, strict_corpus=args.strict_corpus)
    found = None
    if reference is not None and not run.interrupted:
        found = drift.drift(run.results, reference, line=line)
        verdict = drift.exit_status(verdict, found, gate=args.fail_on_drift_loss)
    status = EXIT_INTERRUPTED if run.interrupted else verdict
    if run.write_error:
        _error(run.write_error)
        status = status or EXIT_USAGE
    if args.json:
        # Before the table: a reader that closes stdout early (`| head`) must not cost the
        # summary file.
        document = summary.json_document(
            run.results,
            options={**vars(options), "jobs": args.jobs, "timeout": timeout},
            wall=run.wall,
            interrupted=run.interrupted,
            status=status,
        )
        if found is not None:
            document["drift"] = dataclasses.asdict(found)
        status = _write_json(args.json, document, status)
    try:
        _print_summary(run.results, options, wall=run.wall, jobs=args.jobs, wide=args.wide)
        _print_drift(found, gate=args.fail_on_drift_loss)
        print(f"results: {results_path}", flush=True)
    except BrokenPipeError:
        _stdout_closed()
    if not run.interrupted and _explain(verdict, run.results, found):
        print(_explain(verdict, run.results, found), file=sys.stderr)
    if run.interrupted:
        missing = len(names) - len(run.results)
        again = resume_command(getattr(args, "argv", None), results_path)
        print(
            f"interrupted: {missing} architectures not run; continue with `{again}`",
            file=sys.stderr,
        )
        return status
    if args.update_expected:
        _update_expected(run.results, options)
    return status


def resume_command(argv: Sequence[str] | None, results: Path) -> str:
    """The command line that continues an interrupted `run`: its own arguments (`argv`,
    starting with "run") with --results and --resume (argparse's abbreviations of them too)
    replaced by `--resume RESULTS`, quoted for a POSIX shell, so a sweep of ten architectures
    resumes as those ten under the same options, not as the whole corpus. Without `argv` (a
    caller that parsed none), the bare resume."""
    kept: list[str] = []
    skip = False
    for arg in list(argv or ["run"])[1:]:
        if skip:
            skip = False
            continue
        name, equals, _ = arg.partition("=")
        if len(name) > 3 and any(o.startswith(name) for o in ("--results", "--resume")):
            skip = not equals
            continue
        kept.append(arg)
    return shlex.join(["fusion-harness", "run", *kept, "--resume", str(results)])


def _stdout_closed() -> None:
    """The reader of stdout went away (`fusion-harness run | head`): point stdout at
    /dev/null so later prints and the interpreter's final flush do not raise again; the
    results file and the JSON summary are written regardless, and the exit status stays
    the verdict's."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _write_json(path: Path, document: dict[str, Any], status: int) -> int:
    """Write the --json `document` to `path`; returns `status`, or EXIT_USAGE for a green
    run whose JSON could not be written (one line on stderr): a failed output never changes
    a red verdict."""
    try:
        _write_text(path, json.dumps(document, indent=1, allow_nan=False) + "\n")
    except OSError as exc:
        _error(f"cannot write --json {path}: {exc.strerror or exc}")
        return status or EXIT_USAGE
    return status


def _print_summary(
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

    system = getattr(options, "system", SYSTEM_NAMES[0])
    ours = system == SYSTEM_NAMES[0]
    print(f"system under test: {system}")
    print(summary.format_table(results, wide=wide))
    print(summary.format_legend(wide=wide))
    golden = _golden_entries(options) if ours else None
    problems = summary.format_problems(results, golden=golden)
    if problems:
        print("\n" + problems)
    print("\n" + summary.format_totals(summary.totals(results), wall=wall, jobs=jobs))
    for reason in summary.not_run_reasons(results):
        print(f"note: {reason}")
    if ours:
        print(reach.format_reach(reach.reach(results)))


def _error(message: str) -> None:
    sys.stdout.flush()
    print(f"fusion-harness: error: {message}", file=sys.stderr)


def _default_results(args: argparse.Namespace, part: Any = None) -> Path:
    """results/sweep-DTYPE-DEVICE.jsonl (as harness.runner.sweep.default_results, without torch;
    sweep-SYSTEM-DTYPE-DEVICE.jsonl for a --system other than fusion);
    for a shard results/sweep-DTYPE-DEVICE-shardKofN.jsonl, so shards sharing a directory
    never share (and lock each other out of) a file."""
    tag = f"-{part.tag}" if part is not None else ""
    system = getattr(args, "system", SYSTEM_NAMES[0])
    prefix = "" if system == SYSTEM_NAMES[0] else f"{system}-"
    device = args.device.replace(":", "")
    return Path("results") / f"sweep-{prefix}{args.dtype}-{device}{tag}.jsonl"


def _shard_of(args: argparse.Namespace) -> tuple[Any, dict[str, float] | None]:
    """(harness.runner.shard.Shard, recorded durations or None) of --shard/--balance, or (None,
    None) without --shard; ShardError or ResultsError (exit 2) for a bad value or file."""
    if args.shard is None:
        if args.balance is not None:
            raise UsageError("--balance FILE balances shards; it needs --shard K/N")
        return None, None
    from harness.base.results import read_results
    from harness.runner import shard

    part = shard.Shard.parse(args.shard)
    durations = shard.durations_of(read_results(args.balance)) if args.balance else None
    return part, durations


def _write_text(path: Path, text: str) -> None:
    """Write `text` to `path` (a file, or a device such as /dev/stdout); OSError if it fails,
    flush and close included (a full disk shows up there)."""
    with path.open("w", encoding="utf-8") as handle:
        handle.write(text)


def _probe_file(path: Path, option: str) -> None:
    """UsageError unless `path` can be opened for writing; leaves no file behind.

    Opened in append mode, so an existing file (or a device such as /dev/stdout) is untouched;
    a file the probe created is removed again. Checks what permission bits cannot tell root:
    a read-only file system, a missing parent, a directory.
    """
    existed = path.exists()
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory")
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        with contextlib.suppress(OSError):
            path.unlink()


def _probe_dir(path: Path) -> str | None:
    """Why `path` cannot hold new directories (None if it can); creates nothing lasting.

    A directory that does not exist yet is judged by its nearest existing ancestor, where a
    temporary directory is made and removed, since that is what creating it will need.
    """
    target = path
    while not target.exists():
        if target.parent == target:
            break
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    try:
        tempfile.TemporaryDirectory(dir=target, prefix=".fusion-harness-probe-").cleanup()
    except OSError as exc:
        return f"{target}: {exc.strerror or exc}"
    return None


def _repro_dir(args: argparse.Namespace) -> Path | None:
    """Where bundles go: --repro-dir (UsageError if it cannot be written) or the default
    (a warning and no bundles if it cannot be written: the user did not ask for it)."""
    path = args.repro_dir or DEFAULT_REPRO_DIR
    problem = _probe_dir(path)
    if problem is None:
        return path
    if args.repro_dir is not None:
        raise UsageError(f"--repro-dir {path} cannot be written: {problem}")
    print(
        f"fusion-harness: warning: no repro bundles this run ({problem}); use --repro-dir DIR",
        file=sys.stderr,
    )
    return None


def _golden_entries(options) -> dict[str, Any] | None:
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


def _check_golden_options(options) -> None:
    from harness.reporting import plans

    if options.system != SYSTEM_NAMES[0]:
        raise UsageError(
            f"--update-expected records fusion plans; system {options.system} has none"
        )
    chosen = {k: getattr(options, k) for k in plans.GOLDEN_OPTIONS}
    if chosen != plans.GOLDEN_OPTIONS:
        raise UsageError(
            f"--update-expected records golden plans with {plans.GOLDEN_OPTIONS}, not {chosen}"
        )


def _installed_line() -> str:
    from harness.reporting import plans

    return plans.transformers_line()


def _drift_reference(options: Any, line: str, *, gate: bool) -> Any:
    """The golden file (harness.reporting.plans.Golden) a run on Transformers `line` is judged against
    for drift (harness.reporting.drift.reference_line), or None when there is none usable: another
    system, other options, no golden file at all, or (a warning) an unreadable one. With
    `gate` (--fail-on-drift-loss) each of those is a UsageError or PlanError (exit 2) before
    the sweep: a gate that cannot judge must not pass."""
    from harness.reporting import drift, plans

    system = getattr(options, "system", SYSTEM_NAMES[0])
    why = ""
    if system != SYSTEM_NAMES[0]:
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
        raise UsageError(f"--fail-on-drift-loss: {why}")
    return golden


def _print_drift(found: Any, *, gate: bool) -> None:
    """The drift section (harness.reporting.drift.format_drift) when there is something to say: always
    for a line judged against another line's plan, else only when the plans differ."""
    from harness.reporting import drift

    if found is None:
        return
    if found.own and not (found.losses or found.gains or found.statuses):
        return
    print("\n" + drift.format_drift(found, gate=gate))


def _explain(status: int, results: Sequence[Any], found: Any) -> str:
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


def _update_expected(results, options) -> None:
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


def cmd_list(args: argparse.Namespace) -> int:
    """`fusion-harness list`: every selected architecture with its build status, in name
    order, each line printed as soon as it and every name before it are known (the builds
    run in workers, dispatched in that order), so `list | head` shows its lines at once.
    Returns 0 when every buildable one built, 3 (a corpus problem, as `run`) otherwise; a
    reader that stops reading ends the listing quietly (the workers are stopped, exit 0)."""
    from harness.base import architectures
    from harness.runner import pool, sweep

    pool.start_server()
    options = _check_options(args)
    unbuildable = architectures.unbuildable()
    chosen = architectures.select(
        args.arch, [*architectures.available(options.plugins), *unbuildable]
    )
    names = [n for n in chosen if n not in unbuildable]
    statuses = {name: f"unbuildable: {unbuildable[name]}" for name in chosen if name in unbuildable}
    outcomes = pool.run_tasks(
        [(name, (name, options)) for name in names],
        sweep.build_task,
        jobs=args.jobs,
        timeout=args.timeout,
        setup=sweep.setup_worker,
        setup_args=(options.plugins,),
    )
    width = max((len(n) for n in chosen), default=0)
    printer = _InOrder(chosen, width)
    with contextlib.closing(outcomes):
        try:
            printer.flush(statuses)
            for outcome in outcomes:
                failed = f"{outcome.status}: {outcome.detail}"
                statuses[outcome.key] = outcome.value if outcome.status == "done" else failed
                printer.flush(statuses)
        except BrokenPipeError:
            _stdout_closed()
            return 0
    built = sum(statuses[n].startswith("ok") for n in names)
    print(
        f"\n{len(names)} in the corpus, {built} built; "
        f"{len(chosen) - len(names)} known unbuildable",
        file=sys.stderr,
    )
    return 0 if built == len(names) else EXIT_CORPUS


@dataclasses.dataclass
class _InOrder:
    """Prints `names` in their order, each as soon as it and all before it have a status."""

    names: Sequence[str]
    width: int
    printed: int = 0

    def flush(self, statuses: dict[str, str]) -> None:
        """Print every not yet printed name whose status (and every earlier one's) is known;
        BrokenPipeError when the reader of stdout went away."""
        while self.printed < len(self.names) and self.names[self.printed] in statuses:
            name = self.names[self.printed]
            print(f"{name:<{self.width}}  {statuses[name]}", flush=True)
            self.printed += 1


def cmd_show(args: argparse.Namespace) -> int:
    import difflib

    import fusion
    from harness.base import architectures
    from harness.runner import repro

    options = _check_options(args)
    unbuildable = architectures.unbuildable()
    if args.arch in unbuildable:
        print(f"fusion-harness: {args.arch} is known unbuildable: {unbuildable[args.arch]}")
        return EXIT_CORPUS
    names = architectures.available(options.plugins)
    if args.arch not in names:
        try:
            matched = architectures.select([args.arch], names)
        except architectures.UnknownArchitecture:
            close = difflib.get_close_matches(args.arch, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(
                f"no architecture named {args.arch!r}{hint} "
                "(show takes one name; `fusion-harness list` lists them)"
            ) from None
        raise UsageError(f"show takes one architecture; {args.arch!r} matches {', '.join(matched)}")
    try:
        model = architectures.build(
            args.arch,
            seed=options.seed,
            dtype=options.torch_dtype,
            device=options.device,
            plugins=options.plugins,
        )
    except Exception as exc:
        print(f"fusion-harness: cannot build {args.arch}: {exc}", file=sys.stderr)
        return EXIT_CORPUS
    print(fusion.plan(model))
    report = fusion.fuse(model)
    rewritten = [r for r in report.applied if r.original_source is not None]
    if not rewritten:
        print("\nno forward was rewritten")
    for record in rewritten:
        print(f"\n### {record}")
        print(repro.source_files([record])["forward.diff"] or "(rewritten source is identical)")
    return 0


def _add_check_parser(commands: Any) -> None:
    """The `check` subcommand: one local model (harness.runner.own_model_check)."""
    own = commands.add_parser(
        "check",
        help="your own model: a local checkpoint or config.json",
        description="Check a model of your own with the oracles the sweep runs on the corpus: "
        "the fusion plan, fused vs unfused parity against a float64 reference, the lifecycle "
        "checks and a repro bundle for each failure. PATH is a local directory written by "
        "save_pretrained (config.json + safetensors), a Hub cache folder (its snapshot), a "
        ".gguf file loaded and dequantized by Transformers (the [gguf] extra), or a config.json "
        "file; nothing is ever downloaded, and a config naming custom code (auto_map, trust_remote_code) is refused. "
        "With --tiny the config is shrunk by the corpus's rules and the weights are random "
        "(seconds); without it the model runs at its real size with the checkpoint's weights "
        "(random ones for a bare config), after a memory estimate that refuses what would not "
        "fit. Exit status: 0 green (inconclusive included); 1 a fusion failure; 3 the unfused "
        "model could not be built or run (1 with --strict-corpus); 2 bad usage or a refused "
        "PATH; 130 interrupted.",
    )
    own.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint directory, Hub cache folder, .gguf file (the [gguf] extra) or config.json",
    )
    _add_model_options(own)
    own.add_argument(
        "--tiny",
        action="store_true",
        help="shrink the config with the corpus's rules and use seeded random weights",
    )
    own.add_argument(
        "--force",
        action="store_true",
        help="run even when the memory estimate exceeds the available memory",
    )
    own.add_argument(
        "--lifecycle",
        choices=("off", "quick", "full"),
        default="quick",
        help="lifecycle parity after the forward verdict (as `run`): 'quick' (default) every "
        "operation but torch.compile, 'full' torch.compile too, 'off' none",
    )
    own.add_argument("--json", type=Path, metavar="FILE", help="write the result record here")
    own.add_argument(
        "--repro-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where repro bundles of failures go (default {DEFAULT_REPRO_DIR})",
    )
    _add_flag(own, "--strict-corpus", STRICT_CORPUS_HELP)
    _add_flag(own, "--wide", WIDE_HELP)
    own.set_defaults(handler=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    """`fusion-harness check PATH`: validate PATH, print the model and the memory estimate
    (refusing what would not fit unless --force), check it as `run` checks an architecture,
    write --json, print the plan and `run`'s table; returns `run`'s exit status for the one
    result. Outputs are probed first; a refused PATH is a usage error (2)."""
    if args.json is not None:
        _probe_file(args.json, "--json")
    repro_dir = _repro_dir(args)

    from harness.reporting import summary
    from harness.runner import own_model_check, progress

    options = dataclasses.replace(
        _check_options(args), lifecycle="all" if args.lifecycle == "full" else args.lifecycle
    )
    prepared = own_model_check.prepare(args.path, tiny=args.tiny)
    print(f"checking {prepared.source.path}: {prepared.describe()}", flush=True)
    estimate = None
    if prepared.parameters is not None:
        estimate = own_model_check.estimate_memory(
            prepared.parameters, options.dtype, options.lifecycle
        )
    available = own_model_check.available_memory(options.device)
    print(own_model_check.check_memory(estimate, available, force=args.force), flush=True)
    steps = progress.Steps("check")
    try:
        outcome = own_model_check.run_check(prepared, options, repro_dir=repro_dir, progress=steps)
    finally:
        steps.close()
    results = [outcome.result]
    verdict = summary.exit_status(results, strict_corpus=args.strict_corpus)
    status = verdict
    if args.json:
        document = summary.json_document(
            results,
            options={**vars(options), "source": own_model_check.source_options(prepared)},
            wall=outcome.result.seconds,
            interrupted=False,
            status=status,
        )
        status = _write_json(args.json, document, status)
    try:
        plan = own_model_check.format_plan(outcome.result)
        print(f"{plan}\n" if plan else "", end="")
        print(summary.format_table(results, wide=args.wide))
        print(summary.format_legend(wide=args.wide))
        problems = summary.format_problems(results)
        if problems:
            print("\n" + problems)
        print("\n" + summary.format_totals(summary.totals(results)))
        for note in [*summary.not_run_reasons(results), *outcome.notes]:
            print(f"note: {note}")
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_closed()
    if summary.explain_exit(verdict, results):
        print(summary.explain_exit(verdict, results), file=sys.stderr)
    return status


def cmd_repro(args: argparse.Namespace) -> int:
    from harness.runner import repro

    return repro.replay_main(args.dir)


def cmd_report(args: argparse.Namespace) -> int:
    """`fusion-harness report`: the Markdown summary of a results file (harness.reporting.report_md)
    on stdout or in --out; 0 once written. An unreadable results or golden file, or an --out
    that cannot be written, is a usage error (2)."""
    from harness.base.results import read_results
    from harness.reporting import report_md, speed_report

    try:
        speed = speed_report.read_speed_document(args.results)
    except speed_report.SpeedDocumentError as exc:
        raise UsageError(f"{args.results} is not a readable speed document: {exc}") from None
    except OSError:  # read_results names what is wrong with the path
        speed = None
    if speed is not None:
        return _report_speed(args, speed)
    if args.plot is not None:
        raise UsageError(
            f"--plot draws bench or perf JSON (`bench --json`, `perf --json`); {args.results} "
            "is a results file"
        )
    results = read_results(args.results)
    if not results:
        raise UsageError(f"{args.results} holds no results (an empty file); nothing to report")
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
            _stdout_closed()
        return
    try:
        _write_text(out, text)
    except OSError as exc:
        raise UsageError(f"--out {out} cannot be written: {exc.strerror or exc}") from None
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
        raise UsageError(plot_error)
    return 0


def _golden_comparison(results: Sequence[Any], expected: Path | None) -> tuple[Any, str]:
    """(report_md.GoldenComparison, "") of `results` against --expected, or against the golden
    file of the Transformers line the results record (the installed line when they record
    none); (None, why not) when there is no such file or it holds other options. A bad
    --expected file is a PlanError (exit 2): the user named it."""
    from harness.reporting import plans, report_md

    others = sorted({r.system for r in results} - {SYSTEM_NAMES[0]})
    if others:
        return None, f"golden plans describe the fusion system, these results {', '.join(others)}"
    if expected is not None:
        if not expected.is_file():
            raise UsageError(f"--expected {expected}: no such golden plan file")
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
    reference = _drift_reference(results[0], line, gate=False)
    if reference is None or reference.line == line:
        return None
    if report_md.golden_note_for_options(results, reference):
        return None
    if {r.system for r in results} != {SYSTEM_NAMES[0]}:
        return None
    return drift.drift(results, reference, line=line)


def cmd_merge(args: argparse.Namespace) -> int:
    """`fusion-harness merge`: shards' results files into one sweep (harness.runner.shard.merge),
    printed as `run` prints a sweep; returns `run`'s exit status for the merged results, or 2
    (before writing anything) when the files do not merge or an output cannot be written."""
    from harness.base.results import ResultsWriter, read_results
    from harness.reporting import drift, plans, summary
    from harness.runner import shard

    if args.results is not None and args.results.is_dir():
        raise UsageError(f"--results {args.results} is a directory; it must be a file")
    if args.json is not None:
        _probe_file(args.json, "--json")
    merged = shard.merge([(path, read_results(path)) for path in args.inputs])
    if not merged.results:
        raise UsageError(
            f"{' '.join(map(str, args.inputs))}: no results in any file (empty); nothing to merge"
        )
    first = merged.results[0] if merged.results else None
    options = {
        "dtype": getattr(first, "dtype", None),
        "device": getattr(first, "device", None),
        "seed": getattr(first, "seed", None),
        "system": getattr(first, "system", SYSTEM_NAMES[0]),
        "versions": dict(getattr(first, "versions", {})),
        "merged_from": [str(path) for path in args.inputs],
    }
    recorded = options["versions"].get("transformers")
    line = plans.transformers_line(recorded) if recorded else _installed_line()
    gate = args.fail_on_drift_loss
    reference = _drift_reference(argparse.Namespace(**options), line, gate=gate)
    if args.results is not None:
        with ResultsWriter(args.results, append=False) as writer:
            for result in merged.results:
                writer.write(result)
    verdict = summary.exit_status(merged.results, strict_corpus=args.strict_corpus)
    found = None if reference is None else drift.drift(merged.results, reference, line=line)
    verdict = drift.exit_status(verdict, found, gate=gate)
    status = verdict
    if args.json:
        document = summary.json_document(
            merged.results, options=options, wall=None, interrupted=False, status=status
        )
        if found is not None:
            document["drift"] = dataclasses.asdict(found)
        status = _write_json(args.json, document, status)
    try:
        _print_summary(merged.results, argparse.Namespace(**options), wide=args.wide)
        _print_drift(found, gate=gate)
        repeated = f" ({merged.repeated} recorded twice, identically)" if merged.repeated else ""
        print(f"merged {len(args.inputs)} files: {len(merged.results)} architectures{repeated}")
        if args.results is not None:
            print(f"results: {args.results}", flush=True)
    except BrokenPipeError:
        _stdout_closed()
    if _explain(verdict, merged.results, found):
        print(_explain(verdict, merged.results, found), file=sys.stderr)
    return status

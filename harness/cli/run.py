"""`fusion-harness run`: sweep the corpus, print the table, write the results and --json."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.cli import common, verdicts
from harness.cli.argtypes import positive_float, positive_int


def add_parser(commands: Any) -> None:
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
    common.add_arch_option(run)
    common.add_model_options(run)
    _add_sweep_options(run)
    _add_output_options(run)
    _add_verdict_options(run)


def _add_sweep_options(parser: argparse.ArgumentParser) -> None:
    """How the sweep runs: --perf, workers, timeout, the system under test."""
    parser.add_argument(
        "--perf",
        action="store_true",
        help="the performance verdict instead of the parity sweep: the same as "
        "`fusion-harness perf` with the other options (see `fusion-harness perf --help`)",
    )
    parser.add_argument(
        "-j",
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="worker processes (default: number of CPUs)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help="seconds one architecture may take before its worker is killed (default 120; "
        "600 for the inductor systems, whose first call compiles, and liger; 300 for vllm)",
    )
    parser.add_argument(
        "--system",
        choices=list(common.SYSTEM_NAMES),
        default=common.SYSTEM_NAMES[0],
        help="the system under test (harness.runner.systems): 'fusion' (default) fuses with "
        "fusion.fuse; 'inductor' compiles the unfused model with torch.compile (Inductor) and "
        "'inductor-freezing' with Inductor's freezing; 'vllm' applies vLLM's own fusers with "
        "its layers' native forwards (only where vLLM imports: tox -e vllm-peer's "
        "environment); 'liger' applies Liger Kernel's apply_liger_kernel_to_<type> (needs "
        "liger-kernel and, without a GPU, TRITON_INTERPRET=1); all are judged by the same "
        "parity oracle",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """Where results, the JSON summary and repro bundles go."""
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSONL results file, rewritten by a fresh run "
        "(default results/sweep-DTYPE-DEVICE.jsonl, with --shard "
        "results/sweep-DTYPE-DEVICE-shardKofN.jsonl)",
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="FILE",
        help="continue the sweep recorded in this JSONL file: skip what it holds, append the rest",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write a JSON summary here")
    parser.add_argument(
        "--repro-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where repro bundles of failures go (default {common.DEFAULT_REPRO_DIR})",
    )


def _add_verdict_options(parser: argparse.ArgumentParser) -> None:
    """What is judged and what fails the run: lifecycle, golden plans, gates, shards."""
    parser.add_argument(
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
    parser.add_argument(
        "--update-expected",
        action="store_true",
        help="write the fusion plans of this run into the golden file of the installed "
        "Transformers line, corpus/expected/MAJOR.MINOR.json (only the architectures run are "
        "replaced), and print what changed; review it as a git diff",
    )
    common.add_flag(parser, "--strict-corpus", common.STRICT_CORPUS_HELP)
    common.add_flag(parser, "--fail-on-drift-loss", common.DRIFT_HELP)
    common.add_flag(parser, "--wide", common.WIDE_HELP)
    parser.add_argument(
        "--shard",
        metavar="K/N",
        default=None,
        help="run only shard K (1-based) of N of the selected architectures: a stable "
        "partition (sorted names round-robin, or balanced by --balance), the same on every "
        "machine; merge the shards' results files with `fusion-harness merge`",
    )
    parser.add_argument(
        "--balance",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --shard: balance the shards by the per-architecture seconds recorded in "
        "this earlier results file (every shard must be given the same file)",
    )


def run(args: argparse.Namespace) -> int:
    """`fusion-harness run`: sweep, print the table, write --json; returns the exit status.

    Every output is checked before the sweep starts (a results file that is a directory,
    locked or not writable; a --json or --repro-dir that cannot be created), so a bad path
    costs seconds, not a sweep. An output that fails later (a full disk) never changes a
    verdict: the table is printed first, the failure is one line on stderr, and the exit
    status is the sweep's (1 or 130) or, for a sweep that was green, 2.
    """
    planned = _plan(args)
    swept = _sweep(args, planned)
    return _report(args, planned, swept)


@dataclasses.dataclass
class _Planned:
    """What a run decided before sweeping: its outputs (probed), options and architectures."""

    results_path: Path
    repro_dir: Path | None
    options: Any
    timeout: float
    line: str
    reference: Any
    names: list[str]


def _plan(args: argparse.Namespace) -> _Planned:
    """Check every output and option, start the worker server, choose the architectures (of
    the shard); UsageError (exit 2) before anything runs for what cannot work."""
    if args.resume and args.results and args.resume != args.results:
        raise common.UsageError(
            "--resume FILE is also the results file; do not pass a different --results"
        )
    if args.jobs < 1 or (args.timeout is not None and args.timeout <= 0):
        raise common.UsageError("-j must be at least 1 and --timeout positive")
    part, durations = shard_of(args)
    results_path = args.resume or args.results or default_results(args, part)
    if results_path.is_dir():
        raise common.UsageError(f"{results_path} is a directory; the results file must be a file")
    if args.json is not None:
        common.probe_file(args.json, "--json")
    repro_dir = common.repro_dir(args)

    from harness.runner import pool, shard, systems

    pool.start_server()  # its imports overlap with ours (corpus enumeration below)
    options = common.check_options(args)
    problem = systems.unavailable(options.system)
    if problem is not None:
        raise common.UsageError(f"--system {options.system}: {problem}")
    timeout = args.timeout if args.timeout is not None else systems.get(options.system).timeout
    if args.update_expected:
        verdicts.check_golden_options(options)
    line = verdicts.installed_line()
    reference = verdicts.drift_reference(options, line, gate=args.fail_on_drift_loss)
    names = common.selected(args, options.plugins)
    if part is not None:
        chosen = shard.pick(names, part, durations)
        print(f"shard {part}: {len(chosen)} of {len(names)} architectures", file=sys.stderr)
        names = chosen
    return _Planned(results_path, repro_dir, options, timeout, line, reference, names)


def _sweep(args: argparse.Namespace, planned: _Planned) -> Any:
    """The sweep (harness.runner.sweep) with its progress bar; its `SweepRun`."""
    from harness.runner import progress, sweep

    sweep_options = sweep.SweepOptions(
        architectures=planned.names,
        check=planned.options,
        jobs=args.jobs,
        timeout=planned.timeout,
        results=planned.results_path,
        resume=args.resume is not None,
        repro_dir=planned.repro_dir,
    )
    bar = progress.Progress()
    try:
        return sweep.sweep(sweep_options, on_start=bar.start, on_result=bar.advance)
    finally:
        bar.close()


def _report(args: argparse.Namespace, planned: _Planned, run: Any) -> int:
    """The verdict of a finished (or interrupted) sweep: --json first, then the table, drift,
    the exit explanation or the resume command, the golden file update; the exit status."""
    from harness.reporting import drift, summary

    options, results_path = planned.options, planned.results_path
    verdict = summary.exit_status(run.results, strict_corpus=args.strict_corpus)
    found = None
    if planned.reference is not None and not run.interrupted:
        found = drift.drift(run.results, planned.reference, line=planned.line)
        verdict = drift.exit_status(verdict, found, gate=args.fail_on_drift_loss)
    status = common.EXIT_INTERRUPTED if run.interrupted else verdict
    if run.write_error:
        common.error(run.write_error)
        status = status or common.EXIT_USAGE
    if args.json:
        # Before the table: a reader that closes stdout early (`| head`) must not cost the
        # summary file.
        document = summary.json_document(
            run.results,
            options={**vars(options), "jobs": args.jobs, "timeout": planned.timeout},
            wall=run.wall,
            interrupted=run.interrupted,
            status=status,
        )
        if found is not None:
            document["drift"] = dataclasses.asdict(found)
        status = common.write_json(args.json, document, status)
    try:
        verdicts.print_summary(run.results, options, wall=run.wall, jobs=args.jobs, wide=args.wide)
        verdicts.print_drift(found, gate=args.fail_on_drift_loss)
        print(f"results: {results_path}", flush=True)
    except BrokenPipeError:
        common.stdout_closed()
    if not run.interrupted and verdicts.explain(verdict, run.results, found):
        print(verdicts.explain(verdict, run.results, found), file=sys.stderr)
    if run.interrupted:
        missing = len(planned.names) - len(run.results)
        again = resume_command(getattr(args, "argv", None), results_path)
        print(
            f"interrupted: {missing} architectures not run; continue with `{again}`",
            file=sys.stderr,
        )
        return status
    if args.update_expected:
        verdicts.update_expected(run.results, options)
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


def default_results(args: argparse.Namespace, part: Any = None) -> Path:
    """results/sweep-DTYPE-DEVICE.jsonl (as harness.runner.sweep.default_results, without torch;
    sweep-SYSTEM-DTYPE-DEVICE.jsonl for a --system other than fusion);
    for a shard results/sweep-DTYPE-DEVICE-shardKofN.jsonl, so shards sharing a directory
    never share (and lock each other out of) a file."""
    tag = f"-{part.tag}" if part is not None else ""
    system = getattr(args, "system", common.SYSTEM_NAMES[0])
    prefix = "" if system == common.SYSTEM_NAMES[0] else f"{system}-"
    device = args.device.replace(":", "")
    return Path("results") / f"sweep-{prefix}{args.dtype}-{device}{tag}.jsonl"


def shard_of(args: argparse.Namespace) -> tuple[Any, dict[str, float] | None]:
    """(harness.runner.shard.Shard, recorded durations or None) of --shard/--balance, or (None,
    None) without --shard; ShardError or ResultsError (exit 2) for a bad value or file."""
    if args.shard is None:
        if args.balance is not None:
            raise common.UsageError("--balance FILE balances shards; it needs --shard K/N")
        return None, None
    from harness.base.results import read_results
    from harness.runner import shard

    part = shard.Shard.parse(args.shard)
    durations = shard.durations_of(read_results(args.balance)) if args.balance else None
    return part, durations

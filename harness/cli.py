"""The `fusion-harness` command line (also `python -m harness`).

    fusion-harness run    sweep the corpus: build, fuse, compare with a float64 reference
                          (--update-expected: record the golden fusion plans, harness.plans)
    fusion-harness list   the corpus with the build status of every architecture
    fusion-harness show   the fusion plan of one architecture and the diff of every rewrite
    fusion-harness repro  replay a repro bundle (exit 1 if the failure reproduces)
    fusion-harness bench  fused vs unfused timings (harness.bench)

Exit status: 0 success; 1 a parity failure, an unexpected crash or error (run), or a
reproducing failure (repro); 2 bad usage or unusable input (unknown architecture, malformed
bundle, unusable results file); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from harness import architectures, check, summary
from harness.results import ResultsError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


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
        choices=list(check.DTYPES),
        help="dtype of the unfused and fused models (the reference is always float64)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and inputs (default 0)"
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
    parser = argparse.ArgumentParser(
        prog="fusion-harness",
        description="Differential testing of fused vs unfused Transformers models: every "
        "causal-LM architecture as a tiny random model, fused with fusion.fuse and compared "
        "with the unfused model and a float64 reference.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="sweep the corpus and judge parity",
        description="For each architecture: build the tiny model, fuse a deep copy, run the "
        "unfused, fused and float64 forwards on identical seeded inputs (batch 2, 6 tokens, one "
        "padded row), judge the logits and every fused module, and record a result. Results "
        "are appended to a JSONL file as they finish; Ctrl-C keeps them and --resume continues. "
        "Exit status 0 only if no parity failure and no unexpected crash or error.",
    )
    _add_arch_option(run)
    _add_model_options(run)
    run.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="worker processes (default: number of CPUs)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds one architecture may take before its worker is killed (default 120)",
    )
    run.add_argument(
        "--results",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSONL results file, rewritten by a fresh run "
        "(default results/sweep-DTYPE-DEVICE.jsonl)",
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
        default=Path("repro-bundles"),
        metavar="DIR",
        help="where repro bundles of failures go (default repro-bundles)",
    )
    run.add_argument(
        "--update-expected",
        action="store_true",
        help="write the fusion plans of this run into the golden file of the installed "
        "Transformers line, corpus/expected/MAJOR.MINOR.json (only the architectures run are "
        "replaced), and print what changed; review it as a git diff",
    )
    run.set_defaults(handler=cmd_run)

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
        "-j", "--jobs", type=int, default=os.cpu_count() or 1, metavar="N", help="worker processes"
    )
    listing.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="seconds per build"
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

    from harness import bench  # owns its options and handler

    bench.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (
        UsageError,
        architectures.UnknownArchitecture,
        architectures.PluginError,
        ResultsError,
    ) as exc:
        print(f"fusion-harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("fusion-harness: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _check_options(args: argparse.Namespace) -> check.CheckOptions:
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available here")
    return check.CheckOptions(
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        plugins=architectures.plugins_from_env(),
    )


def _selected(args: argparse.Namespace, plugins: Sequence[str]) -> list[str]:
    return architectures.select(args.arch, architectures.available(plugins))


def cmd_run(args: argparse.Namespace) -> int:
    from harness import pool, progress, sweep

    if args.resume and args.results and args.resume != args.results:
        raise UsageError(
            "--resume FILE is also the results file; do not pass a different --results"
        )
    if args.jobs < 1 or args.timeout <= 0:
        raise UsageError("-j must be at least 1 and --timeout positive")
    pool.start_server()  # its imports overlap with ours (corpus enumeration below)
    options = _check_options(args)
    if args.update_expected:
        _check_golden_options(options)
    names = _selected(args, options.plugins)
    results_path = args.resume or args.results or sweep.default_results(options)
    sweep_options = sweep.SweepOptions(
        architectures=names,
        check=options,
        jobs=args.jobs,
        timeout=args.timeout,
        results=results_path,
        resume=args.resume is not None,
        repro_dir=args.repro_dir,
    )
    bar = progress.Progress()
    try:
        run = sweep.sweep(sweep_options, on_start=bar.start, on_result=bar.advance)
    finally:
        bar.close()
    print(summary.format_table(run.results))
    problems = summary.format_problems(run.results)
    if problems:
        print("\n" + problems)
    print("\n" + summary.format_totals(summary.totals(run.results), wall=run.wall, jobs=args.jobs))
    print(f"results: {results_path}")
    if args.json:
        document = summary.json_document(
            run.results,
            options={**vars(options), "jobs": args.jobs, "timeout": args.timeout},
            wall=run.wall,
            interrupted=run.interrupted,
        )
        args.json.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    if run.interrupted:
        missing = len(names) - len(run.results)
        print(
            f"interrupted: {missing} architectures not run; continue with "
            f"`fusion-harness run --resume {results_path}` (same options)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if args.update_expected:
        _update_expected(run.results, options)
    return summary.exit_status(run.results)


def _check_golden_options(options: check.CheckOptions) -> None:
    from harness import plans

    chosen = {k: getattr(options, k) for k in plans.GOLDEN_OPTIONS}
    if chosen != plans.GOLDEN_OPTIONS:
        raise UsageError(
            f"--update-expected records golden plans with {plans.GOLDEN_OPTIONS}, not {chosen}"
        )


def _update_expected(results, options: check.CheckOptions) -> None:
    from harness import plans

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
    from harness import pool, sweep

    pool.start_server()
    options = _check_options(args)
    unbuildable = architectures.unbuildable()
    chosen = architectures.select(
        args.arch, [*architectures.available(options.plugins), *unbuildable]
    )
    names = [n for n in chosen if n not in unbuildable]
    statuses: dict[str, str] = {}
    outcomes = pool.run_tasks(
        [(name, (name, options)) for name in names],
        sweep.build_task,
        jobs=args.jobs,
        timeout=args.timeout,
        setup=sweep.setup_worker,
        setup_args=(options.plugins,),
    )
    with contextlib.closing(outcomes):
        for outcome in outcomes:
            failed = f"{outcome.status}: {outcome.detail}"
            statuses[outcome.key] = outcome.value if outcome.status == "done" else failed
    width = max((len(n) for n in chosen), default=0)
    for name in chosen:
        status = statuses.get(name) or f"unbuildable: {unbuildable[name]}"
        print(f"{name:<{width}}  {status}")
    built = sum(s.startswith("ok") for s in statuses.values())
    print(
        f"\n{len(names)} in the corpus, {built} built; "
        f"{len(chosen) - len(names)} known unbuildable",
        file=sys.stderr,
    )
    return 0 if built == len(names) else 1


def cmd_show(args: argparse.Namespace) -> int:
    import fusion
    from harness import repro

    options = _check_options(args)
    unbuildable = architectures.unbuildable()
    if args.arch in unbuildable:
        print(f"fusion-harness: {args.arch} is known unbuildable: {unbuildable[args.arch]}")
        return 1
    names = architectures.available(options.plugins)
    if args.arch not in names:
        matched = architectures.select([args.arch], names)  # no match: an error with suggestions
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
        return 1
    print(fusion.plan(model))
    report = fusion.fuse(model)
    rewritten = [r for r in report.applied if r.original_source is not None]
    if not rewritten:
        print("\nno forward was rewritten")
    for record in rewritten:
        print(f"\n### {record}")
        print(repro.source_files([record])["forward.diff"] or "(rewritten source is identical)")
    return 0


def cmd_repro(args: argparse.Namespace) -> int:
    from harness import repro

    return repro.replay_main(args.dir)

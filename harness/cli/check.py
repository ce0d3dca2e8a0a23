"""`fusion-harness check PATH`: your own model, a local checkpoint or config.json
(the engine is harness.runner.own_model_check)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from harness.cli import common


def add_parser(commands: Any) -> None:
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
    common.add_model_options(own)
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
        help=f"where repro bundles of failures go (default {common.DEFAULT_REPRO_DIR})",
    )
    common.add_flag(own, "--strict-corpus", common.STRICT_CORPUS_HELP)
    common.add_flag(own, "--wide", common.WIDE_HELP)


def run(args: argparse.Namespace) -> int:
    """`fusion-harness check PATH`: validate PATH, print the model and the memory estimate
    (refusing what would not fit unless --force), check it as `run` checks an architecture,
    write --json, print the plan and `run`'s table; returns `run`'s exit status for the one
    result. Outputs are probed first; a refused PATH is a usage error (2)."""
    if args.json is not None:
        common.probe_file(args.json, "--json")
    repro_dir = common.repro_dir(args)

    from harness.reporting import summary
    from harness.runner import own_model_check, own_model_memory, progress

    options = dataclasses.replace(
        common.check_options(args), lifecycle="all" if args.lifecycle == "full" else args.lifecycle
    )
    prepared = own_model_check.prepare(args.path, tiny=args.tiny)
    print(f"checking {prepared.source.path}: {prepared.describe()}", flush=True)
    estimate = None
    if prepared.parameters is not None:
        estimate = own_model_memory.estimate_memory(
            prepared.parameters, options.dtype, options.lifecycle
        )
    available = own_model_memory.available_memory(options.device)
    print(own_model_memory.check_memory(estimate, available, force=args.force), flush=True)
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
        status = common.write_json(args.json, document, status)
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
        common.stdout_closed()
    if summary.explain_exit(verdict, results):
        print(summary.explain_exit(verdict, results), file=sys.stderr)
    return status

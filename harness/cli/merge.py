"""`fusion-harness merge FILE...`: shards' results files (run --shard K/N) into one sweep."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from harness.cli import common, verdicts


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `merge` subcommand and its options."""
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
    common.add_flag(merge, "--strict-corpus", common.STRICT_CORPUS_HELP)
    common.add_flag(merge, "--fail-on-drift-loss", common.DRIFT_HELP)
    common.add_flag(merge, "--wide", common.WIDE_HELP)
    return merge


def run(args: argparse.Namespace) -> int:
    """`fusion-harness merge`: shards' results files into one sweep (harness.runner.shard.merge),
    printed as `run` prints a sweep; returns `run`'s exit status for the merged results, or 2
    (before writing anything) when the files do not merge or an output cannot be written."""
    from harness.base.results import ResultsWriter, read_results
    from harness.reporting import drift, plans, summary
    from harness.runner import shard

    if args.results is not None and args.results.is_dir():
        raise common.UsageError(f"--results {args.results} is a directory; it must be a file")
    if args.json is not None:
        common.probe_file(args.json, "--json")
    merged = shard.merge([(path, read_results(path)) for path in args.inputs])
    if not merged.results:
        raise common.UsageError(
            f"{' '.join(map(str, args.inputs))}: no results in any file (empty); nothing to merge"
        )
    first = merged.results[0] if merged.results else None
    options = {
        "dtype": getattr(first, "dtype", None),
        "device": getattr(first, "device", None),
        "seed": getattr(first, "seed", None),
        "system": getattr(first, "system", common.SYSTEM_NAMES[0]),
        "versions": dict(getattr(first, "versions", {})),
        "merged_from": [str(path) for path in args.inputs],
    }
    recorded = options["versions"].get("transformers")
    line = plans.transformers_line(recorded) if recorded else verdicts.installed_line()
    gate = args.fail_on_drift_loss
    reference = verdicts.drift_reference(argparse.Namespace(**options), line, gate=gate)
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
        status = common.write_json(args.json, document, status)
    try:
        verdicts.print_summary(merged.results, argparse.Namespace(**options), wide=args.wide)
        verdicts.print_drift(found, gate=gate)
        repeated = f" ({merged.repeated} recorded twice, identically)" if merged.repeated else ""
        print(f"merged {len(args.inputs)} files: {len(merged.results)} architectures{repeated}")
        if args.results is not None:
            print(f"results: {args.results}", flush=True)
    except BrokenPipeError:
        common.stdout_closed()
    if verdicts.explain(verdict, merged.results, found):
        print(verdicts.explain(verdict, merged.results, found), file=sys.stderr)
    return status

"""`fusion-harness show ARCH`: the fusion plan of one architecture and the diff of every rewrite."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harness.cli import common


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `show` subcommand and its options."""
    show = commands.add_parser(
        "show",
        help="the fusion plan and rewritten forwards of one architecture",
        description="Build ARCH, print its fusion plan (what would be fused, what was refused "
        "and why), then fuse it and print a unified diff of every rewritten forward.",
    )
    show.add_argument("arch", metavar="ARCH", help="architecture name (see `fusion-harness list`)")
    common.add_model_options(show)
    return show


def run(args: argparse.Namespace) -> int:
    import difflib

    import fusion
    from harness.base import architectures
    from harness.runner import repro

    options = common.check_options(args)
    unbuildable = architectures.unbuildable()
    if args.arch in unbuildable:
        print(f"fusion-harness: {args.arch} is known unbuildable: {unbuildable[args.arch]}")
        return common.EXIT_CORPUS
    names = architectures.available(options.plugins)
    if args.arch not in names:
        try:
            matched = architectures.select([args.arch], names)
        except architectures.UnknownArchitecture:
            close = difflib.get_close_matches(args.arch, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise common.UsageError(
                f"no architecture named {args.arch!r}{hint} "
                "(show takes one name; `fusion-harness list` lists them)"
            ) from None
        raise common.UsageError(
            f"show takes one architecture; {args.arch!r} matches {', '.join(matched)}"
        )
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
        return common.EXIT_CORPUS
    print(fusion.plan(model))
    report = fusion.fuse(model)
    rewritten = [r for r in report.applied if r.original_source is not None]
    if not rewritten:
        print("\nno forward was rewritten")
    for record in rewritten:
        print(f"\n### {record}")
        print(repro.source_files([record])["forward.diff"] or "(rewritten source is identical)")
    return 0

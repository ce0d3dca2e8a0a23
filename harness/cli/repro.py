"""`fusion-harness repro DIR`: replay a repro bundle (exit 1 if the failure reproduces)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `repro` subcommand and its options."""
    replay = commands.add_parser(
        "repro",
        help="replay a repro bundle",
        description="Rebuild the tiny model of the bundle in DIR from its JSON config and seed, "
        "fuse and check it. Exit status 1 if the recorded failure reproduces, 0 if not, 2 if the "
        "bundle is malformed (the message names the missing or bad field).",
    )
    replay.add_argument("dir", type=Path, metavar="DIR", help="bundle directory")
    return replay


def run(args: argparse.Namespace) -> int:
    from harness.runner import repro

    return repro.replay_main(args.dir)

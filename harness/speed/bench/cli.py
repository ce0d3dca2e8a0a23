"""Fused vs unfused timings: correct timers, benchmark cases and the speedup table.

The `fusion-harness bench` command (`python -m harness.bench`): options, the restart with
`MALLOC_ENV` on CPU, and the run that prints the table (and writes JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from fusion.kernels import policy
from fusion.kernels.calibration import stream_bytes
from harness.cli.argtypes import Parser, positive_float, positive_int
from harness.runner.arch_check import DTYPES
from harness.speed.bench.cases import (
    KERNELS,
    MODELS,
    Case,
    end_to_end_cases,
    kernel_cases,
    model_cases,
)
from harness.speed.bench.table import Row, compiled_ratios, format_table, machine_info, run_case
from harness.speed.bench.timers import (
    MALLOC_ENV,
    copy_bandwidth,
    default_device,
    default_dtype,
    malloc_env_set,
    read_bandwidth,
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to a `fusion-harness` subparsers object; its handler is
    stored as `handler` (called with the parsed namespace, returns the exit status)."""
    parser = subparsers.add_parser(
        "bench",
        help="fused vs unfused timings",
        description="Time fused vs unfused kernels and model slices at real model widths and "
        "print a speedup table (on GPU also achieved bandwidth against the card's copy "
        "bandwidth). Default: the reduced grid; --full for every width and token count.",
    )
    _add_arguments(parser)
    parser.set_defaults(handler=run_from_args)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
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
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --models: also both under torch.compile (Inductor; compiling takes "
        "minutes on a CPU), printing fused+compiled vs compiled",
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
        help="model cases: time N separate copies of the unfused and of the fused model, "
        "taking turns, and pool their rounds (default 1). Where a model's weights lie in "
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


def _reexec_with_malloc_env(argv: Sequence[str]) -> None:
    """Restart this command with `MALLOC_ENV` set (glibc reads it only at process start)."""
    env = {**os.environ, **MALLOC_ENV, "FUSION_BENCH_NO_REEXEC": "1"}
    print(
        "bench: restarting with " + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()),
        file=sys.stderr,
    )
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "harness.speed.bench", *argv], env)


def run_from_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the selected cases and print the table; exit status 0, or 2 for bad options.

    `argv`: the command's own arguments when it was started from the command line; then, on
    CPU without `MALLOC_ENV`, the process restarts itself with it (see the module doc).
    Called as the CLI handler (one argument), it restarts only when the process is
    `fusion-harness bench ...` / `python -m harness bench ...` itself.
    """
    device = args.device or default_device()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print("bench: error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if argv is None and sys.argv[1:2] == ["bench"]:
        argv = sys.argv[2:]
    if (
        argv is not None
        and torch.device(device).type == "cpu"
        and not malloc_env_set()
        and os.environ.get("FUSION_BENCH_NO_REEXEC") != "1"
    ):
        _reexec_with_malloc_env(argv)
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    selected = args.kernel or [*KERNELS, *MODELS]
    if args.models:
        cases = end_to_end_cases(
            device,
            dtype,
            compiled=args.compile,
            tokens=args.tokens,
            calibrate=args.calibrate,
            copies=args.copies,
        )
        if args.kernel:  # --kernel model_* narrows --models to those models
            cases = [case for case in cases if case.kernel in args.kernel]
        return _run_and_print(cases, args, device, dtype)
    cases = kernel_cases(
        device,
        dtype,
        full=args.full,
        kernels=[k for k in selected if k in KERNELS],
        tokens=args.tokens,
    ) + model_cases(
        device,
        dtype,
        full=args.full,
        models=[k for k in selected if k in MODELS],
        tokens=args.tokens,
        calibrate=args.calibrate,
        copies=args.copies,
    )
    return _run_and_print(cases, args, device, dtype)


def _run_and_print(
    cases: Sequence[Case], args: argparse.Namespace, device: str, dtype: torch.dtype
) -> int:
    """Time `cases`, print the table (and, for compiled model cases, fused+compiled vs
    compiled), write --json; exit status 0."""
    gpu = torch.device(device).type == "cuda"
    # The ceiling each memory-bound figure is a fraction of: on a GPU the copy bandwidth, on
    # a CPU the read bandwidth over several times the last-level cache (a decode step reads
    # its weights once; only model cases know their bytes, so only they are measured).
    if gpu:
        copy_bw = copy_bandwidth(device)
    elif any(c.kernel.startswith("model_") for c in cases):
        copy_bw = read_bandwidth(stream_bytes())
    else:
        copy_bw = None
    info = machine_info(device)
    info["clock"] = args.clock
    policy_state = policy.describe()
    info["kernel_policy"] = f"{policy_state['policy']}, table {policy_state['table']}"
    print(
        f"bench: {len(cases)} cases on {info.get('gpu', 'cpu')} ({device}, {args.dtype or dtype}); "
        f"torch {info['torch']}, transformers {info['transformers']}, triton {info['triton']}; "
        f"{info['cpu_model'] or 'cpu'} [{' '.join(info['cpu_flags'])}], ATen "
        f"{info['aten_cpu_capability']}, native kernel {info['native_kernel']}, "
        f"{info['threads']} threads, {args.clock} clock"
        + (f"; {'copy' if gpu else 'read'} bandwidth {copy_bw / 1e9:.1f} GB/s" if copy_bw else ""),
        file=sys.stderr,
    )
    rows: list[Row] = []
    for i, case in enumerate(cases, 1):
        print(f"bench: [{i}/{len(cases)}] {case.id}", file=sys.stderr)
        rows.extend(run_case(case, args.budget, copy_bw, args.clock))
        if gpu:
            torch.cuda.empty_cache()
    print(format_table(rows, bandwidth=copy_bw is not None, ceiling="copy" if gpu else "read"))
    compiled = compiled_ratios(rows)
    if compiled:
        print("\nfused+compiled vs compiled (above 1: fusion still pays under torch.compile):")
        print("\n".join(compiled))
    if args.json:
        document = {
            "machine": info,
            "copy_bandwidth_gbs": copy_bw / 1e9 if copy_bw and gpu else None,
            "read_bandwidth_gbs": copy_bw / 1e9 if copy_bw and not gpu else None,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`fusion-harness bench` as a standalone command (`python -m harness.bench`)."""
    parser = Parser(prog="fusion-harness bench", description=__doc__.split("\n")[0])
    _add_arguments(parser)
    if argv is None:  # started as a command: may restart itself with MALLOC_ENV
        argv = sys.argv[1:]
        return run_from_args(parser.parse_args(argv), argv)
    return run_from_args(parser.parse_args(list(argv)), None)

"""Fused vs unfused timings: correct timers, benchmark cases and the speedup table.

The run of `fusion-harness bench` (`python -m harness.bench`) once its options are parsed
(harness.cli.bench spells them out): the restart with `MALLOC_ENV` on CPU, and the run that
prints the table (and writes JSON).
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
from harness.runner.arch_check import DTYPES
from harness.speed.bench.cases import (
    KERNELS,
    MODELS,
    Case,
    end_to_end_cases,
    kernel_cases,
    model_cases,
)
from harness.speed.bench.decode import decode_cases, format_decode
from harness.speed.bench.table import Row, compiled_ratios, format_table, machine_info, run_case
from harness.speed.bench.timers import (
    MALLOC_ENV,
    copy_bandwidth,
    default_device,
    default_dtype,
    malloc_env_set,
    read_bandwidth,
)


def _reexec_with_malloc_env(argv: Sequence[str]) -> None:
    """Restart this command with `MALLOC_ENV` set (glibc reads it only at process start)."""
    env = {**os.environ, **MALLOC_ENV, "FUSION_BENCH_NO_REEXEC": "1"}
    print(
        "bench: restarting with " + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()),
        file=sys.stderr,
    )
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "harness.bench", *argv], env)


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
    if getattr(args, "generate", False):
        cases = decode_cases(
            device,
            dtype,
            models=args.model,
            prompt=args.prompt,
            new_tokens=args.new_tokens,
            compiled=args.compile,
            copies=args.copies,
            cache=args.cache,
        )
        return _run_and_print(cases, args, device, dtype)
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
    elif any(c.kernel.startswith("model_") or c.kernel == "decode" for c in cases):
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
        f"{info['aten_cpu_capability']}, native kernel {info['native_kernel']} "
        f"(prefetch {info['native_prefetch']}), "
        f"{info['threads']} threads, {args.clock} clock; kernel policy {info['kernel_policy']}"
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
    decode = format_decode(rows)
    if decode:
        print("\ndecode (greedy generate with the KV cache; tokens/s include the prefill):")
        print(decode)
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

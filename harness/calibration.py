"""The `fusion-harness calibrate` command: measure this machine's kernels for real models.

Builds each chosen model at its real widths with a few layers and random weights (from a
named benchmark model, or a local `config.json` / checkpoint directory: never a download),
fuses it, and runs `fusion.calibrate` on it, so every later `fusion.fuse` on this machine
runs a fast kernel exactly where it was measured faster (`fusion.kernels.policy`). `--show`
prints the table this machine has; `--forget` deletes it (the references run again).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

import fusion
from fusion.kernels import calibration
from fusion.kernels.policy import POLICY
from harness.bench.cases import END_TO_END

MODELS = {name: (arch, config) for name, arch, config in END_TO_END}


DESCRIPTION = (
    "Build each model at its real widths (random weights, LAYERS layers), fuse "
    "it, and time every product it runs at each token count and thread count: each fast "
    "kernel against its reference, interleaved. The table is saved under this machine's "
    "key in the cache directory ($FUSION_HARNESS_CACHE, else ~/.cache/fusion-harness); "
    "`fusion.fuse(backend='auto')` then runs a fast kernel only where it measured faster "
    "here, and the reference elsewhere. Minutes per model on a CPU."
)


def build_parser() -> argparse.ArgumentParser:
    """The options of `fusion-harness calibrate`."""
    parser = argparse.ArgumentParser(prog="fusion-harness calibrate", description=DESCRIPTION)
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
    parser.add_argument("--layers", type=int, default=2, help="decoder layers built (default 2)")
    parser.add_argument(
        "--tokens",
        default="1,16,128",
        help="comma-separated token counts to run the model at (default 1,16,128)",
    )
    parser.add_argument(
        "--threads",
        default=None,
        help="comma-separated torch thread counts to measure at (default: torch's current)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--refresh", action="store_true", help="measure again what is measured")
    parser.add_argument(
        "--budget", type=float, default=calibration.BUDGET_S, help="seconds of calls per product"
    )
    parser.add_argument("--show", action="store_true", help="print this machine's table and exit")
    parser.add_argument("--forget", action="store_true", help="delete this machine's table")
    return parser


def main(argv: list[str]) -> int:
    """`fusion-harness calibrate ARGS`: its exit status (2 with a one-line message for input
    that cannot work: a bad list, a missing or malformed config)."""
    args = build_parser().parse_args(argv)
    try:
        return cmd_calibrate(args)
    except ValueError as exc:
        print(f"fusion-harness calibrate: error: {exc}", file=sys.stderr)
        return 2


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{option} {text!r}: expected comma-separated positive integers")
    return values


def _load_config(path: Path) -> Any:
    """A Transformers config from a config.json or a directory holding one (local only)."""
    from transformers import AutoConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--config {path}: no config.json there")
    data = json.loads(file.read_text())
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"--config {path}: config.json has no model_type")
    return AutoConfig.for_model(model_type, **data)


def _build(config: Any, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, name):
            setattr(config, name, min(layers, getattr(config, name)))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _targets(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from transformers import AutoConfig

    targets = []
    for path in args.config or ():
        targets.append((str(path), _load_config(path)))
    names = args.model or ([] if args.config else list(MODELS))
    for name in names:
        arch, config = MODELS[name]
        common = dict(vocab_size=1024, max_position_embeddings=8192)
        targets.append((name, AutoConfig.for_model(arch, **{**common, **config})))
    return targets


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Run the command; returns its exit status (0, or 2 for bad input via ValueError)."""
    if args.forget:
        path = calibration.table_path()
        path.unlink(missing_ok=True)
        POLICY.reset()
        print(f"deleted {path}")
        return 0
    if args.show:
        table = POLICY.table
        print(f"machine {table.key}: {table.machine}")
        print(f"table: {calibration.table_path(table.key)} ({len(table.entries)} entries)")
        for entry in table.entries.values():
            shape = "x".join(map(str, entry.shape))
            print(f"  {entry.op} {shape} {entry.dtype}: {entry.summary(tuple(entry.ratios))}")
        return 0
    tokens = _ints(args.tokens, "--tokens")
    threads = _ints(args.threads, "--threads") if args.threads else None
    dtype = getattr(torch, args.dtype)
    for name, config in _targets(args):
        print(f"{name}: building {args.layers} layers at real widths ({args.dtype})", flush=True)
        fused = _build(config, args.layers, dtype)
        report = fusion.fuse(fused)
        if not report.applied:
            print(f"{name}: fusion.fuse applied nothing; nothing to calibrate")
            continue
        result = fusion.calibrate(
            fused,
            tokens=tokens,
            threads=threads,
            refresh=args.refresh,
            budget_s=args.budget,
            progress=lambda line: print(f"  timing {line}", file=sys.stderr, flush=True),
        )
        print(result, flush=True)
        del fused
    return 0

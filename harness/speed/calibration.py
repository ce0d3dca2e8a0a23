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
import sys
from pathlib import Path
from typing import Any

import torch

import corpus
import fusion
from fusion.kernels import calibration
from fusion.kernels.policy import POLICY
from harness.oracles import localise
from harness.runner import own_model_check, own_model_memory
from harness.speed.bench.cases import END_TO_END

MODELS = {name: (arch, config) for name, arch, config in END_TO_END}


def _load_config(path: Path) -> Any:
    """A Transformers config from a config.json or a directory holding one (local only).

    Read as `check` reads one (`harness.runner.own_model_check.read_config_dict` and `load_config`: strict
    JSON, no custom code, a causal-LM model type the installed Transformers knows), so a bad
    file is one ValueError line naming it (exit 2), never a traceback.
    """
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--config {path}: no config.json there")
    try:
        config, _ = own_model_check.load_config(own_model_check.read_config_dict(file))
    except own_model_check.OwnModelError as exc:
        message = str(exc)
        raise ValueError(
            message if str(file) in message else f"--config {file}: {message}"
        ) from None
    return config


def _memory_line(name: str, config: Any, layers: int, dtype: str, *, force: bool) -> str:
    """The memory estimate of building `config` cut to `layers` layers (the model and the
    fused copy's merged weights) against the available memory, in `check`'s words; ValueError
    (exit 2) where it would not fit, unless `force`. Counted on the meta device, so a config
    of absurd widths is refused before anything is allocated; a model that does not construct
    there refuses too, unless `force`, as `check` does."""
    cut = _cut_layers(config, layers)
    parameters = own_model_check.count_parameters(cut, corpus.arch_for_config(cut))
    if parameters is None:
        if force:
            return (
                "memory: not estimated (the model does not construct on the meta device); --force"
            )
        raise ValueError(
            f"{name}: cannot estimate the memory this model needs (it does not construct on "
            "the meta device: sizes too large to count?); --force builds it anyway"
        )
    size = parameters * own_model_memory.dtype_bytes(getattr(torch, dtype))
    estimate = own_model_memory.MemoryEstimate(
        parameters, dtype, (("model", size), ("fused", size))
    )
    available = own_model_memory.available_memory("cpu")
    if available is None:
        return f"{estimate.format()}; available memory unknown"
    free, where = available
    line = f"{estimate.format()}; {where} {own_model_memory.human_bytes(free)}"
    if estimate.total <= free or force:
        return line + ("; over it, --force" if estimate.total > free else "")
    raise ValueError(
        f"{name}: {line}: it would not fit; try fewer --layers, or --force to build it anyway"
    )


def _build(config: Any, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_cut_layers(config, layers), dtype=dtype).eval()


def _cut_layers(config: Any, layers: int) -> Any:
    """A copy of `config` with at most `layers` decoder layers (`config` untouched)."""
    config = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if hasattr(config, name):
            setattr(config, name, min(layers, getattr(config, name)))
    return config


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
    tokens = args.tokens
    threads = args.threads
    dtype = getattr(torch, args.dtype)
    for name, config in _targets(args):
        memory = _memory_line(name, config, args.layers, args.dtype, force=args.force)
        print(f"{name}: {memory}", flush=True)
        print(f"{name}: building {args.layers} layers at real widths ({args.dtype})", flush=True)
        try:
            fused = _build(config, args.layers, dtype)
        except Exception as exc:  # the user's config (or --force): one line, exit 2
            raise ValueError(f"{name}: cannot build the model: {localise.one_line(exc)}") from None
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

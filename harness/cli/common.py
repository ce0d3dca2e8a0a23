"""Shared by the command modules: exit statuses, the usage error, the options several commands
take, output probes and writers. Imports nothing heavy: building a parser costs no torch."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.base.errors import InputError
from harness.cli.argtypes import non_negative_int

EXIT_USAGE = 2
EXIT_CORPUS = 3
"""A corpus problem and no fusion failure (see the module docstring)."""
EXIT_INTERRUPTED = 130

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""--dtype choices: the keys of harness.runner.arch_check.DTYPES (a test keeps them equal), spelled out here
so that building the parser does not import torch."""

SYSTEM_NAMES = ("fusion", "inductor", "inductor-freezing", "vllm", "liger")
"""--system choices: harness.runner.systems.NAMES (a test keeps them equal), spelled out here for the
same reason; the first is the default."""

DEFAULT_REPRO_DIR = Path("repro-bundles")


class UsageError(ValueError, InputError):
    """Options that cannot work together or on this machine."""


def device(text: str) -> str:
    """argparse type of --device: cpu, cuda or cuda:N."""
    if text == "cpu" or re.fullmatch(r"cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        type=device,
        help="torch device to build and run on: cpu, cuda or cuda:N (default cpu)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPE_NAMES),
        help="dtype of the unfused and fused models (the reference is always float64)",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the weights and inputs (default 0)",
    )


def add_arch_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        nargs="+",
        action="extend",
        default=[],
        metavar="A",
        help="architectures to include: names or globs such as 'qwen*' (default: all); repeatable",
    )


STRICT_CORPUS_HELP = (
    "exit 1, not 3, when the only problems are the corpus's (an unfused model that could not "
    "be built or run)"
)
DRIFT_HELP = (
    "exit 4 (when nothing else failed) if this run fuses fewer instances of a module class "
    "than the golden plan it is judged against: the plan of the installed Transformers line, "
    "or, for a line without one, of the nearest line (the newest older one); the drift "
    "section, printed after the table whenever the plans differ and always for a line "
    "without its own plan, lists what was gained and lost per module class with the "
    "fusers' reasons. Needs the golden options (float32, cpu, seed 0) and the fusion system"
)
WIDE_HELP = (
    "print the table in full: whole names, fusions and per-operation lifecycle verdicts, and "
    "the tolerance column (default: cut to fit 100 columns)"
)


def add_flag(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """A boolean option shared by several subcommands (`--strict-corpus`, `--wide`)."""
    parser.add_argument(flag, action="store_true", help=help_text)


def check_options(args: argparse.Namespace):
    """harness.runner.arch_check.CheckOptions from the parsed options (imports torch)."""
    from harness.base import architectures
    from harness.runner import arch_check

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available here")
    return arch_check.CheckOptions(
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        plugins=architectures.plugins_from_env(),
        lifecycle=getattr(args, "lifecycle", "quick"),
        system=getattr(args, "system", SYSTEM_NAMES[0]),
    )


def selected(args: argparse.Namespace, plugins: Sequence[str]) -> list[str]:
    from harness.base import architectures

    return architectures.select(args.arch, architectures.available(plugins))


def stdout_closed() -> None:
    """The reader of stdout went away (`fusion-harness run | head`): point stdout at
    /dev/null so later prints and the interpreter's final flush do not raise again; the
    results file and the JSON summary are written regardless, and the exit status stays
    the verdict's."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def write_json(path: Path, document: dict[str, Any], status: int) -> int:
    """Write the --json `document` to `path`; returns `status`, or EXIT_USAGE for a green
    run whose JSON could not be written (one line on stderr): a failed output never changes
    a red verdict."""
    try:
        write_text(path, json.dumps(document, indent=1, allow_nan=False) + "\n")
    except OSError as exc:
        error(f"cannot write --json {path}: {exc.strerror or exc}")
        return status or EXIT_USAGE
    return status


def error(message: str) -> None:
    sys.stdout.flush()
    print(f"fusion-harness: error: {message}", file=sys.stderr)


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` (a file, or a device such as /dev/stdout); OSError if it fails,
    flush and close included (a full disk shows up there)."""
    with path.open("w", encoding="utf-8") as handle:
        handle.write(text)


def probe_file(path: Path, option: str) -> None:
    """UsageError unless `path` can be opened for writing; leaves no file behind.

    Opened in append mode, so an existing file (or a device such as /dev/stdout) is untouched;
    a file the probe created is removed again. Checks what permission bits cannot tell root:
    a read-only file system, a missing parent, a directory.
    """
    existed = path.exists()
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory")
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        with contextlib.suppress(OSError):
            path.unlink()


def probe_dir(path: Path) -> str | None:
    """Why `path` cannot hold new directories (None if it can); creates nothing lasting.

    A directory that does not exist yet is judged by its nearest existing ancestor, where a
    temporary directory is made and removed, since that is what creating it will need.
    """
    target = path
    while not target.exists():
        if target.parent == target:
            break
        target = target.parent
    if not target.is_dir():
        return f"{target} is not a directory"
    try:
        tempfile.TemporaryDirectory(dir=target, prefix=".fusion-harness-probe-").cleanup()
    except OSError as exc:
        return f"{target}: {exc.strerror or exc}"
    return None


def repro_dir(args: argparse.Namespace) -> Path | None:
    """Where bundles go: --repro-dir (UsageError if it cannot be written) or the default
    (a warning and no bundles if it cannot be written: the user did not ask for it)."""
    path = args.repro_dir or DEFAULT_REPRO_DIR
    problem = probe_dir(path)
    if problem is None:
        return path
    if args.repro_dir is not None:
        raise UsageError(f"--repro-dir {path} cannot be written: {problem}")
    print(
        f"fusion-harness: warning: no repro bundles this run ({problem}); use --repro-dir DIR",
        file=sys.stderr,
    )
    return None

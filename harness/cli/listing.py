"""`fusion-harness list`: the corpus with the build status of every architecture."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from harness.cli import common
from harness.cli.argtypes import positive_float, positive_int


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `list` subcommand and its options."""
    listing = commands.add_parser(
        "list",
        help="the corpus with build status",
        description="Every causal-LM architecture of the installed Transformers: those the "
        "corpus builds (each is built, in worker processes) and those it knows it cannot "
        "build, with the reason.",
    )
    common.add_arch_option(listing)
    common.add_model_options(listing)
    listing.add_argument(
        "-j",
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="worker processes",
    )
    listing.add_argument(
        "--timeout", type=positive_float, default=120.0, metavar="S", help="seconds per build"
    )
    return listing


def run(args: argparse.Namespace) -> int:
    """`fusion-harness list`: every selected architecture with its build status, in name
    order, each line printed as soon as it and every name before it are known (the builds
    run in workers, dispatched in that order), so `list | head` shows its lines at once.
    Returns 0 when every buildable one built, 3 (a corpus problem, as `run`) otherwise; a
    reader that stops reading ends the listing quietly (the workers are stopped, exit 0)."""
    from harness.base import architectures
    from harness.runner import pool, sweep

    pool.start_server()
    options = common.check_options(args)
    unbuildable = architectures.unbuildable()
    chosen = architectures.select(
        args.arch, [*architectures.available(options.plugins), *unbuildable]
    )
    names = [n for n in chosen if n not in unbuildable]
    statuses = {name: f"unbuildable: {unbuildable[name]}" for name in chosen if name in unbuildable}
    outcomes = pool.run_tasks(
        [(name, (name, options)) for name in names],
        sweep.build_task,
        jobs=args.jobs,
        timeout=args.timeout,
        setup=sweep.setup_worker,
        setup_args=(options.plugins,),
    )
    width = max((len(n) for n in chosen), default=0)
    printer = _InOrder(chosen, width)
    with contextlib.closing(outcomes):
        try:
            printer.flush(statuses)
            for outcome in outcomes:
                failed = f"{outcome.status}: {outcome.detail}"
                statuses[outcome.key] = outcome.value if outcome.status == "done" else failed
                printer.flush(statuses)
        except BrokenPipeError:
            common.stdout_closed()
            return 0
    built = sum(statuses[n].startswith("ok") for n in names)
    print(
        f"\n{len(names)} in the corpus, {built} built; "
        f"{len(chosen) - len(names)} known unbuildable",
        file=sys.stderr,
    )
    return 0 if built == len(names) else common.EXIT_CORPUS


@dataclasses.dataclass
class _InOrder:
    """Prints `names` in their order, each as soon as it and all before it have a status."""

    names: Sequence[str]
    width: int
    printed: int = 0

    def flush(self, statuses: dict[str, str]) -> None:
        """Print every not yet printed name whose status (and every earlier one's) is known;
        BrokenPipeError when the reader of stdout went away."""
        while self.printed < len(self.names) and self.names[self.printed] in statuses:
            name = self.names[self.printed]
            print(f"{name:<{self.width}}  {statuses[name]}", flush=True)
            self.printed += 1

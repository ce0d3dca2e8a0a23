"""Run the corpus through `harness.runner.arch_check` in isolated worker processes.

Each architecture is one task in `harness.runner.pool` (long-lived workers, per-architecture timeout,
a crashed or hung worker replaced and its architecture recorded as crashed/timeout). Every result
is appended to the JSONL results file the moment it arrives, so an interrupted sweep keeps all
finished work and `resume=True` skips it next time.

The results file is locked for the whole sweep (harness.base.results.ResultsWriter) before the
previous results are read, so two sweeps can neither interleave lines nor both run what a
resume left to do. If the file system stops taking results mid-sweep (a full disk), the sweep
still finishes and returns every verdict; `SweepRun.write_error` says what was not recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fusion.kernels import policy
from harness.base import architectures
from harness.base.results import ArchResult, ResultsError, ResultsWriter, from_dict
from harness.reporting import plans
from harness.runner import arch_check, pool, repro, systems

DEFAULT_TIMEOUT = systems.FUSION_TIMEOUT
"""Seconds per architecture for the default system (see `systems.System.timeout`)."""


@dataclass(frozen=True)
class SweepOptions:
    """A sweep: which architectures, how to check them, where results go."""

    architectures: Sequence[str]
    results: Path  # the JSONL file (see `default_results`)
    check: arch_check.CheckOptions = field(default_factory=arch_check.CheckOptions)
    jobs: int = 1
    timeout: float = DEFAULT_TIMEOUT
    resume: bool = False
    repro_dir: Path | None = None


def default_results(options: arch_check.CheckOptions) -> Path:
    """results/sweep-DTYPE-DEVICE.jsonl: one file per configuration, so runs in another dtype
    neither overwrite nor refuse to resume each other; for a system under test other than
    fusion, results/sweep-SYSTEM-DTYPE-DEVICE.jsonl (the fusion file keeps its name)."""
    system = "" if options.system == systems.DEFAULT else f"{options.system}-"
    device = options.device.replace(":", "")
    return Path("results") / f"sweep-{system}{options.dtype}-{device}.jsonl"


@dataclass(frozen=True)
class SweepRun:
    """The results of the selected architectures (earlier ones from a resume included), in
    selection order, and whether the sweep was interrupted before finishing."""

    results: list[ArchResult]
    interrupted: bool
    wall: float
    write_error: str | None = None
    """Why results stopped reaching the results file (None: every result was written)."""


def setup_worker(plugins: tuple[str, ...]) -> None:
    """Run once per worker: import the heavy modules and test plugins, quiet the libraries.

    One intra-op thread per worker: on tiny models a second thread only adds synchronisation
    (a small matmul whose threads contend with another worker's takes orders of magnitude
    longer than alone), so parallelism comes from -j, never from inside a worker.
    """
    import torch
    import transformers

    import corpus  # noqa: F401  (imported here, once, rather than in the first task)
    import fusion  # noqa: F401

    torch.set_num_threads(1)
    # Library warnings from hundreds of tiny configs would drown the progress output; the
    # results record everything that matters.
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    architectures.plugin_architectures(plugins)


def check_task(payload: tuple[str, arch_check.CheckOptions, str | None]) -> dict:
    """Worker side of one architecture: check it, write its repro bundles, return the record.

    Returns the result as a dict (what travels back over the pipe and into the JSONL file).
    Bundles are written here, where the model, config and fusion sources are at hand; their
    directory names de-duplicate identical failures across workers and runs.
    """
    from harness.base.results import to_dict

    name, options, repro_dir = payload
    checked = arch_check.check_architecture(name, options)
    result = checked.result
    if repro_dir and result.failures and checked.subject is not None:
        # Never raises for a bundle it cannot write: the verdict must survive a side file.
        result = repro.write_bundles(result, checked.subject, Path(repro_dir))
    return to_dict(result)


def build_task(payload: tuple[str, arch_check.CheckOptions]) -> str:
    """Worker side of `fusion-harness list`: "ok (class, parameters)" or "error: why"."""
    from harness.oracles.localise import one_line

    name, options = payload
    try:
        model = architectures.build(
            name,
            seed=options.seed,
            dtype=options.torch_dtype,
            device=options.device,
            plugins=options.plugins,
        )
    except Exception as exc:
        return f"error: {one_line(exc)}"
    parameters = sum(p.numel() for p in model.parameters())
    return f"ok ({type(model).__name__}, {parameters:,} parameters)"


def result_of(outcome: pool.Outcome, options: arch_check.CheckOptions) -> ArchResult:
    """The ArchResult for a pool outcome (a crash or timeout gets a result of its own)."""
    if outcome.status == "done":
        return from_dict(outcome.value)
    if outcome.status == "error":  # check_architecture records model failures; this is a bug
        last = outcome.detail.strip().splitlines()[-1] if outcome.detail.strip() else ""
        status, message = "crashed", f"harness error in the worker: {last}"
    else:
        status, message = outcome.status, outcome.detail
    return ArchResult(
        architecture=outcome.key,
        status=status,
        dtype=options.dtype,
        device=options.device,
        seed=options.seed,
        seconds=outcome.seconds,
        message=message,
        system=options.system,
    )


def previous_results(
    path: Path,
    options: arch_check.CheckOptions,
    results: Sequence[ArchResult],
    versions: Mapping[str, str] | None = None,
) -> dict[str, ArchResult]:
    """`results` (read from `path`) by architecture.

    Raises ResultsError if they were computed with another dtype, device, seed or system under
    test, or (given this run's `versions`, harness.reporting.plans.versions) under another Transformers
    or torch, or records no versions at all: mixing them into one table would compare unlike
    with unlike, and `merge` refuses the same mix.
    """
    done = {}
    for result in results:
        if versions is not None:
            _check_versions(path, result, versions)
        ours = (options.dtype, options.device, options.seed)
        theirs = (result.dtype, result.device, result.seed)
        if theirs != ours:
            raise ResultsError(
                f"{path} holds {result.architecture} for dtype/device/seed {theirs}, "
                f"this run is {ours}; resume with the same options or use another file"
            )
        if result.system != options.system:
            raise ResultsError(
                f"{path} holds {result.architecture} judged for system {result.system!r}, "
                f"this run is {options.system!r}; resume with the same --system or use "
                "another file"
            )
        done[result.architecture] = result
    return done


def _check_versions(path: Path, result: ArchResult, versions: Mapping[str, str]) -> None:
    """ResultsError unless `result` was judged under the same Transformers and torch as
    `versions`, both named."""
    theirs = {lib: result.versions.get(lib) for lib in ("transformers", "torch")}
    ours = {lib: versions.get(lib) for lib in ("transformers", "torch")}
    if theirs == ours:
        return
    words = ", ".join(f"{lib} {v or 'unrecorded'}" for lib, v in theirs.items())
    now = ", ".join(f"{lib} {v}" for lib, v in ours.items())
    raise ResultsError(
        f"{path} holds {result.architecture} judged under {words}; this run has {now}: "
        "resume under the same versions or start a fresh file with --results"
    )


def sweep(
    options: SweepOptions,
    *,
    on_start: Callable[[int, int], None] | None = None,
    on_result: Callable[[ArchResult], None] | None = None,
) -> SweepRun:
    """Check every selected architecture not already done; return all their results.

    `on_start(total, already_done)` is called once before any work, `on_result(result)` for
    each new result (both for progress reporting). Ctrl-C (KeyboardInterrupt) stops the sweep:
    workers are killed, the results file keeps every finished line, and the partial run is
    returned with `interrupted=True`. Raises ResultsError before any work when the results
    file cannot be used (locked by another sweep, not writable, not a results file).
    """
    started = time.perf_counter()
    interrupted = False
    write_error: str | None = None
    # Lock first, read second: another sweep cannot add lines between the two.
    with ResultsWriter(options.results, append=options.resume) as writer:
        stamp = plans.versions()  # every record says what judged it (merge checks it)
        done = previous_results(options.results, options.check, writer.previous, stamp)
        todo = [name for name in options.architectures if name not in done]
        if on_start is not None:
            on_start(len(options.architectures), len(options.architectures) - len(todo))
        repro_dir = str(options.repro_dir) if options.repro_dir else None
        tasks = [(name, (name, options.check, repro_dir)) for name in todo]
        outcomes = pool.run_tasks(
            tasks,
            check_task,
            jobs=options.jobs,
            timeout=options.timeout,
            setup=setup_worker,
            setup_args=(tuple(options.check.plugins),),
        )
        unwritten = 0
        machine = policy.describe()  # ...and what chose its kernels
        try:
            with contextlib.closing(outcomes):
                for outcome in outcomes:
                    result = dataclasses.replace(
                        result_of(outcome, options.check), versions=stamp, machine=machine
                    )
                    if write_error is None:
                        try:
                            writer.write(result)
                        except ResultsError as exc:
                            write_error = str(exc)
                    if write_error is not None:
                        unwritten += 1
                    done[result.architecture] = result
                    if on_result is not None:
                        on_result(result)
        except KeyboardInterrupt:
            interrupted = True
    if write_error is not None:
        write_error += f"; {unwritten} result(s) not recorded there (the table has them all)"
    results = [done[name] for name in options.architectures if name in done]
    return SweepRun(results, interrupted, time.perf_counter() - started, write_error)

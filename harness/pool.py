"""A small supervisor for long-lived worker processes, each running one task at a time.

Importing torch and Transformers costs seconds, running one tiny model milliseconds, so workers
import once and then take task after task. Each worker has its own pipe; the parent waits on
every pipe and every process sentinel at once, so it notices a result, a death (segfault,
abort, OOM kill) or an overrun (per-task timeout) as soon as it happens. A dead or killed worker
is replaced and its task reported as "crashed" or "timeout"; no other task is affected.

Workers come from a forkserver that has already imported torch, Transformers and this project
(`harness.preload`; spawn where forkserver is unavailable), so a replacement starts in
milliseconds, not seconds. They ignore
SIGINT: Ctrl-C is the parent's to handle, and closing the `run_tasks` generator (or an exception
in the consumer) kills every worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

PRELOAD = ["harness.preload"]
"""Imported once by the forkserver; every worker forked from it starts with it loaded."""

START_TIMEOUT = 300.0
"""Seconds a worker may take to import and run `setup` before the pool gives up."""


@dataclass(frozen=True)
class Outcome:
    """How one task ended.

    status: "done" (value is the handler's return value), "error" (the handler raised; detail
    is the traceback), "crashed" (the worker died; detail says how) or "timeout".
    seconds: wall time from hand-out to outcome.
    """

    key: str
    status: Literal["done", "error", "crashed", "timeout"]
    value: Any = None
    detail: str = ""
    seconds: float = 0.0


class PoolError(RuntimeError):
    """Workers cannot be started (setup raised, or a worker died or hung before it was ready)."""


@dataclass
class _Worker:
    process: Any
    conn: Connection
    spawned: float
    ready: bool = False
    key: str | None = None  # the task it is running, if any
    started: float = 0.0
    dead: bool = False  # set once its death was seen and accounted for; then it is replaced


def context() -> Any:
    """The multiprocessing context workers come from (forkserver with torch preloaded)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # a no-op once this process's forkserver runs
        return ctx
    return mp.get_context("spawn")


def start_server() -> None:
    """Start the forkserver now, so its preload runs while the caller does other work."""
    if "forkserver" in mp.get_all_start_methods():
        context()
        from multiprocessing import forkserver

        forkserver.ensure_running()


def describe_exit(exitcode: int | None) -> str:
    """'killed by SIGABRT (exit code -6)' / 'exited with status 3' for a dead worker."""
    if exitcode is None:
        return "vanished"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit code {exitcode})"
    return f"exited with status {exitcode}"


def _worker_main(conn: Connection, handler: Callable, setup: Callable | None, setup_args: tuple):
    # Ctrl-C reaches the whole process group; only the parent decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if setup is not None:
            setup(*setup_args)
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        key, payload = message
        try:
            reply = ("done", key, handler(payload))
        except BaseException:
            reply = ("error", key, traceback.format_exc())
        conn.send(reply)


def run_tasks(
    tasks: Sequence[tuple[str, Any]],
    handler: Callable[[Any], Any],
    *,
    jobs: int,
    timeout: float,
    setup: Callable | None = None,
    setup_args: tuple = (),
    start_timeout: float = START_TIMEOUT,
) -> Iterator[Outcome]:
    """Run `handler(payload)` for every (key, payload) in worker processes; yield as they end.

    `handler` and `setup` must be importable module-level functions (they are sent to the
    workers by reference). At most `jobs` workers run; each task gets `timeout` seconds from
    the moment a ready worker receives it. Outcomes arrive in completion order, one per task.
    Raises PoolError if workers cannot start. Leaves no worker behind, however it exits.
    """
    ctx = context()
    pending = deque(tasks)
    workers: list[_Worker] = []

    def spawn() -> _Worker:
        parent_end, child_end = ctx.Pipe()
        process = ctx.Process(
            target=_worker_main, args=(child_end, handler, setup, setup_args), daemon=True
        )
        process.start()
        child_end.close()
        return _Worker(process, parent_end, time.monotonic())

    try:
        while pending or any(w.key is not None for w in workers):
            busy = sum(w.key is not None for w in workers)
            while len(workers) < min(jobs, busy + len(pending)):
                workers.append(spawn())
            for worker in workers:
                if worker.ready and worker.key is None and pending:
                    _assign(worker, pending)
            wait(
                [w.conn for w in workers] + [w.process.sentinel for w in workers],
                timeout=_next_deadline(workers, timeout, start_timeout),
            )
            for worker in list(workers):
                outcome = _service(worker, timeout, start_timeout)
                if outcome is not None:
                    yield outcome
                if worker.dead:
                    workers.remove(worker)
    finally:
        _stop(workers)


def _assign(worker: _Worker, pending: deque) -> None:
    """Hand the next task to an idle worker; if it died meanwhile, the task stays queued."""
    key, payload = pending[0]
    try:
        worker.conn.send((key, payload))
    except OSError:  # its death is seen by _service; the task goes to another worker
        return
    pending.popleft()
    worker.key, worker.started = key, time.monotonic()


def _next_deadline(workers: list[_Worker], timeout: float, start_timeout: float) -> float:
    now = time.monotonic()
    deadlines = [
        (w.started + timeout) if w.key is not None else (w.spawned + start_timeout)
        for w in workers
        if w.key is not None or not w.ready
    ]
    return max(0.0, min(deadlines) - now) if deadlines else 1.0


def _service(worker: _Worker, timeout: float, start_timeout: float) -> Outcome | None:
    """Read the worker's messages and check it is alive and on time; the task's outcome if any.

    Liveness is sampled before the messages are read, so a result sent just before the worker
    died is never mistaken for a crash, and a worker that died after sending one is still
    marked dead (and replaced).
    """
    alive = worker.process.is_alive()
    outcome = _read(worker)
    if not alive:
        worker.process.join()
        worker.dead = True
        how = describe_exit(worker.process.exitcode)
        if not worker.ready:
            raise PoolError(f"a worker died while starting: {how}")
        if outcome is None and worker.key is not None:
            outcome = _finish(worker, "crashed", None, f"worker {how}")
        return outcome
    if outcome is not None:
        return outcome
    now = time.monotonic()
    if worker.key is not None and now - worker.started > timeout:
        _kill(worker)
        return _finish(worker, "timeout", None, f"no result after {timeout:g} s; worker killed")
    if not worker.ready and now - worker.spawned > start_timeout:
        _kill(worker)
        raise PoolError(f"a worker did not start within {start_timeout:g} s")
    return None


def _read(worker: _Worker) -> Outcome | None:
    """Drain the worker's pipe: note readiness, raise on a failed setup, return a task outcome."""
    while worker.conn.poll():
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):  # the worker is gone; the caller sees it is not alive
            return None
        if message[0] == "ready":
            worker.ready = True
        elif message[0] == "fatal":
            _kill(worker)
            raise PoolError(f"worker setup failed:\n{message[1]}")
        elif message[0] == "done":
            return _finish(worker, "done", message[2], "")
        else:
            return _finish(worker, "error", None, message[2])
    return None


def _finish(worker: _Worker, status: str, value: Any, detail: str) -> Outcome:
    outcome = Outcome(
        key=worker.key or "",
        status=status,  # type: ignore[arg-type]
        value=value,
        detail=detail,
        seconds=round(time.monotonic() - worker.started, 4),
    )
    worker.key = None
    return outcome


def _kill(worker: _Worker) -> None:
    worker.process.kill()
    worker.process.join()
    worker.dead = True


def _stop(workers: list[_Worker]) -> None:
    """Ask idle workers to exit, kill busy or unresponsive ones; reap all."""
    for worker in workers:
        if worker.key is None and worker.process.is_alive():
            with contextlib.suppress(OSError):  # it died meanwhile; reaped below
                worker.conn.send(None)
    deadline = time.monotonic() + 2.0
    for worker in workers:
        if worker.key is None:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()

"""A small supervisor for long-lived worker processes, each running one task at a time.

Importing torch and Transformers costs seconds, running one tiny model milliseconds, so workers
import once and then take task after task. Each worker has its own pipe; the parent waits on
every pipe and every process sentinel at once, so it notices a result, a death (segfault,
abort, OOM kill) or an overrun (per-task timeout) as soon as it happens. A dead or killed worker
is replaced and its task reported as "crashed" or "timeout"; no other task is affected.

Workers come from a forkserver that has already imported torch, Transformers and this project
(`harness.runner.preload`; spawn where forkserver is unavailable), so a replacement starts in
milliseconds, not seconds. They ignore
SIGINT: Ctrl-C is the parent's to handle, and closing the `run_tasks` generator (or an exception
in the consumer) kills every worker.

Workers also die with the parent when it is killed outright (`kill -9`, an OOM kill), where no
cleanup code of the parent runs: each worker watches a pipe only the parent holds open and
kills itself when it reads end-of-file, and on Linux it also asks the kernel for SIGKILL when
its parent process dies (`prctl(PR_SET_PDEATHSIG)`; for a forkserver child that is the
forkserver, which exits once the parent and every worker have let go of it). A worker whose
parent is gone exits quietly instead of printing BrokenPipe / ConnectionReset tracebacks.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

PRELOAD = ["harness.runner.preload"]
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
    alive: Connection | None = None  # the parent's end of the worker's watch pipe (see spawn)
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
    """Start the forkserver now, so its preload runs while the caller does other work.

    Idempotent. The server is spawned with SIGINT blocked, a mask that survives exec, so a
    Ctrl-C in its first milliseconds (before harness.runner.preload ignores SIGINT) cannot print a
    KeyboardInterrupt traceback from interpreter start-up; this process's own Ctrl-C stays
    pending meanwhile and is delivered as soon as the spawn returns. The resource tracker is
    started first, on its own: it blocks SIGINT for its spawn the same way and unblocks it
    after, which would end our block early.
    """
    if "forkserver" in mp.get_all_start_methods():
        context()
        from multiprocessing import forkserver, resource_tracker

        resource_tracker.ensure_running()
        with _sigint_blocked():
            forkserver.ensure_running()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the duration (deferred, not lost); a no-op without
    signal masks or outside the main thread (the only one Python delivers signals to)."""
    if not hasattr(signal, "pthread_sigmask") or (
        threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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


PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal the kernel sends this process when its parent dies."""


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only).

    Returns whether the request was registered. Safe anywhere: on other systems, or if libc
    cannot be loaded, it does nothing and returns False (the watch pipe still covers workers).
    The kernel sends the signal when the thread that forked this process exits, so it is only
    for processes forked from a parent's main thread (the forkserver, its workers).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(watch: Connection) -> None:
    """Block until the parent's end of `watch` closes (it never sends), then die at once.

    End-of-file means the parent process is gone, however it died; SIGKILL to ourselves stops
    a task mid-call, with no cleanup that could block or print (the parent wants nothing more).
    """
    with contextlib.suppress(EOFError, OSError):
        watch.recv_bytes()
    os.kill(os.getpid(), signal.SIGKILL)


def _release_forkserver() -> None:
    """Close this worker's copy of the forkserver's "alive" pipe (forkserver children only).

    The forkserver exits when every holder of that pipe has closed it; a worker inherits a copy
    (for forking children of its own, which it never does), so without this a hung worker
    would keep the forkserver, and with it the resource tracker, alive after the parent died.
    Best effort: it uses a private attribute of multiprocessing and does nothing if absent.
    """
    with contextlib.suppress(Exception):
        from multiprocessing import forkserver

        server = forkserver._forkserver  # type: ignore[attr-defined]
        fd = server._forkserver_alive_fd
        if isinstance(fd, int):  # None in a spawned worker, or if multiprocessing changed
            os.close(fd)
            server._forkserver_alive_fd = None


def _worker_main(
    conn: Connection,
    watch: Connection,
    handler: Callable,
    setup: Callable | None,
    setup_args: tuple,
) -> None:
    # Ctrl-C reaches the whole process group; only the parent decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    threading.Thread(target=_watch_parent, args=(watch,), daemon=True).start()
    _release_forkserver()
    try:
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
            except BaseException:  # SystemExit too: a handler may not end the worker quietly
                reply = ("error", key, traceback.format_exc())
            conn.send(reply)
    except OSError:  # BrokenPipe / ConnectionReset: the parent is gone, nobody to tell
        return


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
    start_server()  # (if not started yet) quietly, see there
    ctx = context()
    pending = deque(tasks)
    workers: list[_Worker] = []

    def spawn() -> _Worker:
        parent_end, child_end = ctx.Pipe()
        # Only this process holds `alive`: the worker reads EOF from `watch` when it dies.
        watch, alive = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_worker_main,
            args=(child_end, watch, handler, setup, setup_args),
            daemon=True,
        )
        process.start()
        child_end.close()
        watch.close()
        return _Worker(process, parent_end, time.monotonic(), alive=alive)

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
        _close(worker)
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
    _close(worker)


def _close(worker: _Worker) -> None:
    """Close the parent's ends of a reaped worker's pipes (no fd leaks over a long sweep)."""
    worker.conn.close()
    if worker.alive is not None:
        worker.alive.close()


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
        _close(worker)

"""harness.runner.pool: results, crash and hang isolation, worker replacement, clean shutdown."""

from __future__ import annotations

import os
import time

import pytest

from harness.runner import pool
from tests.harness.pool_tasks import broken_setup, work


def _run(tasks, *, jobs=2, timeout=30.0, **kwargs):
    outcomes = list(pool.run_tasks(tasks, work, jobs=jobs, timeout=timeout, **kwargs))
    return {o.key: o for o in outcomes}, outcomes


def test_every_task_gets_one_outcome():
    by_key, outcomes = _run([(str(i), ("value", i * i)) for i in range(6)])
    assert len(outcomes) == 6
    assert {k: o.value for k, o in by_key.items()} == {str(i): i * i for i in range(6)}
    assert all(o.status == "done" for o in outcomes)


def test_a_crashing_task_is_recorded_and_the_worker_replaced():
    tasks = [
        ("a", ("value", 1)),
        ("boom", ("abort", None)),
        ("b", ("value", 2)),
        ("c", ("value", 3)),
    ]
    by_key, _ = _run(tasks, jobs=1)
    assert by_key["boom"].status == "crashed"
    assert "SIGABRT" in by_key["boom"].detail
    assert [by_key[k].value for k in "abc"] == [1, 2, 3]


def test_a_worker_exit_is_a_crash_too():
    by_key, _ = _run([("x", ("exit", 3)), ("y", ("value", 1))], jobs=1)
    assert by_key["x"].status == "crashed" and "status 3" in by_key["x"].detail
    assert by_key["y"].value == 1


def test_a_hanging_task_times_out_without_blocking_others():
    started = time.monotonic()
    by_key, _ = _run(
        [("hang", ("hang", None)), ("a", ("value", 1)), ("b", ("value", 2))], timeout=1.0
    )
    assert by_key["hang"].status == "timeout"
    assert "no result after 1 s" in by_key["hang"].detail
    assert by_key["a"].value == 1 and by_key["b"].value == 2
    assert time.monotonic() - started < 20


def test_a_raising_handler_is_an_error_with_its_traceback():
    by_key, _ = _run([("x", ("raise", "bad payload"))], jobs=1)
    assert by_key["x"].status == "error"
    assert "ValueError: bad payload" in by_key["x"].detail


def test_setup_failure_is_a_pool_error():
    with pytest.raises(pool.PoolError, match="setup broke on purpose"):
        _run([("x", ("value", 1))], jobs=1, setup=broken_setup)


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_closing_the_generator_kills_the_workers():
    outcomes = pool.run_tasks(
        [("pid", ("pid", None)), ("hang", ("hang", None)), ("more", ("value", 1))],
        work,
        jobs=2,
        timeout=60,
    )
    first = next(outcomes)
    assert first.key == "pid"
    outcomes.close()  # what Ctrl-C in the consumer does
    assert _gone(first.value)


def test_describe_exit():
    assert pool.describe_exit(-6) == "killed by SIGABRT (exit code -6)"
    assert pool.describe_exit(2) == "exited with status 2"

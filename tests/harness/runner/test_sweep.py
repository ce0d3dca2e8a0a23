"""harness.runner.sweep: isolation of crashing and hanging architectures, JSONL, resume, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers

from harness.base.results import ResultsError, ResultsWriter, read_results
from harness.runner import sweep
from harness.runner.arch_check import CheckOptions

REPO = Path(__file__).resolve().parents[3]
ARCHS = "tests.harness.plugin_archs"
FAULTY = "tests.harness.plugin_faulty_fusion"


def _options(tmp_path: Path, names, *, plugins=(ARCHS,), **kwargs) -> sweep.SweepOptions:
    return sweep.SweepOptions(
        architectures=names,
        # Fake fusers rebind forwards with closures, which lifecycle checks rightly fail.
        check=CheckOptions(plugins=tuple(plugins), lifecycle="off"),
        results=tmp_path / "results.jsonl",
        **kwargs,
    )


HANG_TIMEOUT = 20.0
"""Seconds the hanging architecture is given: also the budget of the two real ones in the same
sweep (one timeout for all), so it is several times what they take (2-3 s each here); at 5 s
a stalled machine timed a real architecture out."""


def test_crashing_and_hanging_architectures_are_isolated(tmp_path):
    names = ["llama", "harness-test-abort", "harness-test-hang", "gpt2"]
    seen = []
    options = _options(tmp_path, names, jobs=2, timeout=HANG_TIMEOUT)
    run = sweep.sweep(options, on_result=seen.append)
    statuses = {r.architecture: r.status for r in run.results}
    assert statuses == {
        "llama": "pass",
        "harness-test-abort": "crashed",
        "harness-test-hang": "timeout",
        "gpt2": "pass",
    }
    by_name = {r.architecture: r for r in run.results}
    assert "SIGABRT" in by_name["harness-test-abort"].message
    assert f"no result after {HANG_TIMEOUT:g} s" in by_name["harness-test-hang"].message
    assert [r.architecture for r in run.results] == names  # selection order, not finish order
    assert sorted(r.architecture for r in read_results(tmp_path / "results.jsonl")) == sorted(names)
    assert len(seen) == 4 and not run.interrupted


def test_a_build_error_is_recorded_and_the_sweep_goes_on(tmp_path):
    run = sweep.sweep(_options(tmp_path, ["harness-test-unbuildable", "llama"], jobs=1))
    first, second = run.results
    assert first.status == "build-error"
    assert first.message == "ValueError: this test architecture never builds"
    assert second.status == "pass"


def test_resume_skips_what_is_done(tmp_path):
    sweep.sweep(_options(tmp_path, ["llama", "gpt2"], jobs=1))
    ran = []
    run = sweep.sweep(
        _options(tmp_path, ["llama", "gpt2", "qwen2"], jobs=1, resume=True), on_result=ran.append
    )
    assert [r.architecture for r in ran] == ["qwen2"]
    assert [r.architecture for r in run.results] == ["llama", "gpt2", "qwen2"]
    assert len(read_results(tmp_path / "results.jsonl")) == 3


def test_resume_refuses_results_of_another_dtype(tmp_path):
    sweep.sweep(_options(tmp_path, ["llama"], jobs=1))
    options = sweep.SweepOptions(
        architectures=["llama"],
        check=CheckOptions(dtype="bfloat16"),
        results=tmp_path / "results.jsonl",
        resume=True,
    )
    with pytest.raises(ResultsError, match="bfloat16"):
        sweep.sweep(options)


@pytest.mark.parametrize(
    ("versions", "named"),
    [
        ({"transformers": "4.57.1", "torch": None}, "transformers 4.57.1"),
        ({"torch": "2.9.0"}, "torch 2.9.0"),
        (None, "transformers unrecorded, torch unrecorded"),
    ],
)
def test_resume_refuses_results_of_other_versions(tmp_path, versions, named):
    """Before: a resume mixed results judged under two Transformers versions into one green
    table (merge refused the same mix)."""
    results = tmp_path / "results.jsonl"
    sweep.sweep(_options(tmp_path, ["llama"], jobs=1))
    (record,) = [json.loads(line) for line in results.read_text().splitlines()]
    if versions is None:
        record.pop("versions")
    else:
        record["versions"].update({k: v for k, v in versions.items() if v is not None})
    results.write_text(json.dumps(record) + "\n")
    with pytest.raises(ResultsError) as refused:
        sweep.sweep(_options(tmp_path, ["llama", "gpt2"], jobs=1, resume=True))
    message = str(refused.value)
    assert named in message and f"this run has transformers {transformers.__version__}" in message
    assert results.read_text() == json.dumps(record) + "\n"  # untouched


def test_failures_get_deduplicated_repro_bundles(tmp_path):
    bundles = tmp_path / "bundles"
    options = _options(tmp_path, ["llama"], plugins=(FAULTY,), jobs=1, repro_dir=bundles)
    (result,) = sweep.sweep(options).results
    assert result.status == "fail"
    paths = {f.bundle for f in result.failures}
    assert all(p and Path(p).is_dir() for p in paths)
    first = sorted(os.listdir(bundles))
    sweep.sweep(options)  # the same failures again: no new bundle
    assert sorted(os.listdir(bundles)) == first
    assert len(first) == 2  # model-parity and module-parity


def _wait_for_lines(path: Path, count: int, proc: subprocess.Popen, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"sweep exited early: {proc.communicate()}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"{path} did not reach {count} lines")


@pytest.mark.slow  # two sweeps, one a subprocess: tens of seconds
def test_ctrl_c_keeps_finished_results_and_resume_finishes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "FUSION_HARNESS_TEST_PLUGINS": ARCHS}
    results = tmp_path / "results.jsonl"
    argv = [
        "run",
        "-j",
        "1",
        "--results",
        str(results),
        "--arch",
        "llama",
        "gpt2",
        "harness-test-hang",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_lines(results, 2, proc)
    time.sleep(0.5)  # well inside the hanging architecture
    proc.send_signal(signal.SIGINT)  # to the parent only, as a terminal's Ctrl-C would reach it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    hint = f"fusion-harness run -j 1 --arch llama gpt2 harness-test-hang --resume {results}"
    assert hint in err  # the same sweep, not the whole corpus
    assert sorted(r.architecture for r in read_results(results)) == ["gpt2", "llama"]
    assert "llama" in out  # the partial table is printed

    ran = []
    options = _options(tmp_path, ["llama", "gpt2", "qwen2"], jobs=1, resume=True)
    run = sweep.sweep(options, on_result=ran.append)
    assert [r.architecture for r in ran] == ["qwen2"]  # the interrupted run's results are kept
    assert [r.status for r in run.results] == ["pass"] * 3
    assert sorted(r.architecture for r in read_results(results)) == ["gpt2", "llama", "qwen2"]


def test_a_builder_raising_system_exit_is_a_build_error(tmp_path):
    """Before: SystemExit escaped check's `except Exception` and the result said crashed."""
    run = sweep.sweep(_options(tmp_path, ["harness-test-sys-exit", "llama"], jobs=1))
    first, second = run.results
    assert first.status == "build-error", first.message
    assert "sys.exit(3)" in first.message
    assert second.status == "pass"


def test_an_unwritable_repro_dir_keeps_the_verdict(tmp_path, unwritable_dir):
    """Before: write_bundles raised in the worker and a `fail` became `crashed: harness error
    in the worker`, hiding the real verdict."""
    options = _options(
        tmp_path, ["llama"], plugins=(FAULTY,), jobs=1, repro_dir=unwritable_dir / "bundles"
    )
    (result,) = sweep.sweep(options).results
    assert result.status == "fail"
    assert "repro bundle not written" in result.message
    assert result.failures and all(f.bundle is None for f in result.failures)


def test_a_results_file_that_fills_up_loses_no_verdict(tmp_path, monkeypatch):
    """A full disk mid-sweep: the sweep finishes and returns every verdict, and says how many
    results did not reach the file."""
    real_write = ResultsWriter.write
    calls = []

    def write(self, result):
        calls.append(result.architecture)
        if len(calls) > 1:
            raise ResultsError(f"cannot write results file {self.path}: No space left on device")
        real_write(self, result)

    monkeypatch.setattr(ResultsWriter, "write", write)
    run = sweep.sweep(_options(tmp_path, ["llama", "gpt2", "qwen2"], jobs=1))
    assert [r.status for r in run.results] == ["pass"] * 3
    assert "No space left on device" in run.write_error
    assert "2 result(s) not recorded" in run.write_error
    assert len(read_results(tmp_path / "results.jsonl")) == 1


def test_resume_reads_under_the_lock(tmp_path):
    """A resume cannot start while another sweep writes the file (it would re-run the same
    remaining architectures: duplicates)."""
    path = tmp_path / "results.jsonl"
    with (
        ResultsWriter(path, append=False),
        pytest.raises(ResultsError, match="being written by another sweep"),
    ):
        sweep.sweep(_options(tmp_path, ["llama"], jobs=1, resume=True))


# --- processes: workers die with the parent, whatever kills it --------------------------------


def _descendants(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # zombies are dead, only not yet reaped
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            alive.add(pid)
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_parent_takes_every_worker_with_it(tmp_path):
    """Before: a hung worker, the forkserver and the resource tracker outlived `kill -9` of the
    sweep (until the worker's task ended on its own), and a worker finishing its task after the
    parent died printed a BrokenPipe traceback."""
    marker = tmp_path / "hanging"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FUSION_HARNESS_TEST_PLUGINS": ARCHS,
        "HARNESS_TEST_HANG_MARKER": str(marker),
        "HARNESS_TEST_SLOW_SECONDS": "3",
    }
    argv = ["run", "-j", "2", "--timeout", "600", "--results", str(tmp_path / "r.jsonl")]
    argv += ["--arch", "harness-test-hang", "harness-test-slow-llama"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the hang never started"
        time.sleep(0.1)
    time.sleep(0.5)  # the slow llama is mid-build in the other worker
    family = _descendants(proc.pid)
    assert len(family) >= 3  # forkserver, resource tracker, two workers
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _alive(family)
    for pid in left:  # do not leave them behind if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, "processes outlived the killed sweep"
    err = proc.stderr.read()  # EOF: every holder of the pipe is gone
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def _start_in_session(tmp_path: Path, argv: list[str], **extra_env: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FUSION_HARNESS_TEST_PLUGINS": ARCHS,
        **extra_env,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "harness", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C reaches all of it, as in a shell
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("after", [0.0, 2.0])
def test_ctrl_c_in_the_first_seconds_prints_no_traceback(tmp_path, after):
    """Before: a KeyboardInterrupt traceback from the forkserver's preload imports, which run
    in the first seconds (the signal reaches the whole process group, as from a terminal)."""
    proc = _start_in_session(tmp_path, ["run", "-j", "1", "--arch", "llama", "--results", "r"])
    deadline = time.monotonic() + 60
    while not _descendants(proc.pid):  # the forkserver is starting: its preload runs now
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, 0), err  # 0: it finished before the signal
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_repeated_ctrl_c_prints_no_exception_ignored(tmp_path):
    """Before: three quick Ctrl-C printed "Exception ignored in atexit callback"."""
    marker = tmp_path / "hanging"
    proc = _start_in_session(
        tmp_path,
        ["run", "-j", "1", "--results", "r", "--json", "s.json", "--arch", "harness-test-hang"],
        HARNESS_TEST_HANG_MARKER=str(marker),
    )
    deadline = time.monotonic() + 120
    while not marker.exists():  # the worker is inside the hanging task
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    for _ in range(3):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert json.loads((tmp_path / "s.json").read_text())["exit_status"] == 130

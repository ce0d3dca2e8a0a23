"""harness.sweep: isolation of crashing and hanging architectures, JSONL, resume, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import sweep
from harness.check import CheckOptions
from harness.results import ResultsError, read_results

REPO = Path(__file__).resolve().parents[2]
ARCHS = "tests.harness.plugin_archs"
FAULTY = "tests.harness.plugin_faulty_fusion"


def _options(tmp_path: Path, names, *, plugins=(ARCHS,), **kwargs) -> sweep.SweepOptions:
    return sweep.SweepOptions(
        architectures=names,
        check=CheckOptions(plugins=tuple(plugins)),
        results=tmp_path / "results.jsonl",
        **kwargs,
    )


def test_crashing_and_hanging_architectures_are_isolated(tmp_path):
    names = ["llama", "harness-test-abort", "harness-test-hang", "gpt2"]
    seen = []
    run = sweep.sweep(_options(tmp_path, names, jobs=2, timeout=5.0), on_result=seen.append)
    statuses = {r.architecture: r.status for r in run.results}
    assert statuses == {
        "llama": "pass",
        "harness-test-abort": "crashed",
        "harness-test-hang": "timeout",
        "gpt2": "pass",
    }
    by_name = {r.architecture: r for r in run.results}
    assert "SIGABRT" in by_name["harness-test-abort"].message
    assert "no result after 5 s" in by_name["harness-test-hang"].message
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
    assert f"--resume {results}" in err
    assert sorted(r.architecture for r in read_results(results)) == ["gpt2", "llama"]
    assert "llama" in out  # the partial table is printed

    ran = []
    options = _options(tmp_path, ["llama", "gpt2", "qwen2"], jobs=1, resume=True)
    run = sweep.sweep(options, on_result=ran.append)
    assert [r.architecture for r in ran] == ["qwen2"]  # the interrupted run's results are kept
    assert [r.status for r in run.results] == ["pass"] * 3
    assert sorted(r.architecture for r in read_results(results)) == ["gpt2", "llama", "qwen2"]

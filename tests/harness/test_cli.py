"""harness.cli: every command, its help, its exit status."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.results import read_results

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        ([], "Differential testing"),
        (["run"], "float64"),
        (["list"], "knows it cannot"),
        (["show"], "unified diff"),
        (["repro"], "malformed"),
        (["bench"], "speedup table"),
    ],
)
def test_every_command_explains_itself(argv, phrase, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert phrase in " ".join(capsys.readouterr().out.split())


def test_python_dash_m_is_the_same_command():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "harness", "--help"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and "usage: fusion-harness" in out.stdout
    script = shutil.which("fusion-harness", path=str(Path(sys.executable).parent))
    if script:  # installed as a console script in this environment
        scripted = subprocess.run([script, "--help"], env=env, capture_output=True, text=True)
        assert scripted.stdout == out.stdout


def test_unknown_architecture_is_a_usage_error(capsys):
    assert cli.main(["run", "--arch", "lama"]) == 2
    assert "did you mean llama" in capsys.readouterr().err


def test_run_writes_results_json_and_table(tmp_path, capsys):
    results, summary = tmp_path / "r.jsonl", tmp_path / "s.json"
    code = cli.main(
        [
            "run",
            "--arch",
            "llama",
            "gpt2",
            "-j",
            "2",
            "--results",
            str(results),
            "--json",
            str(summary),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 architectures: 2 built, 2 ran" in out
    assert any(line.split()[:1] == ["llama"] and "pass" in line for line in out.splitlines())
    doc = json.loads(summary.read_text())
    assert doc["exit_status"] == 0 and doc["totals"]["green"] == 2
    assert {r["architecture"] for r in doc["results"]} == {"llama", "gpt2"}
    assert len(read_results(results)) == 2


def test_resume_with_a_different_results_file_is_refused(tmp_path, capsys):
    argv = [
        "run",
        "--arch",
        "llama",
        "--resume",
        str(tmp_path / "a"),
        "--results",
        str(tmp_path / "b"),
    ]
    assert cli.main(argv) == 2
    assert "--resume FILE is also the results file" in capsys.readouterr().err


def test_a_parity_failure_fails_the_run_and_bundles_replay(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FUSION_HARNESS_TEST_PLUGINS": "tests.harness.plugin_faulty_fusion",
    }
    bundles = tmp_path / "bundles"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--arch",
            "llama",
            "-j",
            "1",
            "--repro-dir",
            str(bundles),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr
    assert "model.layers.0.mlp (LlamaMLP) [fake-glu]" in run.stdout
    (module,) = bundles.glob("llama--module-parity--*")
    assert f"repro bundle: {module}" in run.stdout
    replay = subprocess.run(
        [sys.executable, "-m", "harness", "repro", str(module)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "REPRODUCES" in replay.stdout


def test_repro_of_a_malformed_bundle_exits_2(tmp_path, capsys):
    (tmp_path / "bundle.json").write_text('{"format": 1}')
    assert cli.main(["repro", str(tmp_path)]) == 2
    assert "field 'versions' is missing" in capsys.readouterr().out


def test_show_prints_plan_and_diffs(capsys):
    assert cli.main(["show", "llama"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FusionReport:")
    if "no forward was rewritten" not in out:
        assert "--- LlamaAttention.forward (original" in out
        assert "+++ LlamaAttention.forward (rewritten by" in out


def test_show_takes_exactly_one_known_architecture(capsys):
    assert cli.main(["show", "qwen*"]) == 2
    assert "show takes one architecture; 'qwen*' matches qwen2" in capsys.readouterr().err
    unbuildable = sorted(cli.architectures.unbuildable())
    if unbuildable:
        assert cli.main(["show", unbuildable[0]]) == 1
        assert "is known unbuildable" in capsys.readouterr().out


def test_show_of_an_unbuildable_architecture_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("FUSION_HARNESS_TEST_PLUGINS", "tests.harness.plugin_archs")
    assert cli.main(["show", "harness-test-unbuildable"]) == 1
    assert "cannot build harness-test-unbuildable" in capsys.readouterr().err


def test_list_shows_build_status(capsys):
    assert cli.main(["list", "--arch", "llama", "qwen2*", "-j", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["llama", "ok"]
    assert all(" ok (" in line for line in out)


def test_list_reports_a_build_failure(capsys, monkeypatch):
    monkeypatch.setenv("FUSION_HARNESS_TEST_PLUGINS", "tests.harness.plugin_archs")
    assert cli.main(["list", "--arch", "harness-test-unbuildable", "llama", "-j", "1"]) == 1
    out = capsys.readouterr().out
    assert "harness-test-unbuildable  error: ValueError: this test architecture never builds" in out

"""harness.cli: every command, its help, its exit status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import cli
from harness.base import architectures
from harness.base.results import read_results

REPO = Path(__file__).resolve().parents[3]


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


@pytest.mark.slow  # several sweep processes: tens of seconds
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
    assert "field 'versions' is missing" in capsys.readouterr().err


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
    unbuildable = sorted(architectures.unbuildable())
    if unbuildable:
        assert cli.main(["show", unbuildable[0]]) == 3
        assert "is known unbuildable" in capsys.readouterr().out


def test_show_of_an_unbuildable_architecture_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("FUSION_HARNESS_TEST_PLUGINS", "tests.harness.plugin_archs")
    assert cli.main(["show", "harness-test-unbuildable"]) == 3
    assert "cannot build harness-test-unbuildable" in capsys.readouterr().err


def test_list_shows_build_status(capsys):
    assert cli.main(["list", "--arch", "llama", "qwen2*", "-j", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["llama", "ok"]
    assert all(" ok (" in line for line in out)


def test_list_reports_a_build_failure(capsys, monkeypatch):
    monkeypatch.setenv("FUSION_HARNESS_TEST_PLUGINS", "tests.harness.plugin_archs")
    assert cli.main(["list", "--arch", "harness-test-unbuildable", "llama", "-j", "1"]) == 3
    out = capsys.readouterr().out
    assert "harness-test-unbuildable  error: ValueError: this test architecture never builds" in out


# --- the first ten minutes: fast help, clear errors --------------------------------------------


def test_help_and_usage_errors_do_not_import_torch():
    """Before: `--help` imported torch, Transformers and the bench module (4-7 s). Every
    command's --help (bench, perf and calibrate included) and a usage error answer without."""
    code = (
        "import sys, contextlib, io\n"
        "from harness import cli\n"
        "for argv in [['--help'], ['bench', '--arch'], *([c, '--help'] for c in cli.COMMANDS)]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        cli.main(argv)\n"
        "heavy = [m for m in ('torch', 'transformers', 'corpus', 'fusion') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_dtype_choices_are_the_checks_dtypes():
    from harness.runner import arch_check

    assert list(cli.DTYPE_NAMES) == list(arch_check.DTYPES)


def test_show_of_an_unknown_name_speaks_of_a_name_not_of_arch(capsys):
    """Before: `show nosucharch` said "--arch 'nosucharch' matches no architecture"."""
    assert cli.main(["show", "nosucharch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: no architecture named 'nosucharch'")
    assert "--arch" not in err
    assert cli.main(["show", "lama"]) == 2
    assert "did you mean llama" in capsys.readouterr().err


def test_bench_arch_is_a_clear_error(capsys):
    """Before: `bench --arch` was unrecognised and printed the top-level usage."""
    assert cli.main(["bench", "--arch", "llama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: bench does not take --arch")
    assert "--kernel" in err and "usage:" not in err


def test_repro_errors_go_to_stderr_with_the_common_prefix(tmp_path, capsys):
    """Before: `repro` printed "error: ..." on stdout, unlike every other subcommand."""
    assert cli.main(["repro", str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("fusion-harness: error: ") and "not a directory" in captured.err


# --- results files: one-line errors, exit 2, nothing appended ----------------------------------


def _record(**changes) -> str:
    from harness.base.results import ArchResult, to_json_line

    line = json.loads(to_json_line(ArchResult("gpt2", "pass", "float32", "cpu", 0, 0.1)))
    line.update(changes)
    return json.dumps(line) + "\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[1, 2]\n", "record must be an object"),
        (b"42\n", "record must be an object"),
        (b"\xff\xfe\n", "not UTF-8 text"),
        (_record(applied=[1]).encode(), "record.applied must be an object"),
        (_record(architecture=3).encode(), "record.architecture must be a string"),
        (_record(seconds="fast").encode(), "record.seconds must be a number"),
        (_record(status="bogus").encode(), 'record.status is "bogus"'),
        (_record().encode() + b'{"foo": 1}\n', "unknown field(s) 'foo'"),
        (json.dumps({"format": 1, "config": {}}, indent=2).encode(), "is it a fusion-harness"),
    ],
)
def test_resume_of_a_bad_results_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    """Before: tracebacks and exit 1 (some after the whole sweep ran), or the bad line kept
    and appended after; `"status": "bogus"` was accepted and counted."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(content)
    assert cli.main(["run", "--arch", "llama", "-j", "1", "--resume", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert path.read_bytes() == content  # nothing appended, nothing cut


def test_resume_of_a_directory_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["run", "--arch", "llama", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: ") and "is a directory" in err


def test_unwritable_outputs_are_refused_before_the_sweep(tmp_path, unwritable_dir, capsys):
    """Before: raw tracebacks (for --json after a green sweep)."""
    base = ["run", "--arch", "llama", "-j", "1", "--results", str(tmp_path / "r.jsonl")]
    for extra, message in [
        (["--results", str(unwritable_dir / "r.jsonl")], "cannot write results file"),
        (["--json", str(unwritable_dir / "s.json")], "--json"),
        (["--json", str(tmp_path)], "is a directory"),
        (["--repro-dir", str(unwritable_dir / "bundles")], "--repro-dir"),
    ]:
        assert cli.main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("fusion-harness: error: ") and message in err, err
        assert err.count("\n") == 1
    assert not (tmp_path / "r.jsonl").exists() or not (tmp_path / "r.jsonl").read_text()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_json_on_a_full_device_keeps_the_verdict(tmp_path, capsys):
    """--json /dev/full after a green sweep: the table is printed, one error line, exit 2
    (a red sweep would keep its 1), and the results file holds the verdict."""
    results = tmp_path / "r.jsonl"
    argv = ["run", "--arch", "llama", "-j", "1", "--results", str(results)]
    assert cli.main([*argv, "--json", "/dev/full"]) == 2
    captured = capsys.readouterr()
    assert any(line.split()[:1] == ["llama"] for line in captured.out.splitlines())
    assert captured.err.strip().splitlines()[-1] == (
        "fusion-harness: error: cannot write --json /dev/full: No space left on device"
    )
    assert [r.status for r in read_results(results)] == ["pass"]


def test_an_unwritable_default_repro_dir_is_a_warning(tmp_path, unwritable_dir, monkeypatch):
    monkeypatch.chdir(unwritable_dir)
    args = cli.build_parser().parse_args(["run"])
    assert cli.common.repro_dir(args) is None  # no bundles, but the sweep runs


@pytest.mark.slow  # several sweep processes: tens of seconds
def test_two_sweeps_on_one_results_file(tmp_path):
    """Before: both exited 0 and one's results were silently gone (and a fragment line broke
    the next --resume); two --resume runs both ran the remaining architectures."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FUSION_HARNESS_TEST_PLUGINS": "tests.harness.plugin_archs",
    }
    results = tmp_path / "r.jsonl"
    argv = [sys.executable, "-m", "harness", "run", "-j", "1", "--timeout", "600"]
    first = subprocess.Popen(  # one result, then a hang: it holds the file until stopped
        [*argv, "--results", str(results), "--arch", "llama", "harness-test-hang"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (results.exists() and results.read_text().count("\n") == 1):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    before = results.read_bytes()
    for extra in (["--results", str(results)], ["--resume", str(results)]):
        second = subprocess.run(
            [*argv, *extra, "--arch", "gpt2"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stdout + second.stderr
        assert "being written by another sweep" in second.stderr
        assert "Traceback" not in second.stderr
        assert results.read_bytes() == before  # not truncated, nothing appended
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    assert [r.architecture for r in read_results(results)] == ["llama"]


@pytest.mark.slow  # one sweep process: about ten seconds
def test_a_closed_stdout_costs_neither_the_json_nor_the_exit_status(tmp_path):
    """Issue 28: `fusion-harness run --json s.json | head -1` gave a BrokenPipeError
    traceback, exit 1, and no s.json (the summary was written after the table)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    summary = tmp_path / "s.json"
    command = [sys.executable, "-m", "harness", "run", "--arch", "llama", "-j", "1"]
    process = subprocess.Popen(
        [*command, "--json", str(summary), "--results", str(tmp_path / "r.jsonl")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    process.stdout.close()  # the reader is gone before the table is printed
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr.decode()
    assert b"Traceback" not in stderr and b"BrokenPipeError" not in stderr
    assert json.loads(summary.read_text())["results"][0]["architecture"] == "llama"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["run", "--arch", "llama", "gpt2", "-j", "2"],
            "run --arch llama gpt2 -j 2 --resume r.jsonl",
        ),
        (
            ["run", "--results", "old.jsonl", "--dtype", "bfloat16"],
            "run --dtype bfloat16 --resume r.jsonl",
        ),
        (["run", "--resume=r.jsonl", "--arch", "qwen*"], "run --arch 'qwen*' --resume r.jsonl"),
        (["run", "--resu", "r.jsonl", "--wide"], "run --wide --resume r.jsonl"),  # abbreviated
        (None, "run --resume r.jsonl"),
    ],
)
def test_the_resume_hint_repeats_the_original_arguments(argv, expected):
    """Before: the hint was `run --resume FILE`, which resumed a 10-architecture sweep as the
    whole corpus."""
    assert cli.run.resume_command(argv, Path("r.jsonl")) == f"fusion-harness {expected}"


def test_list_into_a_closed_pipe_stops_quietly():
    """Before: `fusion-harness list | head` built every model first, then exited 1 with no
    word why. Now each line is printed once known (in name order) and a reader that stops
    reading ends the listing: exit 0, nothing on stderr, the remaining builds not waited for."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "harness", "list", "-j", "1", "--arch", "llama", "gpt2", "qwen*"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline().decode()
    proc.stdout.close()  # `head -1`
    _, err = proc.communicate(timeout=120)
    assert first.split()[:2] == ["gpt2", "ok"]
    assert proc.returncode == 0 and err == b"", err


def test_one_table_of_commands_one_dispatch():
    """Before: bench, perf and calibrate were matched by hand on argv with stub subparsers for
    --help; now every command is a module with add_parser and run in cli.COMMANDS."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    assert list(commands.choices) == list(cli.COMMANDS)
    for name, module in cli.COMMANDS.items():
        assert callable(module.add_parser) and callable(module.run), name
    assert parser.parse_args(["perf", "--tokens", "1"]).command == "perf"
    assert parser.parse_args(["bench", "--kernel", "qkv"]).kernel == ["qkv"]

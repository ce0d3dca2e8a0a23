"""harness.cli on results files and gates: `report`, `merge`, `run --shard`, exit status 3."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from harness import cli
from harness.base.results import ArchResult, ResultsWriter, read_results
from harness.reporting import plans
from harness.runner.shard import Shard

VERSIONS = {"transformers": "5.24.0", "torch": "2.13.0"}


def _r(name: str, status: str = "pass", **fields) -> ArchResult:
    fields.setdefault("versions", VERSIONS)
    return ArchResult(name, status, fields.pop("dtype", "float32"), "cpu", 0, 0.5, **fields)


def _write(path: Path, *results: ArchResult) -> Path:
    with ResultsWriter(path, append=False) as writer:
        for result in results:
            writer.write(result)
    return path


@pytest.fixture
def golden_dir(tmp_path, monkeypatch) -> Path:
    """An empty directory of golden files: the installed ones never decide a test here."""
    path = tmp_path / "expected"
    path.mkdir()
    monkeypatch.setenv(plans.EXPECTED_DIR_ENV, str(path))
    return path


@pytest.mark.parametrize(("command", "phrase"), [("report", "Markdown"), ("merge", "shard")])
def test_the_new_commands_explain_themselves(command, phrase, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0 and phrase in capsys.readouterr().out


def test_run_help_documents_every_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "3 no fusion failure but a corpus problem" in text and "--strict-corpus" in text
    assert "3 (run, merge, check, list, show)" in " ".join(cli.__doc__.split())


# --------------------------------------------------------------------------------- report


def test_report_to_stdout_and_to_a_file(tmp_path, golden_dir, capsys):
    results = _write(tmp_path / "r.jsonl", _r("llama"), _r("musicgen", "build-error", message="x"))
    assert cli.main(["report", str(results)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## fusion-harness report") and "**Gate:** exit 3" in out
    assert "Not compared: no golden fusion plan for Transformers 5.24" in out  # their line
    assert cli.main(["report", str(results), "--out", str(tmp_path / "r.md")]) == 0
    assert (tmp_path / "r.md").read_text() == out
    assert capsys.readouterr().out == ""


def test_report_compares_with_the_golden_file_of_the_results_line(tmp_path, golden_dir, capsys):
    golden = {"llama": {"status": "pass", "plan": {"LlamaAttention": {"applied": {"qkv": 2}}}}}
    (golden_dir / "5.0.json").write_text(
        plans.dumps(
            {
                "format": plans.FORMAT,
                "transformers_line": "5.0",
                "generated_with": {},
                "options": plans.GOLDEN_OPTIONS,
                "architectures": golden,
            }
        )
    )
    results = _write(tmp_path / "r.jsonl", _r("llama", versions={"transformers": "5.0.0"}))
    assert cli.main(["report", str(results)]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 architectures differ from" in out and "5.0.json" in out
    assert "the qkv fusion disappeared" in out
    explicit = ["report", str(results), "--expected", str(golden_dir / "5.0.json")]
    assert cli.main(explicit) == 0 and "the qkv fusion disappeared" in capsys.readouterr().out


def test_report_of_another_system_is_not_compared_with_fusion_plans(tmp_path, capsys):
    results = _write(tmp_path / "r.jsonl", _r("llama", system="inductor"))
    assert cli.main(["report", str(results)]) == 0
    out = capsys.readouterr().out
    assert "Not compared: golden plans describe the fusion system, these results inductor" in out
    assert "float32 on cpu, seed 0, system inductor" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["MISSING"], "no such results file"),
        (["BAD"], "is it a fusion-harness results file?"),
        (["GOOD", "--expected", "MISSING.json"], "MISSING.json: no such golden plan file"),
        (["GOOD", "--expected", "BAD"], "is not a golden plan file"),
        (["GOOD", "--out", "/nonexistent-dir/r.md"], "--out /nonexistent-dir/r.md cannot be"),
    ],
)
def test_report_of_unusable_files_is_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "BAD").write_text("not json\n")
    _write(tmp_path / "GOOD", _r("llama"))
    argv = [str(tmp_path / a) if a.isupper() and "/" not in a else a for a in argv]
    argv = [a.replace("MISSING.json", str(tmp_path / "MISSING.json")) for a in argv]
    assert cli.main(["report", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: ") and message in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------- merge


def test_merge_writes_one_results_file_and_the_sweep_summary(tmp_path, golden_dir, capsys):
    a = _write(tmp_path / "a.jsonl", _r("qwen3"), _r("gpt2"))
    b = _write(tmp_path / "b.jsonl", _r("llama"))
    out_file, summary_file = tmp_path / "m.jsonl", tmp_path / "m.json"
    argv = ["merge", str(a), str(b), "--results", str(out_file), "--json", str(summary_file)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 architectures: 3 built, 3 ran" in out and "merged 2 files: 3 architectures" in out
    assert [r.architecture for r in read_results(out_file)] == ["gpt2", "llama", "qwen3"]
    doc = json.loads(summary_file.read_text())
    assert doc["exit_status"] == 0 and doc["options"]["versions"] == VERSIONS
    assert [r["architecture"] for r in doc["results"]] == ["gpt2", "llama", "qwen3"]


def test_merge_exits_as_the_whole_sweep_would(tmp_path, golden_dir, capsys):
    corpus = _write(tmp_path / "a.jsonl", _r("llama"), _r("musicgen", "build-error"))
    fusion = _write(tmp_path / "b.jsonl", _r("gpt2", "fused-error"))
    assert cli.main(["merge", str(corpus)]) == 3
    assert "exit 3: no fusion failure" in capsys.readouterr().err
    assert cli.main(["merge", str(corpus), "--strict-corpus"]) == 1
    assert cli.main(["merge", str(corpus), str(fusion)]) == 1
    assert "exit 1: fusion failure(s) in gpt2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (_r("llama", "fail"), "llama has different results in"),
        (_r("gpt2", dtype="bfloat16"), "cannot merge results of different dtype/device/seed"),
        (_r("gpt2", versions={"transformers": "5.0.0"}), "cannot merge results of different"),
    ],
)
def test_merge_refuses_shards_that_do_not_fit_before_writing(tmp_path, capsys, other, message):
    a = _write(tmp_path / "a.jsonl", _r("llama"))
    b = _write(tmp_path / "b.jsonl", other)
    out_file = tmp_path / "m.jsonl"
    assert cli.main(["merge", str(a), str(b), "--results", str(out_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusion-harness: error: ") and message in err
    assert not out_file.exists()


# ------------------------------------------------------------------------------ run gates


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shard", "3/2"], "K must be between 1 and N"),
        (["--shard", "two"], "is not K/N"),
        (["--balance", "x.jsonl"], "--balance FILE balances shards; it needs --shard K/N"),
        (["--shard", "1/2", "--balance", "MISSING"], "no such results file"),
    ],
)
def test_bad_shard_options_are_refused_before_the_sweep(tmp_path, capsys, argv, message):
    argv = [str(tmp_path / a) if a == "MISSING" else a for a in argv]
    assert cli.main(["run", "--arch", "llama", *argv, "--results", str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_shard_has_its_own_default_results_file():
    args = argparse.Namespace(dtype="bfloat16", device="cuda:1")
    assert cli.run.default_results(args) == Path("results/sweep-bfloat16-cuda1.jsonl")
    assert cli.run.default_results(args, Shard(2, 3)) == Path(
        "results/sweep-bfloat16-cuda1-shard2of3.jsonl"
    )


def test_a_corpus_problem_alone_exits_3_and_strict_exits_1(tmp_path, monkeypatch, capsys):
    """Before: a model the corpus cannot build exited 1, like a fusion failure."""
    monkeypatch.setenv("FUSION_HARNESS_TEST_PLUGINS", "tests.harness.plugin_archs")
    argv = ["run", "--arch", "harness-test-unbuildable", "llama", "-j", "1", "--lifecycle", "off"]
    argv += ["--repro-dir", str(tmp_path / "bundles")]
    assert cli.main([*argv, "--results", str(tmp_path / "a.jsonl")]) == 3
    captured = capsys.readouterr()
    assert (
        "exit 3: no fusion failure" in captured.err and "harness-test-unbuildable" in captured.err
    )
    assert {r.versions.get("transformers") for r in read_results(tmp_path / "a.jsonl")} == {
        plans.versions()["transformers"]
    }  # the sweep stamps every record
    assert cli.main([*argv, "--strict-corpus", "--results", str(tmp_path / "b.jsonl")]) == 1

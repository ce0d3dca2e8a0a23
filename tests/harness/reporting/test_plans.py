"""harness.reporting.plans: plan entries, reason categories, golden files, diffs in words, the CLI's
--update-expected and the conformance suite's plan check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.base.results import ArchResult, Refusal
from harness.reporting import plans

REPO = Path(__file__).resolve().parents[3]


def _result(status="pass", message="", applied_by_class=None, refusals=()) -> ArchResult:
    return ArchResult(
        architecture="toy",
        status=status,
        dtype="float32",
        device="cpu",
        seed=0,
        seconds=1.25,
        message=message,
        applied_by_class=applied_by_class or {},
        refusals=list(refusals),
    )


def _refusal(fuser, cls, reason, count=1, example="model.layers.0.x") -> Refusal:
    return Refusal(fuser=fuser, source_class=cls, reason=reason, count=count, example=example)


# ------------------------------------------------------------------ categories and folding


@pytest.mark.parametrize(
    ("reason", "category"),
    [
        (
            "grouped top-k routing (3 top-k ops, e.g. experts chosen within the best groups): "
            "not implemented exactly",
            "grouped top-k routing (3 top-k ops, e.g. experts chosen within the best groups)",
        ),
        ("experts is_transposed=True (need False)", "experts is_transposed=True (need False)"),
        (
            "the router does not return (logits, routing weights, expert ids)",
            "the router does not return (logits, routing weights, expert ids)",
        ),
        (
            "fuse failed, module left unchanged: RuntimeError: boom at 0x7f00",
            "fuse failed, module left unchanged",
        ),
        ("computes no FusedRMSNorm variant: mul:float32(x, w)", "computes no FusedRMSNorm variant"),
        ("matcher error: KeyError: 'q_proj'", "matcher error"),
        # parentheses and numbers stay: they are stable and carry meaning
        (
            "experts do not take (ids, weights) = router(x)[2], router(x)[1]",
            "experts do not take (ids, weights) = router(x)[2], router(x)[1]",
        ),
        (
            "expert BartDecoderLayer is not down(act(gate(x)) * up(x))",
            "expert BartDecoderLayer is not down(act(gate(x)) * up(x))",
        ),
        ("  more than three   linears read the input ", "more than three linears read the input"),
    ],
)
def test_reason_category(reason, category):
    assert plans.reason_category(reason) == category


def test_fold_removes_what_varies_between_runs_and_machines():
    text = (
        "model.layers.3.mlp (LlamaMLP) [glu]: fused error 1.2e-03 > tolerance 4e-06 at "
        "0x7fe1c0 in /tmp/ci/.venv/lib/python3.11/site-packages/x.py:12 (Qwen2, float32)"
    )
    folded = plans.fold(text)
    assert folded == (
        "model.layers.N.mlp (LlamaMLP) [glu]: fused error N > tolerance N at <addr> in "
        "<path>:N (Qwen2, float32)"
    )
    other = text.replace("layers.3", "layers.7").replace("1.2e-03", "9.9e-01")
    assert plans.fold(other.replace("/tmp/ci", "/work/main")) == folded


@pytest.mark.parametrize(
    ("version", "line"), [("4.57.6", "4.57"), ("5.0.0", "5.0"), ("5.24.0.dev0", "5.24")]
)
def test_transformers_line(version, line):
    assert plans.transformers_line(version) == line


def test_transformers_line_of_garbage_is_an_error():
    with pytest.raises(plans.PlanError):
        plans.transformers_line("main")


# ------------------------------------------------------------------ entries


def test_entry_aggregates_per_class_and_sorts():
    result = _result(
        applied_by_class={"LlamaRMSNorm": {"rmsnorm": 5}, "LlamaAttention": {"qkv": 2}},
        refusals=[
            _refusal("sibling", "LlamaAttention", "statements are not plain assignments", 2),
            _refusal("moe", "Block", "grouped top-k routing: 3 top-k ops", 1),
            _refusal("moe", "Block", "grouped top-k routing: 4 top-k ops", 1),
        ],
    )
    entry = plans.entry_of(result)
    assert entry == {
        "status": "pass",
        "plan": {
            "Block": {"refused": {"moe": {"grouped top-k routing": 2}}},
            "LlamaAttention": {
                "applied": {"qkv": 2},
                "refused": {"sibling": {"statements are not plain assignments": 2}},
            },
            "LlamaRMSNorm": {"applied": {"rmsnorm": 5}},
        },
    }
    assert list(entry["plan"]) == sorted(entry["plan"])
    # timings, errors and example qualnames are not part of the plan
    other = _result(
        applied_by_class={"LlamaAttention": {"qkv": 2}, "LlamaRMSNorm": {"rmsnorm": 5}},
        refusals=reversed(result.refusals),
    )
    assert plans.entry_of(other) == entry


@pytest.mark.parametrize("status", ["build-error", "fuse-error", "crashed", "timeout"])
def test_no_plan_where_fusion_did_not_run(status):
    entry = plans.entry_of(_result(status, message="ValueError: layer 3 is odd"))
    assert entry == {"status": status, "reason": "ValueError: layer N is odd"}


def test_a_model_that_does_not_run_still_has_its_plan():
    entry = plans.entry_of(
        _result("forward-error", "unfused model does not run: x", {"A": {"glu": 1}})
    )
    assert entry["plan"] == {"A": {"applied": {"glu": 1}}}
    assert entry["reason"] == "unfused model does not run: x"


def test_only_model_side_breaks_may_be_recorded():
    assert plans.accepted({"status": "build-error", "reason": "x"})
    assert plans.accepted({"status": "inconclusive", "reason": "x"})
    assert not plans.accepted({"status": "build-error", "reason": ""})
    for status in ("fail", "fused-error", "fuse-error", "crashed", "timeout"):
        assert not plans.accepted({"status": status, "reason": "x"})


# ------------------------------------------------------------------ diffs in words

GOLDEN = {
    "status": "pass",
    "plan": {
        "Attn": {"applied": {"qkv": 2}},
        "MLP": {"applied": {"glu": 2}},
        "Norm": {"applied": {"rmsnorm": 5}},
        "Moe": {"refused": {"moe": {"the block returns a tuple": 2}}},
    },
}


def _with(**plan_changes):
    plan = {**GOLDEN["plan"], **plan_changes}
    return {"status": "pass", "plan": {k: v for k, v in plan.items() if v is not None}}


def test_no_change_no_diff():
    assert plans.diff_entry(GOLDEN, json.loads(json.dumps(GOLDEN))) == []


def test_a_fusion_that_disappeared_says_why():
    actual = _with(Attn={"refused": {"qkv": {"more than three linears read the input": 2}}})
    assert plans.diff_entry(GOLDEN, actual) == [
        "Attn: the qkv fusion disappeared (expected on 2 instances); "
        "qkv now refuses: more than three linears read the input",
        "Attn: new refusal by qkv on 2 instances: more than three linears read the input",
    ]


def test_a_new_fusion_asks_for_review():
    actual = _with(Moe={"applied": {"moe": 2}})
    assert plans.diff_entry(GOLDEN, actual) == [
        "Moe: new moe fusion on 2 instances, not in the golden plan (review it)",
        "Moe: moe no longer refuses: the block returns a tuple (was 2 instances)",
    ]


def test_a_new_refusal_prints_the_full_reason():
    actual = _with(Extra={"refused": {"glu": {"not one expression": 1}}})
    details = {("Extra", "glu", "not one expression"): "not one expression: a * b + c"}
    assert plans.diff_entry(GOLDEN, actual, details) == [
        "Extra: new refusal by glu on 1 instance: not one expression "
        "[full reason: not one expression: a * b + c]"
    ]


def test_another_reason_is_one_sentence():
    actual = _with(Moe={"refused": {"moe": {"no top-k in the router": 2}}})
    assert plans.diff_entry(GOLDEN, actual) == [
        "Moe: moe refuses 2 instances for another reason: no top-k in the router "
        "(was: the block returns a tuple)"
    ]


def test_count_changes():
    actual = _with(Norm={"applied": {"rmsnorm": 3}})
    assert plans.diff_entry(GOLDEN, actual) == ["Norm: rmsnorm fuses 3 instances, expected 5"]


def test_status_changes_and_parity_failures():
    actual = {**_with(), "status": "fail", "reason": "logits: NaN"}
    assert plans.diff_entry(GOLDEN, actual) == ["status fail (expected pass): logits: NaN"]
    broken = {"status": "build-error", "reason": "BuildError: x"}
    assert plans.diff_entry(GOLDEN, broken) == [
        "status build-error (expected pass): BuildError: x",
        "no plan: fusion did not run (the golden plan has one)",
    ]
    same_status = {"status": "build-error", "reason": "BuildError: y"}
    assert plans.diff_entry(broken, same_status) == [
        "build-error for another reason: BuildError: y (expected: BuildError: x)"
    ]
    fixed = plans.diff_entry(broken, GOLDEN)
    assert fixed[0] == "status pass (expected build-error)"
    assert fixed[1].startswith("fusion now runs (pass; fuses Attn qkv(2), MLP glu(2)")


def test_new_and_gone_architectures():
    assert plans.diff_entry(None, GOLDEN) == [
        "not in the golden plan (new architecture): pass; fuses Attn qkv(2), MLP glu(2), "
        "Norm rmsnorm(5)"
    ]
    assert plans.diff_entry(GOLDEN, None)[0].startswith("in the golden plan but no longer")


def test_format_diff_names_the_architecture_the_file_and_the_fix(tmp_path):
    text = plans.format_diff("llama", ["a", "b"], path=tmp_path / "5.24.json")
    assert text.splitlines()[:3] == [
        f"llama: fusion plan differs from {tmp_path / '5.24.json'}:",
        "  - a",
        "  - b",
    ]
    assert "fusion-harness run --update-expected --arch llama" in text


# ------------------------------------------------------------------ files


@pytest.fixture
def expected_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "expected"
    monkeypatch.setenv(plans.EXPECTED_DIR_ENV, str(directory))
    return directory


def test_missing_golden_file_says_how_to_make_it(expected_dir):
    with pytest.raises(plans.PlanError, match="fusion-harness run --update-expected"):
        plans.load()
    assert plans.golden_path().parent == expected_dir


def test_malformed_golden_file(expected_dir):
    expected_dir.mkdir()
    plans.golden_path().write_text('{"format": 1}')
    with pytest.raises(plans.PlanError, match="not a golden plan file"):
        plans.load()


def test_update_merges_refreshes_and_drops(expected_dir):
    a = ArchResult("a", "pass", "float32", "cpu", 0, 1.0, applied_by_class={"A": {"glu": 1}})
    b = ArchResult("b", "pass", "float32", "cpu", 0, 1.0)
    path, changes = plans.update([a, b], unbuildable={"u": "needs timm"}, known=["a", "b"])
    text = path.read_text()
    assert text.endswith("}\n") and text == plans.dumps(json.loads(text))
    golden = plans.load(path)
    assert golden.options == plans.GOLDEN_OPTIONS and golden.line == plans.transformers_line()
    assert set(golden.architectures) == {"a", "b", "u"}
    assert set(changes) == {"a", "b", "u"}
    # a sweep of one architecture replaces only it; gone architectures are dropped
    a2 = ArchResult("a", "pass", "float32", "cpu", 0, 9.0, applied_by_class={"A": {"glu": 2}})
    _, changes = plans.update([a2], unbuildable={}, known=["a"])
    assert changes == {
        "a": ["A: glu fuses 2 instances, expected 1"],
        "b": ["in the golden plan but no longer in the corpus (was: pass; fuses nothing)"],
        "u": ["in the golden plan but no longer in the corpus (was: unbuildable (needs timm))"],
    }
    assert set(plans.load(path).architectures) == {"a"}
    assert plans.update([a2], unbuildable={}, known=["a"])[1] == {}


def test_update_keeps_a_recorded_entry_over_a_timeout(expected_dir):
    """Regression (4.57's musicgen: a timeout under `-j 2` was written over its entry): a
    crashed or timed-out run keeps what was recorded and says so; a new architecture's
    timeout is still written (there is nothing to keep)."""
    a = ArchResult("a", "pass", "float32", "cpu", 0, 1.0, applied_by_class={"A": {"glu": 1}})
    path, _ = plans.update([a], unbuildable={}, known=["a", "n"])
    slow = ArchResult("a", "timeout", "float32", "cpu", 0, 120.0, message="no result after 120 s")
    new = ArchResult("n", "crashed", "float32", "cpu", 0, 1.0, message="worker died")
    _, changes = plans.update([slow, new], unbuildable={}, known=["a", "n"])
    golden = plans.load(path).architectures
    assert golden["a"]["status"] == "pass" and golden["a"]["plan"] == {"A": {"applied": {"glu": 1}}}
    assert changes["a"] == [
        "kept the recorded entry: this run's result is timeout (no result after 120 s); "
        "rerun it alone (a larger --timeout) to update it"
    ]
    assert golden["n"]["status"] == "crashed"


def test_committed_golden_files_are_canonical():
    """Hand edits keep the generated form (sorted keys, indent, trailing newline)."""
    files = sorted((REPO / "corpus" / "expected").glob("*.json"))
    assert files, "no golden plans in corpus/expected"
    for path in files:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text)
        assert text == plans.dumps(doc), f"{path.name} is not in canonical form"
        golden = plans.load(path)
        assert golden.line == doc["transformers_line"] == path.stem
        assert plans.transformers_line(golden.versions["transformers"]) == path.stem
        assert golden.options == plans.GOLDEN_OPTIONS


# ------------------------------------------------------------------ CLI and conformance


def test_update_expected_from_the_cli(expected_dir, capsys):
    argv = ["run", "--arch", "llama", "-j", "1", "--update-expected"]
    argv += ["--results", str(expected_dir.parent / "r.jsonl")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "architecture(s) changed" in out
    assert "llama:\n  - not in the golden plan (new architecture): pass; fuses" in out
    entry = plans.load().architectures["llama"]
    assert entry["status"] == "pass"
    assert entry["plan"]["LlamaAttention"]["applied"] == {"qkv": 2}
    assert cli.main(argv) == 0
    assert f"{plans.golden_path()}: no change" in capsys.readouterr().out


def test_update_expected_only_with_the_golden_options(expected_dir, capsys):
    argv = ["run", "--arch", "llama", "--dtype", "bfloat16", "--update-expected"]
    assert cli.main(argv) == 2
    assert "--update-expected records golden plans with" in capsys.readouterr().err
    assert not expected_dir.exists()


def _conformance(expected_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # What these tests judge is the plan comparison: without lifecycle checks (plans compare
    # on what both ran, harness.reporting.plans), so llama is not compiled here.
    env = {
        **os.environ,
        plans.EXPECTED_DIR_ENV: str(expected_dir),
        "PYTHONPATH": str(REPO),
        "FUSION_HARNESS_LIFECYCLE": "off",
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"),
            str(REPO / "tests" / "conformance"),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # runs the conformance suite in a subprocess
def test_conformance_fails_on_a_missing_golden_file(tmp_path):
    run = _conformance(tmp_path / "none", "-k", "golden_plan_exists")
    assert run.returncode == 1, run.stdout
    assert "no golden fusion plan for Transformers" in run.stdout
    assert "fusion-harness run --update-expected" in run.stdout


@pytest.mark.slow  # runs the conformance suite in a subprocess
def test_conformance_reports_a_changed_plan_in_words(tmp_path):
    golden = plans.load(plans.golden_path())  # the committed file of this line
    llama = json.loads(json.dumps(golden.architectures["llama"]))
    llama["plan"]["LlamaMLP"] = {"refused": {"glu": {"some old reason": 2}}}
    del llama["plan"]["LlamaAttention"]
    entries = {**golden.architectures, "llama": llama}
    (tmp_path / golden.path.name).write_text(
        plans.dumps({**plans.document(entries, line=golden.line), "options": golden.options})
    )
    run = _conformance(tmp_path, "-k", "test_architecture and llama and not llama4")
    assert run.returncode == 1, run.stdout
    assert "llama: fusion plan differs from" in run.stdout
    assert "LlamaAttention: new qkv fusion on 2 instances, not in the golden plan" in run.stdout
    assert (
        "LlamaMLP: new glu fusion on 2 instances" in run.stdout
        and "LlamaMLP: glu no longer refuses: some old reason (was 2 instances)" in run.stdout
    )

"""harness.summary: totals, the table, the exit status."""

from __future__ import annotations

import json

import pytest

from harness import summary
from harness.results import ArchResult, Failure, Refusal


def _r(name: str, status: str = "pass", **fields) -> ArchResult:
    return ArchResult(name, status, "float32", "cpu", 0, 0.5, **fields)


@pytest.mark.parametrize(
    ("statuses", "code"),
    [
        (["pass", "inconclusive"], 0),
        (["pass", "fail"], 1),
        (["pass", "fused-error"], 1),
        (["pass", "fuse-error"], 1),
        (["pass", "crashed"], 1),
        (["pass", "timeout"], 1),
        (["pass", "build-error"], 3),
        (["pass", "forward-error"], 3),
        (["build-error", "forward-error", "inconclusive"], 3),
        (["build-error", "fail"], 1),  # a fusion failure wins
        (["forward-error", "crashed"], 1),
        ([], 0),
    ],
)
def test_exit_status(statuses, code):
    results = [_r(str(i), s) for i, s in enumerate(statuses)]
    assert summary.exit_status(results) == code
    strict = summary.exit_status(results, strict_corpus=True)
    assert strict == (1 if code else 0)  # --strict-corpus: corpus problems fail as 1


def test_explain_exit_names_what_the_status_is_for():
    corpus_only = [_r("a"), _r("musicgen", "build-error"), _r("cohere", "forward-error")]
    line = summary.explain_exit(3, corpus_only)
    assert line.startswith("exit 3: no fusion failure") and "musicgen, cohere" in line
    assert "--strict-corpus" in line
    mixed = [*corpus_only, _r("llama", "fail")]
    assert summary.explain_exit(1, mixed) == "exit 1: fusion failure(s) in llama"
    strict = summary.explain_exit(1, corpus_only)
    assert "musicgen, cohere" in strict and "--strict-corpus" in strict
    many = [_r(f"m{i}", "fail") for i in range(7)]
    assert summary.explain_exit(1, many).endswith("m0, m1, m2, m3, m4 and 2 more")
    assert summary.explain_exit(0, [_r("a")]) == ""
    assert summary.explain_exit(130, mixed) == ""


def test_totals_count_progress_and_fusions():
    results = [
        _r("a", applied={"qkv": 2, "glu": 2}),
        _r("b", "fail", applied={"qkv": 1}),
        _r("c", "build-error"),
        _r("d", "fuse-error"),
        _r("e", "crashed"),
    ]
    t = summary.totals(results)
    assert (t.architectures, t.built, t.ran, t.fused, t.green) == (5, 3, 2, 2, 1)
    assert t.fusions == {"glu": 2, "qkv": 3}
    assert t.statuses == {"pass": 1, "fail": 1, "fuse-error": 1, "build-error": 1, "crashed": 1}
    text = summary.format_totals(t, wall=12.3, jobs=2)
    assert "5 architectures: 3 built, 2 ran, 2 fused" in text and "12.3 s with -j 2" in text


def test_table_and_problems():
    bundle = "/tmp/bundles/a--module-parity--qkv--0123456789"
    failure = Failure("module-parity", "m", "qkv", "A", "bad", bundle=bundle)
    results = [
        _r("llama", applied={"qkv": 2}, unfused_error=1e-7, fused_error=2e-7),
        _r("gpt2", "fail", message="m (A) [qkv]: bad", failures=[failure, failure]),
    ]
    table = summary.format_table(results).splitlines()
    assert table[0].split() == [
        "architecture",
        "fusions",
        "verdict",
        "lifecycle",
        "unfused",
        "err",
        "fused",
        "err",
        "seconds",
    ]
    assert table[2].split() == ["llama", "qkv:2", "pass", "-", "1.0e-07", "2.0e-07", "0.50"]
    problems = summary.format_problems(results)
    assert "gpt2: fail: m (A) [qkv]: bad" in problems
    assert problems.count(bundle) == 1  # one line per distinct bundle


def test_json_document_is_strict_json():
    doc = summary.json_document(
        [_r("a", fused_error=float("nan"))],
        options={"dtype": "float32"},
        wall=1.0,
        interrupted=False,
    )
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text)["totals"]["green"] == 1


def test_lifecycle_verdicts_in_table_totals_and_json():
    ok = {"verdict": "pass", "detail": ""}
    results = [
        _r("llama", lifecycle={"generate": ok, "train": ok}),
        _r("bart", lifecycle={"generate": {"verdict": "n/a", "detail": "x"}, "train": ok}),
        _r(
            "opt",
            "fail",
            lifecycle={"generate": ok, "train": {"verdict": "fail", "detail": "grad"}},
        ),
    ]
    rows = summary.format_table(results).splitlines()[2:]
    assert "2 pass" in rows[0] and "1 pass, 1 n/a" in rows[1] and "fail: train" in rows[2]
    t = summary.totals(results)
    assert t.lifecycle == {"generate": {"n/a": 1, "pass": 2}, "train": {"fail": 1, "pass": 2}}
    assert "lifecycle: generate 1 n/a / 2 pass; train 1 fail / 2 pass" in summary.format_totals(t)
    doc = summary.json_document(results, options={}, wall=1.0, interrupted=False)
    assert doc["totals"]["lifecycle"]["train"] == {"fail": 1, "pass": 2}


def test_an_architecture_without_fusion_shows_its_main_refusal():
    """Before: `-` in the fusions column, saying nothing about why."""
    refusals = [
        Refusal(
            "qkv",
            "BigBirdAttention",
            "the forward does not trace as far as its projections",
            2,
            "a",
        ),
        Refusal("glu", "MLP", "no gate: fc1 -> act -> fc2", 1, "b"),
    ]
    rows = summary.format_table(
        [_r("big_bird", refusals=refusals), _r("x"), _r("y", "build-error")]
    ).splitlines()[2:]
    assert "none (qkv: the forward does not trace as far as its projections)" in rows[0]
    assert "none (no candidate module)" in rows[1]
    assert rows[2].split()[1] == "-"  # never built: nothing was refused


def test_problems_say_what_the_golden_file_already_expects():
    golden = {
        "path": "corpus/expected/5.24.json",
        "entries": {
            "inkling2_text": {"status": "inconclusive", "reason": "logits: float64 reference"},
            "opt": {"status": "fail", "reason": "m: bad"},
            "gpt2": {"status": "pass"},
        },
    }
    results = [
        _r("inkling2_text", "inconclusive", message="logits: float64 reference does not run"),
        _r("opt", "fail", message="m: bad"),
        _r("gpt2", "fail", message="new"),
    ]
    lines = summary.format_problems(results, golden=golden).splitlines()
    assert lines[0].startswith(
        "inkling2_text: inconclusive (expected: recorded in corpus/expected/5.24.json): logits"
    )
    assert "opt: fail (recorded in corpus/expected/5.24.json, but a fusion failure" in lines[1]
    assert lines[2] == "gpt2: fail: new"


def test_json_document_of_merged_shards_has_no_wall_time():
    doc = summary.json_document([_r("a", "build-error")], options={}, wall=None, interrupted=False)
    assert doc["wall_seconds"] is None and doc["exit_status"] == 3
    json.dumps(doc, allow_nan=False)


def test_json_document_carries_the_real_exit_status():
    """Before: an interrupted run's JSON said "exit_status": 0 while the process exited 130."""
    doc = summary.json_document([_r("a")], options={}, wall=1.0, interrupted=True, status=130)
    assert doc["exit_status"] == 130 and doc["interrupted"]
    assert (
        summary.json_document([_r("a", "fail")], options={}, wall=1.0, interrupted=False)[
            "exit_status"
        ]
        == 1
    )

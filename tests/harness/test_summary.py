"""harness.summary: totals, the table, the exit status."""

from __future__ import annotations

import json

import pytest

from harness import summary
from harness.results import ArchResult, Failure


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
        (["pass", "build-error"], 1),
        (["pass", "forward-error"], 1),
        ([], 0),
    ],
)
def test_exit_status(statuses, code):
    assert summary.exit_status([_r(str(i), s) for i, s in enumerate(statuses)]) == code


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
        "unfused",
        "err",
        "fused",
        "err",
        "seconds",
    ]
    assert table[2].split() == ["llama", "qkv:2", "pass", "1.0e-07", "2.0e-07", "0.50"]
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

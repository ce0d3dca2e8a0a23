"""harness.reporting.summary: totals, the table, the exit status."""

from __future__ import annotations

import json

import pytest

from harness.base.results import STATUSES, ArchResult, Failure, Refusal
from harness.oracles.lifecycle import NOT_COMPILED, OPERATIONS
from harness.reporting import summary


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
        "arch",
        "fusions",
        "verdict",
        "lifecycle",
        "unfused",
        "fused",
        "s",
    ]
    assert table[2].split() == ["llama", "qkv:2", "pass", "-", "1.0e-7", "2.0e-7", "0.5"]
    wide = summary.format_table(results, wide=True).splitlines()
    assert wide[0].split()[0] == "architecture"
    assert wide[0].split()[4:] == ["unfused", "err", "fused", "err", "tol", "seconds"]
    assert wide[2].split()[4:] == ["1.0e-07", "2.0e-07", "-", "0.50"]
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
    results = [_r("big_bird", refusals=refusals), _r("x"), _r("y", "build-error")]
    rows = summary.format_table(results, wide=True).splitlines()[2:]
    assert "none (qkv: the forward does not trace as far as its projections)" in rows[0]
    assert "none (qkv: the forward" in summary.format_table(results)  # cut to fit, not dropped
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


def _every_operation(**verdicts: str) -> dict[str, dict[str, str]]:
    """A lifecycle record of every operation: `pass` unless named (`train="fail"`), and the
    `compile` that `--lifecycle quick` skips."""
    record = {op: {"verdict": "pass", "detail": ""} for op in OPERATIONS}
    record["compile"] = {"verdict": "n/a", "detail": NOT_COMPILED}
    for op, verdict in verdicts.items():
        record[op.replace("_", "-")] = {"verdict": verdict, "detail": "x"}
    return record


def _crowded() -> list[ArchResult]:
    """The widest rows the corpus can make: long names, many fusers, a long refusal, every
    lifecycle operation (failures, n/a and not run), the longest status, a slow check."""
    many = {f: 12 for f in ("glu", "layernorm", "moe", "qkv", "residual_norm", "rmsnorm")}
    refusal = Refusal(
        "qkv", "X", "the forward does not trace as far as its projections " * 3, 4, "a"
    )
    return [
        _r(
            "vision_text_dual_encoder_with_a_really_long_name",
            applied=many,
            unfused_error=2.8e-7,
            fused_error=3.1e-7,
            tolerance=1e-6,
            lifecycle=_every_operation(guard_round_trip="n/a", lora_after_fuse="n/a"),
        ),
        _r(
            "x" * 80,
            max(STATUSES, key=len),
            refusals=[refusal],
            lifecycle=_every_operation(generate="fail", train="fail", deepcopy="fail"),
        ),
        ArchResult("llama", "fail", "float32", "cpu", 0, 123456.78, unfused_error=float("nan")),
    ]


def _width(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_the_table_fits_100_columns_and_wide_shows_everything():
    """Issue 28: the table was ~150 columns and wrapped."""
    results = _crowded()
    narrow = summary.format_table(results)
    assert _width(narrow) <= summary.TABLE_WIDTH
    rows = narrow.splitlines()[2:]
    for row, result in zip(rows, results):
        name = row.split()[0]  # long names cut with an ellipsis, short ones whole
        assert name == result.architecture or (
            name.endswith("...") and result.architecture.startswith(name[:-3])
        )
    assert rows[0].split()[0] != results[0].architecture and rows[2].split()[0] == "llama"
    assert "x" * 30 not in narrow
    wide = summary.format_table(results, wide=True)
    assert _width(wide) > summary.TABLE_WIDTH
    assert "x" * 80 in wide and "vision_text_dual_encoder_with_a_really_long_name" in wide
    assert "glu:12 layernorm:12 moe:12 qkv:12 residual_norm:12 rmsnorm:12" in wide
    assert "fail: generate, train, deepcopy" in wide and "1.0e-06" in wide  # the tolerance
    short = summary.format_table([_r("llama", applied={"qkv": 2})])
    assert "..." not in short  # nothing is cut that fits


def test_the_table_says_not_run_for_what_the_mode_skipped_and_n_a_for_the_rest():
    """Issue 28: a skipped compile was printed as `n/a`, which says the unfused model cannot
    compile."""
    results = [
        _r("llama", lifecycle=_every_operation()),
        _r("gpt2", lifecycle=_every_operation(guard_round_trip="n/a")),
        _r("gemma", lifecycle={**_every_operation(), "compile": {"verdict": "n/a", "detail": "x"}}),
    ]
    rows = summary.format_table(results).splitlines()[2:]
    n = len(OPERATIONS)
    assert f"{n - 1} pass, 1 not run" in rows[0] and "n/a" not in rows[0]
    assert f"{n - 2} pass, 1 n/a, 1 not run" in rows[1]
    assert f"{n - 1} pass, 1 n/a" in rows[2] and "not run" not in rows[2]  # compile was tried
    wide = summary.format_table(results, wide=True).splitlines()[2:]
    assert "(not run: compile)" in wide[0]
    assert "(n/a: guard-round-trip; not run: compile)" in wide[1]
    t = summary.totals(results)
    assert t.lifecycle["compile"] == {"not run": 2, "n/a": 1}
    assert "compile 1 n/a / 2 not run" in summary.format_totals(t).replace("\n  ", " ")


def test_totals_wrap_at_100_columns():
    text = summary.format_totals(summary.totals(_crowded()), wall=1.0, jobs=1)
    assert _width(text) <= summary.TABLE_WIDTH
    assert text.count("\nlifecycle: ") == 1 and "\n  " in text  # continuations indented
    assert "optimizer-before-fuse" in text  # never split at a hyphen


@pytest.mark.parametrize("wide", [False, True])
def test_the_legend_explains_every_column_and_word(wide):
    legend = summary.format_legend(wide=wide)
    assert _width(legend) <= summary.TABLE_WIDTH
    for word in ("arch", "fusions:", "verdict:", "lifecycle:", "n/a:", "not run:", "float64", "-:"):
        assert word in legend
    assert ("tol:" in legend) is wide and ("--wide" in legend) is not wide


def test_merge_prints_the_narrow_table_with_its_legend_and_wide_on_request(tmp_path, capsys):
    """The CLI path (`merge` reads results files, so no model runs): the default output's
    table and legend fit 100 columns and say `not run`; `--wide` prints the full table."""
    from harness import cli
    from harness.base.results import ResultsWriter

    path = tmp_path / "r.jsonl"
    with ResultsWriter(path, append=False) as writer:
        for result in _crowded()[:2]:
            writer.write(result)
    assert cli.main(["merge", str(path)]) == 3  # the forward-error is the corpus's problem
    out = capsys.readouterr().out
    table = out[out.index("arch ") : out.index("\n\n")]
    assert _width(table) <= summary.TABLE_WIDTH and "not run" in table
    assert "legend:" in table and "--wide" in table
    assert cli.main(["merge", str(path), "--wide"]) == 3
    wide = capsys.readouterr().out
    assert "vision_text_dual_encoder_with_a_really_long_name" in wide and "tol:" in wide


def test_a_missing_optional_package_is_not_run_with_its_reason():
    """Before: lora-after-fuse without PEFT showed `n/a` ("the unfused model cannot do it")."""
    from harness.oracles.lifecycle import not_installed
    from harness.reporting import report_md

    ok = {"verdict": "pass", "detail": ""}
    missing = {"verdict": "n/a", "detail": not_installed("peft")}
    results = [
        _r("llama", lifecycle={"generate": ok, "lora-after-fuse": missing}),
        _r("qwen3", lifecycle={"generate": ok, "lora-after-fuse": missing}),
        _r(
            "gpt2", lifecycle={"generate": ok, "lora-after-fuse": {"verdict": "n/a", "detail": "x"}}
        ),
    ]
    assert summary.shown_verdict("lora-after-fuse", missing) == "not run"
    assert "1 pass, 1 not run" in summary.format_table(results[:1])
    assert summary.not_run_reasons(results) == [
        "lifecycle lora-after-fuse not run (2 architectures): not installed: peft "
        "(pip install peft)"
    ]
    assert summary.not_run_reasons(results[2:]) == []  # a real n/a keeps its word
    counts = report_md.lifecycle_counts(results)["lora-after-fuse"]
    assert (counts["n/a"], counts["not run"]) == (1, 2)

"""harness.reporting.report_md: a sweep's results as Markdown for a reviewer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.base.results import STATUSES, ArchResult, Failure, Refusal
from harness.oracles.lifecycle import NOT_COMPILED
from harness.reporting import plans, report_md

VERSIONS = {"transformers": "5.24.0", "torch": "2.13.0"}


def _r(name: str, status: str = "pass", **fields) -> ArchResult:
    fields.setdefault("seconds", 0.5)
    fields.setdefault("versions", VERSIONS)
    return ArchResult(name, status, "float32", "cpu", 0, **fields)


def _golden(entries: dict, **options) -> plans.Golden:
    return plans.Golden(
        path=Path("corpus/expected/5.24.json"),
        line="5.24",
        versions={},
        options={**plans.GOLDEN_OPTIONS, **options},
        architectures=entries,
    )


def _section(text: str, title: str) -> str:
    """The body of the `### title...` section of a report."""
    match = re.search(rf"^### {re.escape(title)}.*?\n(.*?)(?=^### |\Z)", text, re.M | re.S)
    assert match, f"no section {title!r} in:\n{text}"
    return match[1]


def _table_rows(body: str) -> list[list[str]]:
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]


# ------------------------------------------------------------------------------ markdown


@pytest.mark.parametrize(
    ("text", "span"),
    [
        ("plain", "`plain`"),
        ("a `b` c", "``a `b` c``"),
        ("``x``", "``` ``x`` ```"),
        ("two\nlines  here", "`two lines here`"),
        ("<script>alert(1)</script>", "`<script>alert(1)</script>`"),
        ("", ""),
    ],
)
def test_code_spans_hold_any_text(text, span):
    assert report_md.code(text) == span


def test_a_cell_has_no_line_break_and_no_bare_pipe():
    text = report_md.cell("a | b\nc")
    assert "\n" not in text and re.search(r"(?<!\\)\|", text) is None


def test_a_fenced_block_outlasts_the_backticks_inside():
    block = report_md.fenced("x\n````\ny")
    assert block.startswith("`````text\n") and block.endswith("\n`````")


# ------------------------------------------------------------------------------ lifecycle


def test_lifecycle_counts_say_not_run_for_what_was_not_tried():
    results = [
        _r(
            "a",
            lifecycle={
                "generate": {"verdict": "pass", "detail": ""},
                "compile": {"verdict": "n/a", "detail": NOT_COMPILED},
            },
        ),
        _r(
            "b",
            "fail",
            lifecycle={
                "generate": {"verdict": "fail", "detail": "tokens differ"},
                "compile": {"verdict": "pass", "detail": ""},
            },
        ),
        _r("c", lifecycle={"generate": {"verdict": "n/a", "detail": "no generate"}}),
        _r("d", "build-error"),
    ]
    counts = report_md.lifecycle_counts(results)
    assert list(counts) == ["generate", "compile"]  # harness.oracles.lifecycle's order
    assert counts["generate"] == {"pass": 1, "fail": 1, "n/a": 1, "not run": 1}
    assert counts["compile"] == {"pass": 1, "fail": 0, "n/a": 0, "not run": 3}
    assert all(sum(c.values()) == len(results) for c in counts.values())
    assert report_md.lifecycle_counts([_r("a")]) == {}


# -------------------------------------------------------------------------------- golden


def test_compare_with_golden_says_what_changed_in_words():
    golden = _golden(
        {
            "llama": {"status": "pass", "plan": {"LlamaAttention": {"applied": {"qkv": 2}}}},
            "gpt2": {"status": "pass", "plan": {}},
            "opt": {"status": "pass", "plan": {}},
            "gone": {"status": "unbuildable", "reason": "x"},
        }
    )
    results = [
        _r(
            "llama",
            refusals=[Refusal("qkv", "LlamaAttention", "a call writes q: detail", 2, "m")],
        ),
        _r("gpt2"),
    ]
    comparison = report_md.compare_with_golden(results, golden)
    assert list(comparison.changes) == ["llama"]
    assert any("the qkv fusion disappeared" in line for line in comparison.changes["llama"])
    assert comparison.compared == 2 and comparison.missing == ["opt"]  # unbuildable left out


def test_golden_plans_of_other_options_are_not_used():
    golden = _golden({})
    assert report_md.golden_note_for_options([_r("a")], golden) == ""
    bf16 = ArchResult("a", "pass", "bfloat16", "cpu", 0, 0.1)
    note = report_md.golden_note_for_options([bf16], golden)
    assert "float32/cpu/seed 0" in note and "bfloat16/cpu/seed 0" in note


def test_transformers_versions_of_results():
    results = [_r("a"), _r("b", versions={}), _r("c", versions={"transformers": "5.0.0"})]
    assert report_md.transformers_versions(results) == ["5.0.0", "5.24.0"]


# -------------------------------------------------------------------------------- render


def _sweep() -> list[ArchResult]:
    failure = Failure(
        "module-parity",
        "model.layers.0.self_attn",
        "qkv",
        "LlamaAttention",
        "error 3e-3 > tolerance 1e-5",
        detail="Traceback\n  ...\nRuntimeError: ```boom```",
        bundle="repro-bundles/llama--module-parity--qkv",
    )
    return [
        _r(
            "llama",
            "fail",
            message="model.layers.0.self_attn: parity",
            failures=[failure, Failure("lifecycle", None, None, None, "lifecycle train: grads")],
        ),
        _r("musicgen", "build-error", message="TypeError: bad | config\nsecond line"),
        _r("inkling", "inconclusive", message="float64 reference does not run"),
        *(_r(f"ok{i:02d}", seconds=float(i), applied={"qkv": 1}) for i in range(12)),
    ]


def test_render_has_every_section_and_the_gate():
    text = report_md.render(_sweep(), source="results/sweep.jsonl")
    assert text.startswith("## fusion-harness report\n") and text.endswith("\n")
    for title in (
        "Statuses",
        "Reach per fuser family",
        "Lifecycle verdicts",
        "Against the golden plan",
        "Slowest 10 architectures",
        "Problems",
    ):
        _section(text, title)
    assert "**Gate:** exit 1: fusion failure(s) in llama." in text
    assert "15 architectures; float32 on cpu, seed 0; torch 2.13.0, transformers 5.24.0" in text
    assert "Not compared: no golden plan given." in text


def test_every_status_has_a_meaning():
    assert set(report_md._MEANING) == set(STATUSES)


def test_render_counts_statuses():
    rows = _table_rows(_section(report_md.render(_sweep(), source="r"), "Statuses"))
    assert [row[:2] for row in rows] == [
        ["pass", "12"],
        ["inconclusive", "1"],
        ["fail", "1"],
        ["build-error", "1"],
    ]


def test_render_lists_the_slowest_first():
    rows = _table_rows(_section(report_md.render(_sweep(), source="r"), "Slowest"))
    assert [row[0] for row in rows] == [f"`ok{i:02d}`" for i in range(11, 1, -1)]
    assert rows[0][1] == "11.00"


def test_render_lists_each_problem_with_its_message_grouped_by_kind():
    body = _section(report_md.render(_sweep(), source="r"), "Problems")
    fusion, corpus = body.index("**Fusion failures** (1)"), body.index("**Corpus problems")
    assert fusion < body.index("`llama` **fail**") < corpus
    assert "module-parity at model.layers.0.self_attn [qkv]: error 3e-3 > tolerance 1e-5" in body
    assert "  - `lifecycle train: grads`" in body  # its message already names its kind
    assert "\n    - repro bundle: `repro-bundles/llama--module-parity--qkv`\n" in body
    assert "````text" in body and "RuntimeError: ```boom```" in body  # fenced past the backticks
    assert "`musicgen` **build-error**: `TypeError: bad | config second line`" in body
    assert "**Inconclusive (nothing failed)** (1)" in body


def test_a_corpus_problem_alone_is_gate_3_unless_strict():
    results = [_r("a"), _r("musicgen", "build-error", message="TypeError")]
    assert "**Gate:** exit 3: no fusion failure" in report_md.render(results, source="r")
    strict = report_md.render(results, source="r", strict_corpus=True)
    assert "**Gate:** exit 1: corpus problem(s) in musicgen" in strict
    assert "**Gate:** exit 0: green." in report_md.render([_r("a")], source="r")


def test_render_with_a_golden_comparison():
    golden = _golden({"ok00": {"status": "pass", "plan": {}}})
    results = [_r("ok00")]
    same = report_md.render(
        results, source="r", golden=report_md.compare_with_golden(results, golden)
    )
    assert "All 1 architectures match `corpus/expected/5.24.json`." in same
    changed = [_r("ok00", "fused-error", message="boom")]
    text = report_md.render(
        changed, source="r", golden=report_md.compare_with_golden(changed, golden)
    )
    body = _section(text, "Against the golden plan")
    assert "1 of 1 architectures differ from `corpus/expected/5.24.json`:" in body
    assert "- `ok00`\n  - `status fused-error (expected pass): boom`" in body


def test_render_reach_names_the_main_refusals():
    results = [
        _r("a", applied_by_class={"AAttention": {"qkv": 2}}),
        _r("b", refusals=[Refusal("qkv", "BAttention", "reads x | y: detail", 2, "m")]),
    ]
    rows = _table_rows(_section(report_md.render(results, source="r"), "Reach"))
    assert rows == [["attention", "1/2", "50%", "`reads x \\| y` (1)"]]


def test_render_of_no_results_says_so():
    text = report_md.render([], source="empty.jsonl")
    assert "0 architectures; no results" in text and "No results." in text
    assert "### Problems\n\nNone." in text


def test_the_problem_list_is_capped(monkeypatch):
    monkeypatch.setattr(report_md, "MAX_PROBLEMS", 2)
    results = [_r(f"f{i}", "fail", message="bad") for i in range(5)]
    body = _section(report_md.render(results, source="r"), "Problems")
    assert body.count("**fail**") == 2 and "... and 3 more (see the results file)." in body


def test_warnings_are_counted_per_line_and_fused_only_ones_come_first():
    results = [
        _r("a", "fail", warnings={"fused-only": ["UserWarning: x"], "unfused": ["W: y"]}),
        _r("b", "pass", warnings={"unfused": ["W: y"]}),
        _r("c", "pass"),
    ]
    text = report_md.render(results, source="r.jsonl")
    section = text.split("### Warnings", 1)[1].split("###", 1)[0]
    assert section.index("Only the fused model") < section.index("The unfused model itself")
    assert "| `W: y` | 2 | a, b |" in section
    assert "| `UserWarning: x` | 1 | a |" in section
    quiet = report_md.render([_r("c", "pass")], source="r.jsonl")
    assert "None recorded." in quiet.split("### Warnings", 1)[1]

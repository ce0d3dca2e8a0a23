"""harness.reporting.reach: per-family reach over results, counted in module classes."""

from __future__ import annotations

from harness.base.results import ArchResult, Refusal
from harness.reporting import reach


def _r(name, applied_by_class=None, refusals=()):
    return ArchResult(
        name,
        "pass",
        "float32",
        "cpu",
        0,
        0.1,
        applied_by_class=applied_by_class or {},
        refusals=list(refusals),
    )


def test_reach_counts_classes_once_per_family():
    results = [
        _r(
            "a",
            {"LlamaAttention": {"qkv": 2}, "LlamaMLP": {"glu": 2}},
            [Refusal("sibling", "LlamaMLP", "statements between: x", 2, "m.l.0.mlp")],
        ),
        _r(
            "b",
            {"LlamaAttention": {"qkv": 1}},
            [
                Refusal("qkv", "GPT2Attention", "more than three linears read: c_attn", 1, "x"),
                Refusal("sibling", "GPT2Attention", "statements between: y", 1, "x"),
                Refusal("moe", "Block", "the block returns a tuple", 2, "y"),
            ],
        ),
    ]
    table = reach.reach(results)
    attention = table["attention"]
    assert attention.reached == {"LlamaAttention"}
    assert attention.candidates == {"LlamaAttention", "GPT2Attention"}  # not LlamaMLP
    assert attention.refusals == {"more than three linears read": 1, "statements between": 1}
    assert table["glu"].reached == table["glu"].candidates == {"LlamaMLP"}
    assert table["moe"].share == 0.0 and table["rmsnorm"].share == 1.0
    text = reach.format_reach(table)
    assert "attention    1/2     50%" in text and "moe          0/1      0%" in text
    assert "rmsnorm" not in text  # no candidate: no line
    lines = text.splitlines()
    moe = lines.index("  moe          0/1      0%")
    assert lines[moe + 1] == "       1  the block returns a tuple"  # every category, in classes


def test_format_reach_lists_every_category_up_to_top_then_the_rest():
    table = {"attention": reach.Reach("attention", {"A", "B", "C", "D"}, {"A"})}
    table["attention"].refusals.update({"first": 2, "second": 1, "third": 1})
    lines = reach.format_reach(table, top=2).splitlines()
    assert lines[1:] == [
        "  attention    1/4     25%",
        "       2  first",
        "       1  second",
        "       1  (1 more categories)",
    ]

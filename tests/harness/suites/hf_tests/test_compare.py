"""harness.suites.hf_tests.compare: tests that pass unfused and fail fused are split into listed
exceptions and unexpected breaks, per test class."""

from __future__ import annotations

from harness.suites.hf_tests import compare

BASE = {
    "s.py::HFLlamaMixinTest::test_save_load": {"outcome": "passed"},
    "s.py::HFLlamaMixinTest::test_eager_matches_batched_and_grouped_inference": {
        "outcome": "passed"
    },
    "s.py::HFLlamaMixinTest::test_skipped": {"outcome": "skipped"},
    "s.py::HFMixtralMixinTest::test_save_load": {"outcome": "passed"},
    "s.py::HFMixtralMixinTest::test_flaky": {"outcome": "failed", "cause": "X"},
}
FUSED = {
    "s.py::HFLlamaMixinTest::test_save_load": {"outcome": "passed"},
    "s.py::HFLlamaMixinTest::test_eager_matches_batched_and_grouped_inference": {
        "outcome": "failed",
        "cause": "A: x",
    },
    "s.py::HFLlamaMixinTest::test_skipped": {"outcome": "failed", "cause": "B"},
    "s.py::HFMixtralMixinTest::test_save_load": {"outcome": "failed", "cause": "K: y"},
    "s.py::HFMixtralMixinTest::test_flaky": {"outcome": "failed", "cause": "X"},
}


def test_compare_splits_exceptions_from_unexpected_breaks():
    result = compare.compare(BASE, FUSED)
    assert result.passed_unfused == {"HFLlamaMixinTest": 2, "HFMixtralMixinTest": 1}
    assert result.broken == {"K: y": ["s.py::HFMixtralMixinTest::test_save_load"]}
    assert list(result.excepted.values()) == [
        ["s.py::HFLlamaMixinTest::test_eager_matches_batched_and_grouped_inference"]
    ]
    assert result.broken_per_class == {"HFLlamaMixinTest": 1, "HFMixtralMixinTest": 1}
    assert result.unexpected == 1
    text = compare.report(result)
    assert "1 unexpected tests fail only fused" in text
    assert "1 listed exceptions" in text
    assert "HFMixtralMixinTest                               1             1" in text


def test_test_class_of_a_node_id():
    assert compare.test_class("a/b.py::Cls::test_x") == "Cls"
    assert compare.test_class("a/b.py::test_x") == "a/b.py"


def test_the_suite_file_it_runs_exists() -> None:
    """The subprocess runs `compare.SUITE` from `compare.REPO`: a path off by one folder (the
    layout move put compare.py one level deeper) runs nothing, and every count reads 0."""
    assert (compare.REPO / "pyproject.toml").is_file()
    assert compare.SUITE.is_file()

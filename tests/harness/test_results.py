"""harness.results: records, strict JSON lines, torn-line tolerance."""

from __future__ import annotations

import json
import math

import pytest

from harness.results import (
    ArchResult,
    Failure,
    ModuleResult,
    Refusal,
    ResultsError,
    ResultsWriter,
    from_dict,
    read_results,
    to_json_line,
)


def _result(name: str = "llama", status: str = "pass", **fields) -> ArchResult:
    return ArchResult(
        architecture=name,
        status=status,
        dtype="float32",
        device="cpu",
        seed=0,
        seconds=0.1,
        **fields,
    )


def test_round_trip_keeps_non_finite_numbers_as_strict_json():
    result = _result(
        status="fail",
        unfused_error=1e-7,
        fused_error=math.nan,
        tolerance=math.inf,
        applied={"qkv": 2},
        refusals=[Refusal("glu", "MLP", "aliasing", 2, "m.0")],
        modules=[ModuleResult("m.0", "MLP", "glu", "fail", math.nan, 0.0, 1e-6, "nan", 1)],
        failures=[Failure("module-parity", "m.0", "glu", "MLP", "nan", observed=math.nan)],
    )
    line = to_json_line(result)
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = from_dict(json.loads(line))
    assert math.isnan(back.fused_error) and back.tolerance == math.inf
    assert back.modules[0].qualname == "m.0" and math.isnan(back.modules[0].fused_error)
    assert back.refusals == result.refusals
    assert math.isnan(back.failures[0].observed)


def test_from_dict_rejects_a_foreign_record():
    with pytest.raises(ResultsError, match="not a result record"):
        from_dict({"architecture": "x"})


def test_writer_appends_flushed_lines_and_reader_skips_a_torn_tail(tmp_path):
    path = tmp_path / "r.jsonl"
    with ResultsWriter(path, append=False) as writer:
        writer.write(_result("a"))
        writer.write(_result("b"))
        assert len(path.read_text().splitlines()) == 2  # flushed before close
    with path.open("a") as f:
        f.write('{"architecture": "c", "sta')  # a writer killed mid-line
    assert [r.architecture for r in read_results(path)] == ["a", "b"]
    with ResultsWriter(path, append=True) as writer:  # resume cuts the torn tail first
        writer.write(_result("c"))
    assert [r.architecture for r in read_results(path)] == ["a", "b", "c"]


def test_a_bad_line_in_the_middle_is_an_error_with_its_line_number(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(to_json_line(_result("a")) + "garbage\n" + to_json_line(_result("b")))
    with pytest.raises(ResultsError, match=r"r.jsonl:2"):
        read_results(path)


def test_fresh_writer_truncates(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(to_json_line(_result("old")))
    ResultsWriter(path, append=False).close()
    assert read_results(path) == []


def test_derived_progress_flags():
    assert not _result(status="build-error").built
    assert _result(status="fuse-error").built and not _result(status="fuse-error").ran
    assert _result(status="fused-error").ran
    assert not _result(status="timeout").built

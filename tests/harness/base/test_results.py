"""harness.base.results: records, strict JSON lines, torn-line tolerance."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.base.results import (
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

REPO = Path(__file__).resolve().parents[3]


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


@pytest.mark.parametrize(
    ("status", "corpus_problem", "fusion_failure"),
    [
        ("pass", False, False),
        ("inconclusive", False, False),
        ("fail", False, True),
        ("fused-error", False, True),
        ("fuse-error", False, True),
        ("crashed", False, True),  # no side is known: fail closed
        ("timeout", False, True),
        ("build-error", True, False),
        ("forward-error", True, False),
    ],
)
def test_every_status_is_classified_for_the_exit_status(status, corpus_problem, fusion_failure):
    result = _result(status=status)
    assert (result.corpus_problem, result.fusion_failure) == (corpus_problem, fusion_failure)


def test_versions_round_trip_and_old_records_have_none():
    versions = {"transformers": "5.24.0", "torch": "2.13.0+cpu"}
    assert from_dict(json.loads(to_json_line(_result(versions=versions)))).versions == versions
    record = json.loads(to_json_line(_result()))
    del record["versions"]  # records written before the sweep stamped them
    assert from_dict(record).versions == {}


# --- a results file is input too: every bad line is a one-line ResultsError -----------------


def _line(**changes) -> str:
    record = json.loads(to_json_line(_result("a")))
    record.update(changes)
    return json.dumps(record) + "\n"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]\n", "record must be an object, found array"),
        ("42\n", "record must be an object, found number"),
        ('"text"\n', "record must be an object, found string"),
        ('{"foo": 1}\n', "unknown field(s) 'foo'"),
        (_line(applied=[1]), "record.applied must be an object, found array"),
        (_line(applied={"qkv": "2"}), "record.applied['qkv'] must be an integer"),
        (_line(architecture=7), "record.architecture must be a string, found number"),
        (_line(seconds="fast"), 'record.seconds must be a number, found string "fast"'),
        (_line(seed=True), "record.seed must be an integer, found boolean"),
        (_line(status="bogus"), 'record.status is "bogus", not one of pass, inconclusive'),
        (_line(refusals=[{"fuser": "qkv"}]), "record.refusals[0] lacks field(s)"),
        (_line(modules=[[]]), "record.modules[0] must be an object, found array"),
        (_line(failures=[{"kind": 1}]), "record.failures[0] lacks field(s)"),
        (_line(lifecycle=[]), "record.lifecycle must be an object, found array"),
        (
            _line(lifecycle={"generate": {"verdict": "maybe", "detail": ""}}),
            "record.lifecycle['generate'].verdict is \"maybe\", not one of pass, fail, n/a",
        ),
        (
            _line(lifecycle={"generate": {"verdict": "pass"}}),
            "record.lifecycle['generate'] lacks field(s) 'detail'",
        ),
        (_line(versions=["5.24.0"]), "record.versions must be an object, found array"),
        (
            _line(versions={"transformers": 5.24}),
            "record.versions['transformers'] must be a string, found number",
        ),
    ],
)
def test_a_bad_complete_line_is_refused_with_its_field(tmp_path, line, message):
    """Before: a JSON-but-not-object line, a wrong type or an unknown status raised a
    traceback (AttributeError, TypeError), or was accepted and broke the table later."""
    path = tmp_path / "r.jsonl"
    path.write_text(to_json_line(_result("first")) + line)  # the bad line is the last one
    with pytest.raises(ResultsError, match=re.escape(message)) as info:
        read_results(path)
    assert str(info.value).startswith(f"{path}:2: ")
    assert "\n" not in str(info.value)


def test_lifecycle_verdicts_round_trip():
    lifecycle = {
        "generate": {"verdict": "pass", "detail": ""},
        "compile": {"verdict": "n/a", "detail": "no GPU"},
    }
    back = from_dict(json.loads(to_json_line(_result(lifecycle=lifecycle))))
    assert back.lifecycle == lifecycle
    record = json.loads(to_json_line(_result()))
    del record["lifecycle"]  # records written before lifecycle checks existed
    assert from_dict(record).lifecycle == {}


def test_a_garbage_complete_last_line_is_not_kept_and_appended_after(tmp_path):
    """Before: a complete bad last line was taken for a torn one and skipped, and a resume
    appended after it, so the *next* resume failed on it in the middle of the file."""
    path = tmp_path / "r.jsonl"
    path.write_text(to_json_line(_result("a")) + '{"foo": 1}\n')
    with pytest.raises(ResultsError, match=r"r\.jsonl:2: .*unknown field"):
        read_results(path)
    path.write_text(to_json_line(_result("a")) + "garbage\n")
    with pytest.raises(ResultsError, match=r"r\.jsonl:2: not JSON"):
        read_results(path)


def test_non_utf8_bytes_are_a_clear_error(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(to_json_line(_result("a")).encode() + b"\xff\xfe{}\n")
    with pytest.raises(ResultsError, match=r"r\.jsonl:2: not UTF-8 text"):
        read_results(path)


def test_a_torn_last_line_may_end_inside_a_utf8_character(tmp_path):
    path = tmp_path / "r.jsonl"
    torn = to_json_line(_result("a", message="é")).encode()[:-4]
    path.write_bytes(to_json_line(_result("b")).encode() + torn)
    assert [r.architecture for r in read_results(path)] == ["b"]


def test_a_foreign_file_is_not_a_results_file(tmp_path):
    """Before: --resume on a bundle.json (pretty-printed JSON) exited 0 and appended to it."""
    path = tmp_path / "bundle.json"
    path.write_text(json.dumps({"format": 1, "config": {}}, indent=2) + "\n")
    with pytest.raises(
        ResultsError, match=r"bundle\.json:1: not JSON .*is it a fusion-harness results file"
    ):
        read_results(path)


def test_a_directory_or_a_device_is_not_read(tmp_path):
    with pytest.raises(ResultsError, match="not a regular file"):
        read_results(tmp_path)
    with pytest.raises(ResultsError, match="not a regular file"):
        read_results(Path("/dev/zero"))  # would read forever
    with pytest.raises(ResultsError, match="not a regular file"):
        ResultsWriter(tmp_path, append=True)


# --- one writer at a time ---------------------------------------------------------------------


def test_a_second_writer_is_refused_while_the_first_holds_the_file(tmp_path):
    """Before: two sweeps on one file both exited 0, one's results silently gone."""
    path = tmp_path / "r.jsonl"
    with ResultsWriter(path, append=False) as first:
        first.write(_result("a"))
        for append in (False, True):
            with pytest.raises(ResultsError, match="being written by another sweep"):
                ResultsWriter(path, append=append)
        first.write(_result("b"))  # the refused writer truncated nothing
    assert [r.architecture for r in read_results(path)] == ["a", "b"]
    with ResultsWriter(path, append=True) as again:  # released on close
        again.write(_result("c"))
    assert len(read_results(path)) == 3


def test_the_lock_dies_with_its_process(tmp_path):
    path = tmp_path / "r.jsonl"
    code = (
        "import sys, time; from pathlib import Path; from harness.base.results import ResultsWriter;"
        f"w = ResultsWriter(Path({str(path)!r}), append=False); print('locked', flush=True);"
        "time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ResultsError, match="another sweep"):
            ResultsWriter(path, append=True)
    finally:
        holder.kill()
        holder.wait()
    ResultsWriter(path, append=True).close()  # SIGKILL released it


# --- unwritable and full file systems ---------------------------------------------------------


def test_an_unwritable_location_is_a_results_error(unwritable_dir):
    with pytest.raises(ResultsError, match="cannot write results file"):
        ResultsWriter(unwritable_dir / "sub" / "r.jsonl", append=False)


def test_a_full_disk_is_a_results_error_and_keeps_earlier_lines(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    writer = ResultsWriter(path, append=False)
    writer.write(_result("a"))
    full = _FullFile(writer._file)
    monkeypatch.setattr(writer, "_file", full)
    with pytest.raises(ResultsError, match="No space left on device"):
        writer.write(_result("b"))
    writer.close()  # does not raise again
    assert [r.architecture for r in read_results(path)] == ["a"]


class _FullFile:
    """A file object whose writes fail like a full disk (ENOSPC) after a partial write."""

    def __init__(self, real) -> None:
        self.real = real

    def write(self, data: bytes) -> int:
        self.real.write(data[:5])
        self.real.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        self.real.close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}

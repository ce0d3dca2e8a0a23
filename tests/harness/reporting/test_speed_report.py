"""harness.reporting.speed_report: bench and perf JSON documents read into series and rendered."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from harness.reporting import speed_report
from harness.reporting.speed_report import SpeedDocumentError
from harness.speed import perf
from harness.speed.bench.table import Row

MACHINE = {
    "cpu_model": "Intel(R) Xeon(R) Processor",
    "aten_cpu_capability": "AVX512",
    "threads": 1,
    "torch": "2.13.0+cpu",
    "transformers": "5.24.0",
    "clock": "wall",
}


def _row(tokens: int, speedup: float | None, variant: str = "fused", note: str = "") -> Row:
    unfused = 10.0 * tokens
    return Row(
        kernel="model_llama",
        variant=variant,
        shape="llama-3.2-1b-2L",
        tokens=tokens,
        dtype="float32",
        device="cpu",
        unfused_ms=unfused,
        fused_ms=None if speedup is None else unfused / speedup,
        speedup=speedup,
        note=note,
    )


def bench_document() -> dict:
    """What `fusion-harness bench --json` writes (its own Row dataclass, as the bench does)."""
    rows = [_row(16, 1.4), _row(1, 1.02), _row(128, None, note="cannot build: out of memory")]
    rows.append(_row(16, 0.9, variant="fused+compiled"))
    return {"machine": MACHINE, "copy_bandwidth_gbs": None, "rows": [asdict(r) for r in rows]}


def perf_document() -> dict:
    """What `fusion-harness perf --json` writes (harness.speed.perf.document of real records)."""
    timings = [
        perf.token_perf(128, [2.0, 2.1, 2.2, 2.0, 2.1], [1.0, 1.1, 1.0, 1.05, 1.0]),
        perf.token_perf(1, [1.0, 1.0, 1.1, 1.0, 1.0], [1.0, 1.02, 1.0, 1.01, 0.99]),
    ]
    record = perf.ArchPerf("qwen3", perf.arch_verdict(timings), timings)
    doc = perf.document([record], perf.PerfOptions())
    doc["machine"] = MACHINE
    return json.loads(json.dumps(doc))


def test_bench_rows_become_one_series_per_case_and_variant() -> None:
    document = speed_report.parse(bench_document())
    assert document.kind == "bench"
    labels = [s.label for s in document.series]
    assert labels == [
        "model_llama [llama-3.2-1b-2L, float32]",
        "model_llama [llama-3.2-1b-2L, float32] fused+compiled",
    ]
    fused = document.series[0]
    assert [(p.tokens, p.ratio) for p in fused.points] == [(1, 1.02), (16, 1.4)]  # sorted
    assert all(p.low is None for p in fused.points)  # a bench row has no spread of the ratio
    assert fused.notes == ["128 tokens: cannot build: out of memory"]


def test_perf_records_keep_the_quartiles_of_the_paired_ratios() -> None:
    data = perf_document()
    document = speed_report.parse(data)
    assert document.kind == "perf" and document.thresholds["slower"] == perf.SLOWER
    (series,) = document.series
    assert series.label == "qwen3" and series.verdict == data["records"][0]["verdict"] != ""
    at = {p.tokens: p for p in series.points}
    assert at[128].low <= at[128].ratio <= at[128].high and at[128].ratio > 1.8
    assert [p.tokens for p in series.points] == [1, 128]


def test_render_states_the_machine_and_every_cell() -> None:
    text = speed_report.render(speed_report.parse(perf_document()), "perf.json", plot="p.png")
    assert "measured on Intel(R) Xeon(R) Processor, ATen AVX512, 1 threads" in text
    assert "| series | 1 tokens | 128 tokens | verdict |" in text
    assert "![fused / unfused per token count](p.png)" in text
    bench = speed_report.render(speed_report.parse(bench_document()), "bench.json")
    assert "1.40x" in bench and "Not measured:" in bench and "out of memory" in bench
    assert "| `model_llama [llama-3.2-1b-2L, float32] fused+compiled` | - | 0.90x |\n" in bench


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["rows"].append("x"), "rows[4] is not an object"),
        (lambda d: d["rows"][0].pop("tokens"), "rows[0] has no 'tokens'"),
        (lambda d: d["rows"][0].update(speedup="fast"), "rows[0].speedup is 'fast'"),
    ],
)
def test_a_malformed_bench_document_names_its_field(mutate, message) -> None:
    data = bench_document()
    mutate(data)
    with pytest.raises(SpeedDocumentError, match=message.replace("[", r"\[")):
        speed_report.parse(data)


def test_a_malformed_perf_document_names_its_field() -> None:
    data = perf_document()
    data["records"][0]["timings"][0]["ratio_q1"] = None
    with pytest.raises(SpeedDocumentError, match=r"records\[0\].timings\[0\].ratio_q1 is None"):
        speed_report.parse(data)


def test_only_speed_documents_are_read_as_such(tmp_path) -> None:
    results = tmp_path / "r.jsonl"
    results.write_text('{"arch": "llama"}\n{"arch": "gpt2"}\n')
    assert speed_report.read_speed_document(results) is None
    one_line = tmp_path / "one.jsonl"
    one_line.write_text('{"arch": "llama", "status": "pass"}\n')
    assert speed_report.read_speed_document(one_line) is None
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(bench_document()))
    assert speed_report.read_speed_document(bench).kind == "bench"

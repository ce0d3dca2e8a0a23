"""harness.reporting.speed_plot: the PNG of a speed document, and the message without matplotlib."""

from __future__ import annotations

import json

import pytest

from harness import cli
from harness.reporting import speed_plot, speed_report
from tests.harness.reporting.test_speed_report import bench_document, perf_document

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture
def with_matplotlib():
    if not speed_plot.available():
        pytest.skip(f"matplotlib is not installed ({speed_plot.INSTALL_HINT})")


@pytest.mark.parametrize("make", [bench_document, perf_document])
def test_a_png_is_drawn_for_either_document(make, tmp_path, with_matplotlib) -> None:
    path = speed_plot.write_png(speed_report.parse(make()), tmp_path / "plot.png")
    width, height = _png_size(path.read_bytes())
    assert (width, height) == (880, 528)  # figsize 8 x 4.8 inches at 110 dpi


def test_the_plot_draws_what_the_document_measured(tmp_path, with_matplotlib) -> None:
    # Two documents differing only in one ratio give different images: the data is drawn.
    first, second = perf_document(), perf_document()
    second["records"][0]["timings"][0]["ratio"] = 0.5
    second["records"][0]["timings"][0]["ratio_q1"] = 0.4
    a = speed_plot.write_png(speed_report.parse(first), tmp_path / "a.png").read_bytes()
    b = speed_plot.write_png(speed_report.parse(second), tmp_path / "b.png").read_bytes()
    assert a != b


def test_report_writes_markdown_and_plot(tmp_path, capsys, with_matplotlib) -> None:
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(bench_document()))
    out, plot = tmp_path / "speed.md", tmp_path / "speed.png"
    assert cli.main(["report", str(source), "--out", str(out), "--plot", str(plot)]) == 0
    text = out.read_text()
    assert "benchmark, 2 series" in text and "![fused / unfused per token count](speed.png)" in text
    _png_size(plot.read_bytes())
    assert "plot: " in capsys.readouterr().err


def test_without_matplotlib_the_markdown_is_written_and_the_exit_is_2(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(speed_plot, "Figure", None)
    monkeypatch.setattr(speed_plot, "IMPORT_ERROR", "No module named 'matplotlib'")
    source = tmp_path / "perf.json"
    source.write_text(json.dumps(perf_document()))
    out, plot = tmp_path / "perf.md", tmp_path / "perf.png"
    assert cli.main(["report", str(source), "--out", str(out), "--plot", str(plot)]) == 2
    assert "qwen3" in out.read_text() and "![" not in out.read_text() and not plot.exists()
    err = capsys.readouterr().err
    assert "the plot needs matplotlib" in err and "[plot] extra" in err


def test_plot_of_a_results_file_is_a_usage_error(tmp_path, capsys) -> None:
    results = tmp_path / "r.jsonl"
    results.write_text('{"arch": "llama"}\n')
    assert cli.main(["report", str(results), "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot draws bench or perf JSON" in capsys.readouterr().err


def test_a_malformed_speed_document_is_a_usage_error(tmp_path, capsys) -> None:
    data = bench_document()
    data["rows"][0]["speedup"] = "fast"
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(data))
    assert cli.main(["report", str(source)]) == 2
    assert "is not a readable speed document: rows[0].speedup" in capsys.readouterr().err

"""Speed documents (what `fusion-harness bench --json` and `fusion-harness perf --json`
write) read into series of fused / unfused ratios per token count, and rendered as Markdown.

A series is one curve: a bench case (kernel, shape, dtype, variant against its unfused
baseline) or a perf architecture. Each point carries the ratio (above 1: fused faster) and,
where the document has it, the spread behind it: perf records carry the quartiles of the
per-round paired ratios; bench rows carry only each variant's own IQR of times, which is not
a spread of the ratio, so bench points have none (a plot never draws a spread the
measurement did not make). `harness.reporting.speed_plot` draws the same series as a PNG.

Reading is strict and never executes anything: a document is JSON, of one of the two
shapes; anything else is `SpeedDocumentError` with what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.reporting.report_md import cell, code, table


class SpeedDocumentError(ValueError):
    """The file is not a bench or perf document this module can read (the message says why)."""


@dataclass(frozen=True)
class Point:
    """Fused / unfused at one token count; `low`/`high` the quartiles of the paired ratios
    where measured (None where the document has no spread of the ratio)."""

    tokens: int
    ratio: float
    low: float | None = None
    high: float | None = None


@dataclass
class Series:
    """One curve: its label, its points by token count, and a verdict where the document
    gives one (perf: faster / same / slower)."""

    label: str
    points: list[Point] = field(default_factory=list)
    verdict: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class SpeedDocument:
    """A bench or perf document as series, with the machine line every figure needs."""

    kind: str
    """'bench' or 'perf'."""
    machine: str
    series: list[Series]
    thresholds: dict[str, float] = field(default_factory=dict)


def is_speed_document(data: Any) -> bool:
    """Whether parsed JSON `data` has the shape of a bench (`machine` + `rows`) or perf
    (`machine` + `records` + `thresholds`) document."""
    if not isinstance(data, dict) or not isinstance(data.get("machine"), dict):
        return False
    return isinstance(data.get("rows"), list) or (
        isinstance(data.get("records"), list) and isinstance(data.get("thresholds"), dict)
    )


def read_speed_document(path: Path) -> SpeedDocument | None:
    """The speed document at `path`, or None when the file is JSON of another kind or not a
    single JSON value (a results JSONL file: the caller reads it as results). Raises
    OSError where the file cannot be read and `SpeedDocumentError` where it has a speed
    document's shape but malformed contents."""
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError:  # not UTF-8 or not one JSON value: read_results says what it is
        return None
    if not is_speed_document(data):
        return None
    return parse(data)


def machine_line(machine: Mapping[str, Any]) -> str:
    """One line naming what every figure was measured on: CPU or GPU, ATen capability,
    threads, torch and Transformers versions."""
    parts = [str(machine.get("gpu") or machine.get("cpu_model") or "unknown machine")]
    if machine.get("aten_cpu_capability"):
        parts.append(f"ATen {machine['aten_cpu_capability']}")
    if machine.get("threads") is not None:
        parts.append(f"{machine['threads']} threads")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    if machine.get("transformers"):
        parts.append(f"transformers {machine['transformers']}")
    if machine.get("clock"):
        parts.append(f"{machine['clock']} clock")
    return ", ".join(parts)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpeedDocumentError(f"{what} is {value!r}, not a number")
    return float(value)


def _bench_series(rows: Sequence[Any]) -> list[Series]:
    by_label: dict[str, Series] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise SpeedDocumentError(f"rows[{i}] is not an object")
        try:
            kernel, variant, tokens = row["kernel"], row["variant"], row["tokens"]
        except KeyError as exc:
            raise SpeedDocumentError(f"rows[{i}] has no {exc.args[0]!r}") from None
        label = f"{kernel} [{row.get('shape', '')}, {row.get('dtype', '')}]"
        if variant != "fused":
            label += f" {variant}"
        series = by_label.setdefault(label, Series(label))
        tokens = int(_number(tokens, f"rows[{i}].tokens"))
        if row.get("speedup") is None:
            series.notes.append(f"{tokens} tokens: {row.get('note') or 'not measured'}")
            continue
        series.points.append(Point(tokens, _number(row["speedup"], f"rows[{i}].speedup")))
    for series in by_label.values():
        series.points.sort(key=lambda p: p.tokens)
    return list(by_label.values())


def _perf_series(records: Sequence[Any]) -> list[Series]:
    out = []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or "arch" not in record:
            raise SpeedDocumentError(f"records[{i}] is not an architecture record")
        series = Series(str(record["arch"]), verdict=str(record.get("verdict", "")))
        for j, timing in enumerate(record.get("timings") or []):
            what = f"records[{i}].timings[{j}]"
            if not isinstance(timing, dict):
                raise SpeedDocumentError(f"{what} is not an object")
            if timing.get("kind", "forward") != "forward":
                continue  # a `generate` timing: tokens generated, not a forward's width
            series.points.append(
                Point(
                    int(_number(timing.get("tokens"), f"{what}.tokens")),
                    _number(timing.get("ratio"), f"{what}.ratio"),
                    _number(timing.get("ratio_q1"), f"{what}.ratio_q1"),
                    _number(timing.get("ratio_q3"), f"{what}.ratio_q3"),
                )
            )
        series.points.sort(key=lambda p: p.tokens)
        out.append(series)
    return out


def parse(data: Mapping[str, Any]) -> SpeedDocument:
    """A `SpeedDocument` of parsed JSON `data` (`is_speed_document` true); raises
    `SpeedDocumentError` naming the first malformed field."""
    machine = machine_line(data["machine"])
    if isinstance(data.get("rows"), list):
        return SpeedDocument("bench", machine, _bench_series(data["rows"]))
    thresholds = {str(k): _number(v, f"thresholds.{k}") for k, v in data["thresholds"].items()}
    return SpeedDocument("perf", machine, _perf_series(data["records"]), thresholds)


def _cell(point: Point | None) -> str:
    if point is None:
        return "-"
    if point.low is None or point.high is None:
        return f"{point.ratio:.2f}x"
    return f"{point.ratio:.2f}x [{point.low:.2f}-{point.high:.2f}]"


def render(document: SpeedDocument, source: str, plot: str | None = None) -> str:
    """Markdown: the machine, one row per series with its ratio at each token count (perf:
    with the quartiles of the paired ratios and the verdict), the notes of what did not run,
    and a link to the plot when one was written."""
    tokens = sorted({p.tokens for s in document.series for p in s.points})
    what = "benchmark" if document.kind == "bench" else "performance verdict"
    lines = [
        f"{code(source)}: {what}, {len(document.series)} series, fused / unfused (above 1x "
        f"the fused model is faster); measured on {document.machine}.",
        "",
    ]
    if document.kind == "perf":
        lines += [
            "Each cell: median of the per-round paired ratios [quartiles]; an architecture is "
            f"`slower` when the upper quartile is below {document.thresholds.get('slower', 0):g}.",
            "",
        ]
    else:
        lines += ["Each cell: unfused median time / fused median time, interleaved rounds.", ""]
    header = ["series", *(f"{t} tokens" for t in tokens)]
    if document.kind == "perf":
        header.append("verdict")
    rows = []
    for series in document.series:
        at = {p.tokens: p for p in series.points}
        row = [cell(series.label), *(_cell(at.get(t)) for t in tokens)]
        if document.kind == "perf":
            row.append(series.verdict or "-")
        rows.append(row)
    lines.append(table(header, rows, right=tuple(range(1, len(tokens) + 1))))
    notes = [f"- {s.label}: {n}" for s in document.series for n in s.notes]
    if notes:
        lines += ["", "Not measured:", *notes]
    if plot:
        lines += ["", f"![fused / unfused per token count]({plot})"]
    return "\n".join(lines) + "\n"

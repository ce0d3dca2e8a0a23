"""Measuring kernels and the on-disk table (`fusion.kernels.calibration`)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fusion.kernels import calibration
from fusion.kernels.calibration import Entry, Ratio, Table


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path))
    return tmp_path


def _entry() -> Entry:
    return Entry(
        op="stacked",
        shape=(8, 8, 16),
        dtype="float32",
        rows=16,
        threads=1,
        median_us={"reference": 10.0, "stacked": 8.0},
        ratios={"stacked": Ratio(1.25, 1.1, 1.3)},
        rounds=7,
    )


def test_ratio_wins_needs_margin_and_lower_quartile() -> None:
    assert Ratio(1.2, 1.0, 1.4).wins()
    assert not Ratio(1.2, 0.99, 1.4).wins()
    assert not Ratio(1.0 + calibration.MARGIN / 2, 1.0, 1.1).wins()


def test_best_takes_the_highest_winning_median() -> None:
    e = Entry(
        **{
            **_entry().__dict__,
            "ratios": {"stacked": Ratio(1.2, 1.1, 1.3), "native": Ratio(1.5, 0.9, 2.0)},
        }
    )
    assert e.best(("reference", "stacked", "native")) == "stacked"  # native's q25 < 1
    assert e.best(("reference", "native")) == "reference"


def test_judge_pairs_rounds() -> None:
    times = {"reference": [2.0, 4.0, 2.0, 2.0, 2.0], "fast": [1.0, 4.0, 1.0, 1.0, 1.0]}
    ratio = calibration.judge(times)["fast"]
    assert ratio.median == 2.0 and ratio.q25 == 2.0 and ratio.q75 == 2.0


def test_table_round_trip_and_foreign_files(cache) -> None:
    table = calibration.load_table()
    assert table.entries == {}
    table.add(_entry())
    path = calibration.save_table(table)
    assert path.parent == cache / "calibration"
    again = calibration.load_table()
    assert again.lookup("stacked", (8, 8, 16), "float32", 16, 1) == _entry()
    data = json.loads(path.read_text())
    data["key"] = "0" * 16
    path.write_text(json.dumps(data))
    assert calibration.load_table().entries == {}  # measured on another machine
    path.write_text("{not json")
    assert calibration.load_table().entries == {}


def test_machine_key_follows_the_limiting_environment(monkeypatch) -> None:
    base = calibration.machine_key()
    current = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2" if current == "default" else "default")
    assert calibration.machine_key() != base


def test_time_calls_interleaves_over_copies() -> None:
    """Every call reads the copy after the one the call before it read, and each round
    starts with another kernel (no kernel always runs right after the other)."""
    sequence: list[tuple[str, int]] = []
    calls = {name: (lambda i, n=name: sequence.append((n, i))) for name in ("ref", "other")}
    calls = {"reference": calls["ref"], "other": calls["other"]}
    times, rounds = calibration.time_calls(calls, copies=3, budget_s=0.0)
    assert rounds == calibration.MIN_ROUNDS
    assert all(len(v) == rounds for v in times.values())
    assert [i for _, i in sequence] == [n % 3 for n in range(2 * (rounds + 2))]
    firsts = [sequence[2 * r][0] for r in range(rounds + 2)]
    assert firsts[:4] == ["ref", "other", "ref", "other"]


def test_measure_key_times_the_eligible_kernels() -> None:
    entry = calibration.measure_key("stacked", (32, 32, 64), "float32", 2, budget_s=0.0)
    assert entry is not None
    assert set(entry.median_us) >= {"reference", "stacked"}
    assert entry.rows == 2 and entry.threads == torch.get_num_threads()
    assert calibration.measure_key("linear", (32, 64), "float32", 2, budget_s=0.0) is None or (
        "native" in calibration.measure_key("linear", (32, 64), "float32", 2, budget_s=0.0).ratios
    )


def test_copies_cover_the_stream() -> None:
    stream = calibration.stream_bytes()
    assert calibration.copies_for(stream * 4) == 2
    assert calibration.copies_for(stream // 4) == 4
    assert calibration.copies_for(1) == calibration.MAX_COPIES
    assert calibration.copies_for(1 << 20, stream=64 << 20) == 64
    assert isinstance(Table("k").to_json()["entries"], list)


def _cache_dir(root, *levels: tuple[str, str]) -> None:
    for i, (kind, size) in enumerate(levels):
        index = root / f"index{i}"
        index.mkdir()
        (index / "type").write_text(kind + "\n")
        (index / "size").write_text(size + "\n")


def test_last_level_cache_is_the_largest_data_cache(tmp_path) -> None:
    _cache_dir(
        tmp_path,
        ("Data", "48K"),
        ("Instruction", "512M"),
        ("Unified", "2048K"),
        ("Unified", "260M"),
    )
    assert calibration.last_level_cache_bytes(tmp_path) == 260 << 20
    assert calibration.last_level_cache_bytes(tmp_path / "absent") == (
        calibration.FALLBACK_CACHE_BYTES
    )


def test_the_stream_outgrows_the_cache_it_measures_past(monkeypatch) -> None:
    # A machine with a 260 MB L3 (a Sapphire Rapids VM here) must not be measured on 256 MB of
    # copies, which it holds: the stream is derived from the cache the OS reports.
    monkeypatch.setattr(calibration, "last_level_cache_bytes", lambda: 260 << 20)
    monkeypatch.setattr(calibration, "_available_bytes", lambda: 24 << 30)
    assert calibration.stream_bytes() == calibration.STREAM_FACTOR * (260 << 20)
    assert calibration.stream_bytes() > 260 << 20
    # ...but never more than a quarter of the memory available now.
    monkeypatch.setattr(calibration, "_available_bytes", lambda: 1 << 30)
    assert calibration.stream_bytes() == 256 << 20

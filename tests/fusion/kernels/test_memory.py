"""The machine-memory facts streamed measurements rely on (`fusion.kernels.memory`)."""

from __future__ import annotations

from fusion.kernels import memory


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
    assert memory.last_level_cache_bytes(tmp_path) == 260 << 20
    assert memory.last_level_cache_bytes(tmp_path / "absent") == (memory.FALLBACK_CACHE_BYTES)


def test_the_stream_outgrows_the_cache_it_measures_past(monkeypatch) -> None:
    # A machine with a 260 MB L3 (a Sapphire Rapids VM here) must not be measured on 256 MB of
    # copies, which it holds: the stream is derived from the cache the OS reports.
    monkeypatch.setattr(memory, "last_level_cache_bytes", lambda: 260 << 20)
    monkeypatch.setattr(memory, "available_bytes", lambda: 24 << 30)
    assert memory.stream_bytes() == memory.STREAM_FACTOR * (260 << 20)
    assert memory.stream_bytes() > 260 << 20
    # ...but never more than a quarter of the memory available now.
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 30)
    assert memory.stream_bytes() == 256 << 20

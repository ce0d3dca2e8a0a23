"""Tests for `fusion/kernels/native/build.py`: builds once per key, never loads a stale or
half-written library, and fails closed with a reason naming what failed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fusion.kernels.native import build as native_build

needs_compiler = pytest.mark.skipif(
    native_build.compiler() is None, reason="no C compiler on this machine: nothing to build"
)

_GOOD = "int fh_answer(void) { return 42; }\n"


@pytest.fixture
def sources(tmp_path: Path, monkeypatch) -> Path:
    """A private source dir and cache dir for each test."""
    source_dir = tmp_path / "csrc"
    source_dir.mkdir()
    monkeypatch.setattr(native_build, "SOURCE_DIR", source_dir)
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path / "cache"))
    return source_dir


@needs_compiler
def test_builds_once_then_loads_from_the_cache(sources: Path, monkeypatch) -> None:
    """The first call compiles and loads; the second loads the cached library without
    running the compiler again; a changed source gets a new key (a new build)."""
    (sources / "answer.c").write_text(_GOOD)
    first = native_build.build("answer")
    assert first.library is not None and first.library.fh_answer() == 42
    assert first.path is not None and first.path.parent == native_build.cache_dir() / "native"
    compiles: list[list[str]] = []
    real_run = subprocess.run

    def spy(args, **kwargs):
        if "-shared" in args:
            compiles.append(args)
        return real_run(args, **kwargs)

    monkeypatch.setattr(subprocess, "run", spy)
    again = native_build.build("answer")
    assert again.path == first.path and compiles == []
    (sources / "answer.c").write_text(_GOOD.replace("42", "43"))
    changed = native_build.build("answer")
    assert changed.path != first.path and len(compiles) == 1
    assert changed.library.fh_answer() == 43
    # no temporary files left behind
    assert not list((native_build.cache_dir() / "native").glob(".build-*"))


def test_key_covers_source_compiler_and_flags(monkeypatch) -> None:
    """Any change to the source, the compiler's identity or the flags changes the key."""
    base = native_build.cache_key("a", "gcc 12")
    assert native_build.cache_key("b", "gcc 12") != base
    assert native_build.cache_key("a", "gcc 13") != base
    monkeypatch.setattr(native_build, "FLAGS", (*native_build.FLAGS, "-DX"))
    assert native_build.cache_key("a", "gcc 12") != base
    monkeypatch.undo()
    monkeypatch.setenv(native_build.MARCH_ENV, "x86-64-v3")
    assert native_build.cache_key("a", "gcc 12") != base
    assert "-march=x86-64-v3" in native_build.flags()


@needs_compiler
def test_a_compile_error_is_reported_not_raised(sources: Path) -> None:
    """A source that does not compile: no library, the reason quotes the compiler, and no
    file is left in the cache."""
    (sources / "broken.c").write_text("int fh_broken(void) { return }\n")
    built = native_build.build("broken")
    assert built.library is None
    assert "failed on broken.c" in built.reason and "error" in built.reason
    assert not list((native_build.cache_dir() / "native").glob("*"))


def test_no_compiler_and_missing_source_are_reasons(sources: Path, monkeypatch) -> None:
    (sources / "answer.c").write_text(_GOOD)
    monkeypatch.setenv("CC", "no-such-compiler-fh")
    built = native_build.build("answer")
    assert built.library is None and "no C compiler ('no-such-compiler-fh'" in built.reason
    missing = native_build.build("absent")
    assert missing.library is None and "cannot read" in missing.reason


@needs_compiler
def test_an_unwritable_cache_is_a_reason(sources: Path, tmp_path: Path, monkeypatch) -> None:
    (sources / "answer.c").write_text(_GOOD)
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(blocker))
    built = native_build.build("answer")
    assert built.library is None and "cannot write the kernel cache" in built.reason


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FUSION_HARNESS_CACHE", str(tmp_path / "a"))
    assert native_build.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("FUSION_HARNESS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert native_build.cache_dir() == tmp_path / "x" / "fusion-harness"


def _maps(*paths: str) -> str:
    return (
        "".join(f"7f00-7f01 r-xp 00000000 08:01 1 {p}\n" for p in paths) + "7f02-7f03 rw-p 0 0 0\n"
    )


def test_openmp_runtimes_are_counted_by_file(tmp_path: Path) -> None:
    torch_gomp = "/venv/torch/lib/libgomp.so.1"
    assert native_build.openmp_runtimes(_maps(torch_gomp, torch_gomp, "/lib/libc.so.6")) == [
        torch_gomp
    ]
    two = _maps(torch_gomp, "/opt/intel/libiomp5.so", "/lib/libomptarget.so")
    assert native_build.openmp_runtimes(two) == ["/opt/intel/libiomp5.so", torch_gomp]
    renamed = _maps("/venv/torch.libs/libgomp-a34b3233.so.1", "/usr/lib/libgomp.so.1")
    assert len(native_build.openmp_runtimes(renamed)) == 2
    maps = tmp_path / "maps"
    maps.write_text(two)
    assert "2 OpenMP runtimes loaded" in native_build.one_openmp_runtime(maps)
    maps.write_text(_maps(torch_gomp))
    assert native_build.one_openmp_runtime(maps) == ""
    assert "cannot check" in native_build.one_openmp_runtime(tmp_path / "absent")

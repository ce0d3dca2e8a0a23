"""harness.suites.hf_tests.sdist: the sdist's top-level tests/*.py are cached atomically and safely
(nothing outside the cache is written), and imported as a package with stand-ins for the
mixin modules the sdist lacks."""

from __future__ import annotations

import io
import sys
import tarfile
import unittest
from pathlib import Path

import pytest

from harness.suites.hf_tests import sdist

COMMON = b"""
from .exporters.test_export import ExportTesterMixin
from .generation.test_utils import GenerationTesterMixin


class ModelTesterMixin(ExportTesterMixin):
    pass
"""


def _archive(path: Path, version: str, members: dict[str, bytes], links: tuple = ()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def _downloader(members: dict[str, bytes], calls: list[str], links: tuple = ()):
    def download(version: str, dest: Path) -> Path:
        calls.append(version)
        return _archive(dest / f"transformers-{version}.tar.gz", version, members, links)

    return download


def test_only_top_level_test_files_are_read(tmp_path):
    root = "transformers-9.9.9"
    members = {
        f"{root}/tests/test_modeling_common.py": COMMON,
        f"{root}/tests/utils/test_x.py": b"nested",
        f"{root}/tests/../../evil.py": b"escape",
        f"{root}/src/transformers/x.py": b"source",
        f"{root}/tests/notes.txt": b"text",
    }
    archive = _archive(
        tmp_path / "a.tar.gz", "9.9.9", members, links=((f"{root}/tests/link.py", "/etc/passwd"),)
    )
    assert set(sdist.sdist_test_files(archive, "9.9.9")) == {"test_modeling_common.py"}


def test_an_archive_without_the_mixins_is_refused(tmp_path):
    archive = _archive(tmp_path / "a.tar.gz", "1.0", {"transformers-1.0/tests/x.py": b""})
    with pytest.raises(RuntimeError, match=r"no transformers-1\.0/tests/test_modeling_common\.py"):
        sdist.sdist_test_files(archive, "1.0")


def test_ensure_tests_downloads_once(tmp_path):
    calls: list[str] = []
    members = {"transformers-9.9.9/tests/test_modeling_common.py": COMMON}
    download = _downloader(members, calls)
    first = sdist.ensure_tests("9.9.9", tmp_path, download)
    assert first == tmp_path / "transformers-9.9.9" / "tests"
    assert (first / "test_modeling_common.py").read_bytes() == COMMON
    assert sdist.ensure_tests("9.9.9", tmp_path, download) == first
    assert calls == ["9.9.9"]
    # no scratch folder (archive, staging) is left beside the cache
    assert sorted(p.name for p in first.parent.iterdir()) == ["tests"]


def test_a_failed_download_leaves_no_cache(tmp_path):
    def broken(version: str, dest: Path) -> Path:
        raise RuntimeError("no network")

    with pytest.raises(RuntimeError, match="no network"):
        sdist.ensure_tests("9.9.9", tmp_path, broken)
    assert not (tmp_path / "transformers-9.9.9" / "tests").exists()


def test_cache_root_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(sdist.CACHE_ENV, str(tmp_path))
    assert sdist.cache_root() == tmp_path
    monkeypatch.delenv(sdist.CACHE_ENV)
    assert sdist.cache_root().parts[-2:] == ("fusion-harness", "hf-suite")


def test_import_common_uses_stand_ins_for_absent_mixins(tmp_path, monkeypatch):
    tests_dir = tmp_path / "tests"
    tests_dir.mkdir()
    (tests_dir / "test_modeling_common.py").write_bytes(COMMON)
    package = "hf_sdist_tests_unit"
    for name in [m for m in sys.modules if m.startswith(package)]:
        monkeypatch.delitem(sys.modules, name)
    try:
        common = sdist.import_common(tests_dir, package)
        assert common.__name__ == f"{package}.test_modeling_common"
        assert common.ModelTesterMixin.__mro__[1].__name__ == "ExportTesterMixin"
        assert common.GenerationTesterMixin.__module__ == f"{package}.generation.test_utils"
        assert sdist.import_common(tests_dir, package) is common
        with pytest.raises(ImportError, match="already imported"):
            sdist.import_common(tmp_path, package)
    finally:
        for name in [m for m in sys.modules if m.startswith(package)]:
            del sys.modules[name]


def test_a_real_mixin_module_is_not_replaced(tmp_path):
    tests_dir = tmp_path / "tests"
    (tests_dir / "generation").mkdir(parents=True)
    (tests_dir / "test_modeling_common.py").write_bytes(COMMON)
    (tests_dir / "generation" / "test_utils.py").write_text(
        "class GenerationTesterMixin:\n    real = True\n"
    )
    package = "hf_sdist_tests_real"
    try:
        common = sdist.import_common(tests_dir, package)
        assert common.GenerationTesterMixin.real is True
    finally:
        for name in [m for m in sys.modules if m.startswith(package)]:
            del sys.modules[name]


PARALLEL = b"""
from .distributed_testing_utils import run_distributed


class TensorParallelTesterMixin:
    def launch(self):
        run_distributed(world_size=2)(print)()
"""


def test_import_mixin_stands_in_for_missing_helpers_and_skips_their_callers(tmp_path):
    tests_dir = tmp_path / "tests"
    tests_dir.mkdir()
    (tests_dir / "test_modeling_common.py").write_bytes(COMMON)
    (tests_dir / "test_tensor_parallel_mixin.py").write_bytes(PARALLEL)
    package = "hf_sdist_tests_parallel"
    try:
        mixin = sdist.import_mixin(
            tests_dir, "test_tensor_parallel_mixin", "TensorParallelTesterMixin", package
        )
        assert mixin is not None and mixin.__name__ == "TensorParallelTesterMixin"
        with pytest.raises(unittest.SkipTest, match="multi-process"):
            mixin().launch()
        absent = sdist.import_mixin(tests_dir, "test_fsdp_mixin", "FSDPTesterMixin", package)
        assert absent is None  # an older line's sdist without the module
    finally:
        for name in [m for m in sys.modules if m.startswith(package)]:
            del sys.modules[name]

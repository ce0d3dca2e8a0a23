"""Transformers' common test mixins, from its source distribution, fetched and cached.

The mixins (`ModelTesterMixin` in `tests/test_modeling_common.py`, ...) are not installed
with the wheel; the sdist of the installed version carries the top-level `tests/*.py` files
only (not `tests/models/`, `causal_lm_tester.py`, `generation/test_utils.py` nor
`exporters/test_export.py`). They are fetched at run time with pip (the ordinary registry
client: proxies and index settings apply), never copied into this repository, and cached per
version:

    $FUSION_HF_SUITE_CACHE/transformers-<version>/tests/*.py
    (default ~/.cache/fusion-harness/hf-suite/)

They are imported as the package `hf_sdist_tests` (not `tests`: this repository's own tests
are a package of that name). The two modules the sdist lacks but `test_modeling_common.py`
imports are registered as empty stand-ins (`ABSENT_MIXINS`): their mixins' tests (generation,
torch.export) then contribute no test, and every test of the mixins that are present runs as
Transformers wrote it.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "FUSION_HF_SUITE_CACHE"
PACKAGE = "hf_sdist_tests"
"""The import name of the sdist's `tests/` directory."""

ABSENT_MIXINS: dict[str, str] = {
    "exporters.test_export": "ExportTesterMixin",
    "generation.test_utils": "GenerationTesterMixin",
}
"""Modules `test_modeling_common.py` imports that the sdist does not ship -> the mixin class
each must define. A stand-in is an empty class, only when the module is absent."""

Downloader = Callable[[str, Path], Path]
"""(version, destination folder) -> path of the downloaded `transformers-<version>.tar.gz`."""


def cache_root() -> Path:
    """The cache folder: $FUSION_HF_SUITE_CACHE, else ~/.cache/fusion-harness/hf-suite."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    return Path.home() / ".cache" / "fusion-harness" / "hf-suite"


def pip_download(version: str, dest: Path) -> Path:
    """Download the transformers `version` sdist into `dest` with pip; returns the archive.

    Raises RuntimeError with pip's output when pip fails (no network, unknown version)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"transformers=={version}",
        "-d",
        str(dest),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    archives = sorted(dest.glob(f"transformers-{version}.tar.gz"))
    if not archives:
        raise RuntimeError(
            f"pip could not download the transformers {version} sdist "
            f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return archives[0]


def sdist_test_files(archive: Path, version: str) -> dict[str, bytes]:
    """{file name: content} of the regular `tests/*.py` files at the top of the sdist.

    Only plain names directly under `transformers-<version>/tests/` are read: a member with
    another path, a link or a device is ignored, so the archive cannot write outside the
    cache (it is untrusted until read)."""
    prefix = f"transformers-{version}/tests/"
    found: dict[str, bytes] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            name = member.name
            if not (member.isfile() and name.startswith(prefix) and name.endswith(".py")):
                continue
            base = name[len(prefix) :]
            if "/" in base or base.startswith(".") or not base.isascii():
                continue
            handle = tar.extractfile(member)
            if handle is not None:
                found[base] = handle.read()
    if "test_modeling_common.py" not in found:
        raise RuntimeError(f"{archive} has no {prefix}test_modeling_common.py")
    return found


def ensure_tests(
    version: str, root: Path | None = None, download: Downloader = pip_download
) -> Path:
    """The folder holding the sdist's `tests/*.py` of transformers `version`, fetched once.

    Returns `<root>/transformers-<version>/tests`. Written atomically (a temporary folder
    renamed into place), so a run interrupted mid-download leaves no half cache, and two
    processes filling the cache at once both end with a complete one."""
    root = root if root is not None else cache_root()
    target = root / f"transformers-{version}" / "tests"
    if (target / "test_modeling_common.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        archive = download(version, Path(scratch))
        staged = Path(scratch) / "tests"
        staged.mkdir()
        for name, content in sdist_test_files(archive, version).items():
            (staged / name).write_bytes(content)
        try:
            staged.rename(target)
        except OSError:  # another process won the race: its copy is complete
            if not (target / "test_modeling_common.py").is_file():
                shutil.rmtree(target, ignore_errors=True)
                staged.rename(target)
    return target


def _stand_in(package: str, dotted: str, mixin: str) -> None:
    """Register an empty `mixin` class as module `<package>.<dotted>` (and its parents)."""
    parts = dotted.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join([package, *parts[:depth]])
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = []  # a package: its submodules are stand-ins too
            sys.modules[name] = module
    doc = f"Stand-in: the sdist does not ship {dotted}; this mixin adds no test."
    attrs = {"__module__": f"{package}.{dotted}", "__doc__": doc}
    setattr(sys.modules[f"{package}.{dotted}"], mixin, type(mixin, (), attrs))


def import_common(tests_dir: Path, package: str = PACKAGE) -> types.ModuleType:
    """Import `test_modeling_common` from `tests_dir` as `<package>.test_modeling_common`.

    Returns the module. The modules of ABSENT_MIXINS are stand-ins unless `tests_dir` holds
    them (a full Transformers checkout does; its real mixins are then used). Importing twice
    returns the same module."""
    existing = sys.modules.get(package)
    if existing is None:
        module = types.ModuleType(package)
        module.__path__ = [str(tests_dir)]
        sys.modules[package] = module
    elif list(getattr(existing, "__path__", [])) != [str(tests_dir)]:
        raise ImportError(f"{package} is already imported from {existing.__path__}")
    for dotted, mixin in ABSENT_MIXINS.items():
        if not (tests_dir / (dotted.replace(".", "/") + ".py")).is_file():
            _stand_in(package, dotted, mixin)
    return importlib.import_module(f"{package}.test_modeling_common")


HELPER_STAND_INS: dict[str, str] = {"distributed_testing_utils": "run_distributed"}
"""Helper modules a present mixin module imports that the sdist does not ship -> the
function each must define. The stand-in skips the test that calls it, with the reason: it
launches the multi-process runs (`torch.distributed` workers) the sdist does not carry."""


def _stand_in_helper(package: str, module: str, function: str) -> None:
    name = f"{package}.{module}"

    def missing(*args: object, **kwargs: object) -> None:
        raise unittest.SkipTest(
            f"needs {module}.{function} (multi-process workers), which the sdist does not ship"
        )

    stand_in = types.ModuleType(name)
    setattr(stand_in, function, missing)
    sys.modules[name] = stand_in


def import_mixin(tests_dir: Path, module: str, mixin: str, package: str = PACKAGE) -> type | None:
    """Mixin class `mixin` of the sdist's `tests/<module>.py` (`import_common` first), or
    None when this sdist has no such module (an older line). Helpers it imports that the
    sdist lacks are HELPER_STAND_INS."""
    import_common(tests_dir, package)
    if not (tests_dir / f"{module}.py").is_file():
        return None
    for helper, function in HELPER_STAND_INS.items():
        if not (tests_dir / f"{helper}.py").is_file() and f"{package}.{helper}" not in sys.modules:
            _stand_in_helper(package, helper, function)
    return getattr(importlib.import_module(f"{package}.{module}"), mixin, None)


def installed_version() -> str:
    """The installed transformers version (the sdist must match the code under test)."""
    import transformers

    return transformers.__version__

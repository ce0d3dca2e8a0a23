"""Fixtures shared by the fusion tests."""

from __future__ import annotations

import importlib.util
import itertools
import linecache
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from fusion.fusers import registry

_LOADED = itertools.count()


@pytest.fixture
def load(tmp_path: Path) -> Iterator[Callable[[str], ModuleType]]:
    """Write a source to a file, import it (fusion reads forwards with `inspect.getsource`),
    and forget it (and fusion's per-class cache) afterwards."""
    loaded: list[tuple[str, Path]] = []

    def _load(text: str) -> ModuleType:
        name = f"fusion_test_case_{next(_LOADED)}"
        path = tmp_path / f"{name}.py"
        path.write_text(text, encoding="utf-8")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        loaded.append((name, path))
        return module

    registry.clear_cache()
    yield _load
    for name, path in loaded:
        sys.modules.pop(name, None)
        linecache.cache.pop(str(path), None)
    registry.clear_cache()

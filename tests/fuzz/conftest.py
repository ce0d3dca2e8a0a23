"""Fixtures for the fusion fuzzer, and its tally plugin (see tests/fuzz/plugin.py).

Hypothesis profiles live in tests/fuzz/profiles.py (`FUZZ_PROFILE`), next to, not in place
of, the suite-wide ones in tests/conftest.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fuzz.profiles import REPO

PLUGIN = "tests.fuzz.plugin"
REPRO_ENV = "FUZZ_REPRO_DIR"


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(PLUGIN):
        config.pluginmanager.import_plugin(PLUGIN)


@pytest.fixture(scope="session")
def generated_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where generated modules are written and imported from (one file per example,
    removed after it)."""
    # Standalone attention modules make Transformers warn on every interface lookup.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield tmp_path_factory.mktemp("fuzz_generated")


@pytest.fixture(scope="session")
def repro_dir() -> Path:
    """Where a failing property writes its repro bundle (`FUZZ_REPRO_DIR`, default
    repro-bundles/fuzz/ in the checkout, which git ignores)."""
    return Path(os.environ.get(REPRO_ENV) or REPO / "repro-bundles" / "fuzz")

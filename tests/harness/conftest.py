"""Shared fixtures of the harness tests: a tiny llama from the corpus and its inputs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import corpus
from harness.runner.arch_check import CheckOptions, make_inputs


@pytest.fixture(scope="package", autouse=True)
def _single_thread(one_thread) -> None:
    """Every test of this package runs on one intra-op thread (tests/conftest.py)."""


@pytest.fixture
def options() -> CheckOptions:
    return CheckOptions()


@pytest.fixture
def llama(options):
    return corpus.build("llama", seed=options.seed, dtype=torch.float32, device="cpu")


@pytest.fixture
def llama_inputs(llama, options):
    return make_inputs(llama, options)


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing can be created in, whoever runs the tests.

    A read-only (0o555) temporary directory for an ordinary user; root ignores permission
    bits, so for root /sys is used: the kernel refuses new files there for everyone.
    """
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    path = Path("/sys")
    try:
        (path / "fusion-harness-probe").mkdir()
    except OSError:
        yield path
        return
    (path / "fusion-harness-probe").rmdir()
    pytest.skip("no unwritable directory on this machine (root, and /sys accepts new entries)")

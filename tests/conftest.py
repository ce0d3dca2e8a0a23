"""Hypothesis settings profiles for the whole test suite.

Select one with `HYPOTHESIS_PROFILE=<name>` (default "ci"). Profiles are process-wide, so
they live here rather than next to one package's tests.

- "ci": derandomized (the same examples on every run and machine: CI is never flaky), no
  example database, 1000 examples per property unless a test sets its own count.
- "slow": randomized, 20x more examples; a soak run after changing an analysis, e.g.
  `HYPOTHESIS_PROFILE=slow python -m pytest tests/fusion/test_alias.py`.
- "dev": a quick randomized smoke run while editing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=1000,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "slow",
    max_examples=20_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="package")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one intra-op thread (as the sweep's workers do, and as
    xdist supplies the parallelism); packages that time or sweep models use it autouse."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

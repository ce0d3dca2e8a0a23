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

"""Hypothesis settings for the fusion fuzzer, chosen with `FUZZ_PROFILE` (default fuzz-ci).

They are separate from the suite-wide `HYPOTHESIS_PROFILE` profiles of tests/conftest.py
because one fuzzer example (write, import, trace, fuse, two forwards) costs about as much
as a hundred alias-analysis examples, so its counts are set here. `FUZZ_EXAMPLES=<n>`
overrides the number of examples per property of any profile.

- fuzz-ci: derandomized (the same examples on every run and machine, so CI is never
  flaky), no database, CI_EXAMPLES examples per generated shape.
- fuzz: randomized, 10 000 examples per shape, and an example database in
  `.hypothesis/fuzz/` (git-ignored): a failure found once is replayed first on every later
  run until it is fixed. The `fuzz` tox environment.
- fuzz-dev: randomized, 30 examples per shape: a smoke run while editing a generator.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

REPO = Path(__file__).resolve().parents[2]
DATABASE_DIR = REPO / ".hypothesis" / "fuzz"
CI_EXAMPLES = 50
"""Per property and generated shape: test_fuse_is_safe's five shapes (250 examples),
test_post_fuse_edit_is_safe's (250, one post-fuse edit each) and test_gate_strategy's gate
programs (50). CI's smoke of the generators; the search itself is
the `fuzz` profile (`tox -e fuzz`, 10 000 per shape). Measured on a 2-core AMD EPYC (AVX2)
shared with other work, one process (`-p no:xdist`): test_fuse_is_safe 35-96 s for the five
shapes, test_gate_programs_are_refused_or_exact 28-63 s (load average 2.5 to 5); 150 examples
took 354 s and 173 s at load average 4, 80 took 132 s and 106 s at 5 (the cost is not
linear in the count)."""

# Every setting that matters is spelled out: a profile registered here inherits the rest
# from whichever profile tests/conftest.py loaded (its "ci" is derandomized).
_COMMON = {
    "deadline": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

settings.register_profile(
    "fuzz-ci", max_examples=CI_EXAMPLES, derandomize=True, database=None, **_COMMON
)
settings.register_profile(
    "fuzz",
    max_examples=10_000,
    derandomize=False,
    database=DirectoryBasedExampleDatabase(str(DATABASE_DIR)),
    **_COMMON,
)
settings.register_profile("fuzz-dev", max_examples=30, derandomize=False, database=None, **_COMMON)

PROFILE = os.environ.get("FUZZ_PROFILE", "fuzz-ci")
FUZZ_SETTINGS = settings.get_profile(PROFILE)
if os.environ.get("FUZZ_EXAMPLES"):
    FUZZ_SETTINGS = settings(FUZZ_SETTINGS, max_examples=int(os.environ["FUZZ_EXAMPLES"]))
"""The settings every fuzz property runs under."""

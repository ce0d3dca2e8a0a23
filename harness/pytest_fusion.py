"""`-p harness.pytest_fusion`: the public name of the pytest plugin in `harness.suites.pytest_plugin`.

pytest loads hooks from the module it is given, so this module re-exports the plugin's hooks,
options and helpers; the code and its documentation live in `harness.suites.pytest_plugin`.
`python -m harness.pytest_fusion BASE FUSED` runs its comparison.
"""

from __future__ import annotations

import sys

from harness.suites.pytest_plugin import (
    cause_of,
    compare,
    fold,
    main,
    pytest_addoption,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_unconfigure,
)

__all__ = [
    "cause_of",
    "compare",
    "fold",
    "main",
    "pytest_addoption",
    "pytest_configure",
    "pytest_runtest_logreport",
    "pytest_runtest_makereport",
    "pytest_runtest_protocol",
    "pytest_unconfigure",
]

if __name__ == "__main__":
    sys.exit(main())

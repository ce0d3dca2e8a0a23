"""Settings of the conformance suite (the corpus as pytest parameters).

Environment: FUSION_HARNESS_DTYPE (float32), FUSION_HARNESS_DEVICE (cpu), FUSION_HARNESS_SEED
(0) and FUSION_HARNESS_LIFECYCLE (full: every lifecycle operation, torch.compile on
harness.lifecycle.COMPILE_SELECTION) choose how every architecture is checked;
FUSION_HARNESS_REPRO_DIR, when set, is where repro bundles of failures are written (a pytest
temporary directory otherwise); FUSION_HARNESS_STRICT_CORPUS=1 fails an architecture whose
unfused model does not build or run (an expected failure otherwise: not fusion's).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.check import CheckOptions


@pytest.fixture(scope="package", autouse=True)
def _single_thread(one_thread) -> None:
    """Every test of this package runs on one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def check_options() -> CheckOptions:
    return CheckOptions(
        dtype=os.environ.get("FUSION_HARNESS_DTYPE", "float32"),
        device=os.environ.get("FUSION_HARNESS_DEVICE", "cpu"),
        seed=int(os.environ.get("FUSION_HARNESS_SEED", "0")),
        lifecycle=os.environ.get("FUSION_HARNESS_LIFECYCLE", "full"),
    )


@pytest.fixture(scope="session")
def strict_corpus() -> bool:
    """Do corpus problems fail the suite (FUSION_HARNESS_STRICT_CORPUS=1)?"""
    return os.environ.get("FUSION_HARNESS_STRICT_CORPUS", "") not in ("", "0")


@pytest.fixture(scope="session")
def repro_dir(tmp_path_factory) -> Path:
    configured = os.environ.get("FUSION_HARNESS_REPRO_DIR")
    return Path(configured) if configured else tmp_path_factory.mktemp("repro")


def pytest_report_header(config):
    from harness import plans

    path = plans.golden_path()
    state = "" if path.exists() else " (missing: run `fusion-harness run --update-expected`)"
    return f"golden fusion plans: {path}{state}"

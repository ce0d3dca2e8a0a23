"""Settings of the conformance suite (the corpus as pytest parameters).

Environment: FUSION_HARNESS_DTYPE (float32), FUSION_HARNESS_DEVICE (cpu), FUSION_HARNESS_SEED
(0) and FUSION_HARNESS_LIFECYCLE (full: every lifecycle operation, torch.compile on
harness.oracles.lifecycle.COMPILE_SELECTION) choose how every architecture is checked;
FUSION_HARNESS_REPRO_DIR, when set, is where repro bundles of failures are written (a pytest
temporary directory otherwise); FUSION_HARNESS_STRICT_CORPUS=1 fails an architecture whose
unfused model does not build or run (an expected failure otherwise: not fusion's).

`--shard K/N` (and `--shard-balance RESULTS.jsonl`) keeps shard K of N: the corpus
architectures `fusion-harness run --shard K/N` would check (harness.runner.shard's partition of the
same names), the known-unbuildable ones partitioned the same way, and the whole-suite tests
in shard 1 only, so N shards run every test exactly once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.base.results import ResultsError, read_results
from harness.runner import shard
from harness.runner.arch_check import CheckOptions

HERE = Path(__file__).parent


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
    from harness.reporting import plans

    path = plans.golden_path()
    state = "" if path.exists() else " (missing: run `fusion-harness run --update-expected`)"
    return f"golden fusion plans: {path}{state}"


def _shard_option(config: pytest.Config) -> tuple[shard.Shard, dict[str, float] | None] | None:
    """(the shard, recorded durations or None) asked for with --shard, or None."""
    text = config.getoption("--shard")
    balance = config.getoption("--shard-balance")
    if text is None:
        if balance is not None:
            raise pytest.UsageError("--shard-balance balances shards; it needs --shard K/N")
        return None
    try:
        part = shard.Shard.parse(text)
        durations = shard.durations_of(read_results(Path(balance))) if balance else None
    except (shard.ShardError, ResultsError, OSError) as exc:
        raise pytest.UsageError(str(exc)) from exc
    return part, durations


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep this package's items of the --shard asked for (other packages' items untouched)."""
    asked = _shard_option(config)
    if asked is None:
        return
    part, durations = asked
    ours = [item for item in items if HERE in item.path.parents]
    by_test: dict[str, list[str]] = {}
    for item in ours:
        arch = getattr(item, "callspec", None) and item.callspec.params.get("arch")
        if arch is not None:
            by_test.setdefault(item.originalname, []).append(arch)
    mine = {test: set(shard.pick(names, part, durations)) for test, names in by_test.items()}
    kept, dropped = [], []
    for item in items:
        if HERE not in item.path.parents:
            kept.append(item)
            continue
        arch = getattr(item, "callspec", None) and item.callspec.params.get("arch")
        keep = part.index == 1 if arch is None else arch in mine[item.originalname]
        (kept if keep else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

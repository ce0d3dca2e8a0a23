"""`--shard K/N` of the conformance suite (tests/conformance/conftest.py): N shards collect
disjoint sets of tests whose union is the whole suite, split as `fusion-harness run --shard`
splits the corpus."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.base import architectures
from harness.runner import shard

REPO = Path(__file__).resolve().parents[2]


def _collect(*args: str) -> subprocess.CompletedProcess[str]:
    """`pytest tests/conformance --collect-only ARGS` in a subprocess (collection options
    are read once per session)."""
    quiet = ("--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/conformance", *quiet, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _collected(*args: str) -> list[str]:
    """The test ids `_collect(*args)` selects."""
    done = _collect(*args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_shards_partition_the_suite_as_the_sweep_does() -> None:
    whole = _collected()
    shards = [_collected("--shard", f"{k}/3") for k in (1, 2, 3)]
    assert sorted(itertools.chain(*shards)) == sorted(whole)  # disjoint and covering
    assert all(shards)
    for k, ids in enumerate(shards, start=1):
        checked = {i.split("[", 1)[1][:-1] for i in ids if "::test_architecture[" in i}
        assert checked == set(shard.pick(architectures.available(), shard.Shard(k, 3)))
        whole_suite = [i for i in ids if "[" not in i]
        assert bool(whole_suite) == (k == 1)


def test_a_bad_shard_is_a_usage_error() -> None:
    done = _collect("--shard", "4/3")
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert "K must be between 1 and N" in done.stderr

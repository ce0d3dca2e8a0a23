"""`python -m harness.suites.hf_tests`: Transformers' common tests unfused, then fused, compared.

Runs `tests/hf_suite/hf_mixins.py` twice in subprocesses under the `harness.suites.pytest_plugin`
plugin (once plain, once with `--fusion`), each writing its outcomes file, and prints the
tests that pass unfused and fail fused, grouped by cause, split into listed exceptions
(`harness.suites.hf_tests.exceptions`, with their reasons) and unexpected ones. Exit status 1 when
any unexpected test broke (or a run crashed before writing outcomes), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness.suites import pytest_plugin
from harness.suites.hf_tests import exceptions

REPO = Path(__file__).resolve().parents[3]
SUITE = REPO / "tests" / "hf_suite" / "hf_mixins.py"
ARCHS_ENV = "FUSION_HF_SUITE_ARCHS"


@dataclass
class Comparison:
    """What one base/fused pair of outcome files says, per architecture test class."""

    passed_unfused: Counter[str] = field(default_factory=Counter)
    broken: dict[str, list[str]] = field(default_factory=dict)  # cause -> unexpected tests
    excepted: dict[str, list[str]] = field(default_factory=dict)  # reason -> listed tests
    broken_per_class: Counter[str] = field(default_factory=Counter)

    @property
    def unexpected(self) -> int:
        return sum(len(tests) for tests in self.broken.values())


def test_class(test_id: str) -> str:
    """The TestCase name of a pytest node id (`path::Class::test` -> `Class`)."""
    parts = test_id.split("::")
    return parts[-2] if len(parts) >= 3 else parts[0]


def compare(base: dict[str, dict], fused: dict[str, dict]) -> Comparison:
    """Split what fusion broke into listed exceptions and unexpected failures (by cause).

    Returns the Comparison; counts of tests passing unfused are per test class, so a
    table per architecture follows from it."""
    result = Comparison()
    for test, outcome in base.items():
        if outcome["outcome"] == "passed":
            result.passed_unfused[test_class(test)] += 1
    for cause, tests in pytest_plugin.compare(base, fused).items():
        for test in tests:
            result.broken_per_class[test_class(test)] += 1
            why = exceptions.reason(test)
            if why is None:
                result.broken.setdefault(cause, []).append(test)
            else:
                result.excepted.setdefault(why, []).append(test)
    return result


def report(result: Comparison) -> str:
    """The comparison in words: a per-class table, then unexpected and listed breaks."""
    lines = ["test class                          passed unfused  broken fused"]
    for name, passed in sorted(result.passed_unfused.items()):
        lines.append(f"{name:<36}{passed:>14}{result.broken_per_class[name]:>14}")
    lines.append("")
    lines.append(f"{result.unexpected} unexpected tests fail only fused")
    for cause, tests in result.broken.items():
        lines.append(f"\n{len(tests)} x {cause}")
        lines.extend(f"    {test}" for test in tests)
    listed = sum(len(t) for t in result.excepted.values())
    lines.append(f"\n{listed} listed exceptions (harness/suites/hf_tests/exceptions.py)")
    for why, tests in result.excepted.items():
        lines.append(f"\n{len(tests)} x {why}")
        lines.extend(f"    {test}" for test in tests)
    return "\n".join(lines)


def run_suite(
    archs: list[str], outcomes: Path, fused: bool, extra: list[str]
) -> subprocess.CompletedProcess:
    """Run the suite for `archs` once (fused or not) in a subprocess; returns its result."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "harness.pytest_fusion",
        "--fusion-outcomes",
        str(outcomes),
        *(["--fusion"] if fused else []),
        *extra,
        str(SUITE),
    ]
    # An outer pytest's worker variables would mislead the inner run's plugins.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))
    }
    env[ARCHS_ENV] = ",".join(archs)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)


def _load(path: Path) -> dict[str, dict]:
    return {
        json.loads(line)["test"]: json.loads(line)
        for line in path.read_text(encoding="utf-8").splitlines()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.suites.hf_tests",
        description="Transformers' common model tests on corpus architectures, unfused and "
        "fused; prints what fusion broke, by cause. Arguments after -- go to pytest.",
    )
    parser.add_argument("--arch", action="append", required=True, help="corpus architecture")
    parser.add_argument("--out", type=Path, default=Path("hf-suite"), help="outcome files")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    files = {}
    for fused in (False, True):
        path = args.out / ("fused.jsonl" if fused else "base.jsonl")
        done = run_suite(args.arch, path, fused, extra)
        tail = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
        print(f"{'fused' if fused else 'unfused'}: {tail[0]}", flush=True)
        if not path.is_file():
            print(done.stdout[-4000:] + done.stderr[-4000:], file=sys.stderr)
            return 1
        files[fused] = path
    result = compare(_load(files[False]), _load(files[True]))
    print(report(result))
    return 1 if result.unexpected else 0

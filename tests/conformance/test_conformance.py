"""The corpus as pytest parameters: one test per causal-LM architecture.

Each test runs `harness.runner.arch_check.check_architecture`, the very function the sweep's workers run,
and judges it with `harness.reporting.summary.exit_status`, the rule that sets the sweep's exit status.
Architectures the corpus cannot build (or run) are tests too: each must carry a reason and must
still fail (a fixed one has to come back into the corpus). Runs under pytest-xdist:
`pytest -m conformance -n auto`.

An architecture whose unfused model does not build or run (build-error, forward-error: a
corpus problem, harness.base.results.CORPUS_PROBLEMS) is an expected failure with its reason, so
the suite fails only on fusion failures, as `fusion-harness run` exits 3 for those and 1 only
for fusion failures; FUSION_HARNESS_STRICT_CORPUS=1 makes them fail (`--strict-corpus`).

Plan conformance (docs/design.md, oracle 3): each architecture's fusion plan is compared with the
golden file of the installed Transformers line, corpus/expected/<major.minor>.json
(harness.reporting.plans). Any difference fails the test with the difference in words: a fusion that
disappeared, a new refusal, a new fusion (to be reviewed), another status. A golden file may
record a model-side break of its line (build or forward error, inconclusive reference) with the
reason: that architecture is then an expected failure. A fusion failure never is. A missing
golden file fails `test_golden_plan_exists`; `fusion-harness run --update-expected` writes it.
"""

from __future__ import annotations

import warnings

import pytest

import corpus
from harness.base import architectures
from harness.reporting import plans, summary
from harness.runner import repro
from harness.runner.arch_check import check_architecture

BUILDABLE = architectures.available()
UNBUILDABLE = architectures.unbuildable()
GOLDEN_PATH = plans.golden_path()
try:
    GOLDEN: plans.Golden | None = plans.load(GOLDEN_PATH)
    GOLDEN_ERROR = ""
except plans.PlanError as exc:
    GOLDEN, GOLDEN_ERROR = None, str(exc)

pytestmark = pytest.mark.conformance


class InconclusiveParity(UserWarning):
    """Nothing failed, but the oracle could not judge part of the model (see the message)."""


def _explain(result) -> str:
    lines = [f"{result.architecture}: {result.status}: {result.message}"]
    lines += [
        f"  {f.kind} at {f.qualname or 'model'} [{f.fuser}]: {f.message}" for f in result.failures
    ]
    lines += [f"  repro bundle: {f.bundle}" for f in result.failures if f.bundle]
    return "\n".join(lines)


@pytest.fixture(scope="session")
def golden(check_options) -> plans.Golden | None:
    """The golden plans to compare with; None when there is no usable golden file (that fails
    test_golden_plan_exists) or it was recorded under other options (FUSION_HARNESS_DTYPE...):
    plans are then not compared."""
    if GOLDEN is None or not plans.matches_options(GOLDEN, check_options):
        return None
    return GOLDEN


def _plan_diff(arch: str, golden: plans.Golden | None, actual: dict, details=None) -> str:
    if golden is None:
        return ""
    lines = plans.diff_entry(golden.architectures.get(arch), actual, details)
    return plans.format_diff(arch, lines, path=golden.path) if lines else ""


@pytest.mark.parametrize("arch", BUILDABLE)
def test_architecture(arch, check_options, repro_dir, golden, strict_corpus):
    checked = check_architecture(arch, check_options)
    result = checked.result
    if result.failures and checked.subject is not None:
        result = repro.write_bundles(result, checked.subject, repro_dir)
    healthy = result.ran and summary.exit_status([result]) == 0
    diff = _plan_diff(arch, golden, plans.entry_of(result), plans.details_of(result))
    if result.corpus_problem and not strict_corpus:
        # The unfused model does not build or run: nothing fusion did is judged, so only a
        # fusion failure fails the suite (as `run` exits 3, not 1); asked, it fails.
        pytest.xfail(
            "corpus problem, not a fusion failure (FUSION_HARNESS_STRICT_CORPUS=1 fails it): "
            + _explain(result)
            + (f"\n{diff}" if diff else "")
        )
    if diff:
        pytest.fail(diff if healthy else f"{diff}\n{_explain(result)}", pytrace=False)
    if not healthy:
        recorded = golden.architectures[arch] if golden else None
        if recorded and plans.accepted(recorded):
            pytest.xfail(f"recorded in {golden.path.name}: {recorded['reason']}")
        pytest.fail(_explain(result), pytrace=False)
    if result.status == "inconclusive":
        warnings.warn(InconclusiveParity(_explain(result)), stacklevel=1)


@pytest.mark.parametrize("arch", sorted(UNBUILDABLE))
def test_known_unbuildable(arch, check_options, golden):
    reason = UNBUILDABLE[arch]
    assert reason.strip() and reason != "(no reason recorded)", f"{arch}: no reason recorded"
    diff = _plan_diff(arch, golden, plans.unbuildable_entry(reason))
    if diff:
        pytest.fail(diff, pytrace=False)
    result = check_architecture(arch, check_options).result
    if result.ran:
        pytest.fail(f"{arch} is listed as unbuildable ({reason}) but runs: return it to the corpus")
    pytest.xfail(f"known unbuildable: {reason}")


def test_every_causal_lm_is_either_checked_or_known_unbuildable():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    everything = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert not set(BUILDABLE) & set(UNBUILDABLE)
    missing = everything - set(BUILDABLE) - set(UNBUILDABLE)
    assert not missing, f"causal LMs neither in the corpus nor known unbuildable: {sorted(missing)}"
    assert set(corpus.architectures()) == set(BUILDABLE)


def test_golden_plan_exists():
    """The installed Transformers line has a readable golden file (a missing one fails)."""
    if GOLDEN is None:
        pytest.fail(GOLDEN_ERROR, pytrace=False)
    assert GOLDEN.line == plans.transformers_line()


def test_golden_plan_covers_the_corpus(golden):
    if golden is None:
        pytest.skip("no golden plan to compare under these options (see test_golden_plan_exists)")
    known = set(BUILDABLE) | set(UNBUILDABLE)
    new = sorted(known - set(golden.architectures))
    gone = sorted(set(golden.architectures) - known)
    problems = []
    if new:
        problems.append(f"in the corpus, not in the golden plan: {', '.join(new)}")
    if gone:
        problems.append(f"in the golden plan, no longer in the corpus: {', '.join(gone)}")
    if problems:
        pytest.fail(
            f"{golden.path} does not cover this corpus:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + f"\n  (review, then `{plans.UPDATE_HINT}`)",
            pytrace=False,
        )

"""The corpus as pytest parameters: one test per causal-LM architecture.

Each test runs `harness.check.check_architecture`, the very function the sweep's workers run,
and judges it with `harness.summary.exit_status`, the rule that sets the sweep's exit status.
Architectures the corpus cannot build (or run) are tests too: each must carry a reason and must
still fail (a fixed one has to come back into the corpus). Runs under pytest-xdist:
`pytest -m conformance -n auto`.
"""

from __future__ import annotations

import warnings

import pytest

import corpus
from harness import architectures, repro, summary
from harness.check import check_architecture

BUILDABLE = architectures.available()
UNBUILDABLE = architectures.unbuildable()

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


@pytest.mark.parametrize("arch", BUILDABLE)
def test_architecture(arch, check_options, repro_dir):
    checked = check_architecture(arch, check_options)
    result = checked.result
    if result.failures and checked.subject is not None:
        result = repro.write_bundles(result, checked.subject, repro_dir)
    assert result.built, _explain(result)
    assert result.status != "fuse-error", _explain(result)
    assert result.ran, _explain(result)
    assert summary.exit_status([result]) == 0, _explain(result)
    if result.status == "inconclusive":
        warnings.warn(InconclusiveParity(_explain(result)), stacklevel=1)


@pytest.mark.parametrize("arch", sorted(UNBUILDABLE))
def test_known_unbuildable(arch, check_options):
    reason = UNBUILDABLE[arch]
    assert reason.strip() and reason != "(no reason recorded)", f"{arch}: no reason recorded"
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

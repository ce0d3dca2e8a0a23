"""fusion.numerics: the one error measure (and its NaN rule) and the tolerance rule, shared by
the harness's parity oracle, the fusers' self-checks and the tests (the rule's own cases are
in tests/harness/oracles/test_parity.py, through the harness's names)."""

from __future__ import annotations

import math

import pytest
import torch

from fusion import numerics


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_output_never_passes_a_fixed_limit(bad: float) -> None:
    reference = torch.tensor([1.0, 2.0, 3.0])
    error = numerics.relative_error(torch.tensor([1.0, bad, 3.0]), reference)
    assert math.isnan(error)
    assert not error <= 1e30  # how a fuser's self-check asks it


def test_a_nan_in_the_reference_is_never_matched() -> None:
    reference = torch.tensor([math.nan, 1.0])
    assert numerics.relative_error(torch.tensor([0.0, 1.0]), reference) == math.inf
    assert math.isnan(numerics.relative_error(reference.clone(), reference))


def test_the_error_is_max_normalised_in_float64() -> None:
    reference = torch.tensor([1.0, -4.0], dtype=torch.float32)
    actual = torch.tensor([1.5, -4.0], dtype=torch.bfloat16)
    assert numerics.relative_error(actual, reference) == pytest.approx(0.125)


def test_matching_nans_compares_nan_as_a_value() -> None:
    reference = torch.tensor([1.0, float("nan"), 2.0])
    same = torch.tensor([1.0, float("nan"), 2.5])
    moved = torch.tensor([float("nan"), 1.0, 2.0])
    assert numerics.relative_error(same, reference, matching_nans=True) == 0.25
    assert numerics.relative_error(moved, reference, matching_nans=True) == math.inf
    # Without it a NaN in the output is never an error size (the parity oracle's rule).
    assert math.isnan(numerics.relative_error(same, reference))


def test_self_check_passes_rounding_only_and_never_nan() -> None:
    assert numerics.self_check_passes(5e-5, torch.float32)
    assert not numerics.self_check_passes(1e-3, torch.float32)
    assert numerics.self_check_passes(1e-2, torch.bfloat16)
    assert not numerics.self_check_passes(math.nan, torch.bfloat16)

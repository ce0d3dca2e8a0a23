"""harness.oracles.parity: the tolerance rule, the error measure, masking, NaN handling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.oracles import parity

F32 = torch.float32


# --- the rule --------------------------------------------------------------------------------


def test_floor_applies_when_unfused_is_exact():
    assert parity.tolerance(0.0, F32) == 1e-6
    assert parity.judge(1e-6, 0.0, F32).passed
    assert not parity.judge(1.01e-6, 0.0, F32).passed


def test_multiple_of_unfused_error_applies_above_the_floor():
    verdict = parity.judge(2e-3, 1e-3, F32)
    assert verdict.passed and verdict.tolerance == pytest.approx(2e-3)
    failed = parity.judge(2.001e-3, 1e-3, F32)
    assert failed.status == "fail"
    assert "exceeds tolerance" in failed.reason


@pytest.mark.parametrize(
    ("dtype", "floor"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-3), (torch.float16, 5e-4)]
)
def test_dtype_floors(dtype, floor):
    assert parity.dtype_floor(dtype) == floor


def test_unknown_dtype_has_no_floor():
    with pytest.raises(ValueError, match="no parity floor"):
        parity.dtype_floor(torch.int8)


def test_nan_fused_fails_even_with_infinite_tolerance():
    verdict = parity.judge(math.nan, 1e-3, F32)
    assert verdict.status == "fail"
    assert "not finite" in verdict.reason


def test_nan_in_both_is_inconclusive_not_pass():
    assert parity.judge(math.nan, math.nan, F32).status == "inconclusive"


def test_nan_unfused_is_inconclusive():
    assert parity.judge(1e-7, math.nan, F32).status == "inconclusive"


# --- the error measure -----------------------------------------------------------------------


def test_relative_error_is_max_normalised():
    ref = torch.tensor([[1.0, -4.0, 0.0]])
    out = torch.tensor([[1.0, -4.0, 0.2]])
    assert parity.relative_error(out, ref) == pytest.approx(0.2 / 4.0)


def test_relative_error_of_zero_reference_is_absolute():
    assert parity.relative_error(torch.tensor([0.5]), torch.zeros(1)) == pytest.approx(0.5)


def test_relative_error_nan_and_inf_where_reference_is_finite_are_nan():
    ref = torch.ones(2, 3)
    assert math.isnan(parity.relative_error(torch.tensor([[1, 1, math.nan]] * 2), ref))
    assert math.isnan(parity.relative_error(torch.tensor([[1, 1, math.inf]] * 2), ref))


def test_reference_infinities_must_be_matched_exactly():
    ref = torch.tensor([[0.0, -math.inf, 1.0]], dtype=torch.float64)
    same = torch.tensor([[0.0, -math.inf, 1.0]])
    assert parity.relative_error(same, ref) == 0.0
    finite_instead = torch.tensor([[0.0, -1e9, 1.0]])
    assert parity.relative_error(finite_instead, ref) == math.inf


def test_shape_mismatch_raises_and_fails_compare():
    with pytest.raises(ValueError, match="shape"):
        parity.relative_error(torch.ones(2), torch.ones(3))
    verdict = parity.compare(torch.ones(2), torch.ones(3), torch.ones(3), dtype=F32)
    assert verdict.status == "fail" and "shape" in verdict.reason


# --- masking ---------------------------------------------------------------------------------


def _mask() -> torch.Tensor:
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # right padding on row 1, as corpus.make_inputs does
    return parity.token_mask(mask)


def test_padded_positions_are_not_compared():
    ref = torch.rand(2, 6, 5, dtype=torch.float64) + 1
    out = ref.float().clone()
    out[1, 4:] = math.nan  # garbage at padded positions is allowed
    assert parity.compare(out, ref.float(), ref, dtype=F32, mask=_mask()).passed
    out[1, 3, 0] = math.nan  # but not at a real token
    assert parity.compare(out, ref.float(), ref, dtype=F32, mask=_mask()).status == "fail"


def test_flattened_tokens_are_masked_too():
    ref = torch.rand(12, 5, dtype=torch.float64) + 1
    out = ref.float().clone()
    out[11] = 1e6  # row 1, position 5: padded
    assert parity.relative_error(out, ref, _mask()) < 1e-6


def test_other_shapes_are_compared_whole():
    ref = torch.rand(3, 7, dtype=torch.float64)
    out = ref.clone()
    out[2, 6] += 1
    assert parity.relative_error(out, ref, _mask()) > 0.1


def test_token_mask_needs_a_2d_mask():
    assert parity.token_mask(None) is None
    assert parity.token_mask(torch.ones(2, 1, 6, 6)) is None


def test_nan_reference_is_inconclusive():
    ref = torch.tensor([[1.0, math.nan]], dtype=torch.float64)
    verdict = parity.compare(torch.ones(1, 2), torch.ones(1, 2), ref, dtype=F32)
    assert verdict.status == "inconclusive"


# --- structured outputs ----------------------------------------------------------------------


def test_flatten_tensors_walks_tuples_and_mappings_and_drops_non_floats():
    a, b = torch.ones(1), torch.zeros(2)
    out = (a, None, {"x": b, "ids": torch.tensor([1, 2])}, [a])
    assert [t.shape for t in parity.flatten_tensors(out)] == [a.shape, b.shape, a.shape]


def test_compare_outputs_structure_mismatch_fails():
    verdict = parity.compare_outputs(
        (torch.ones(1),), (torch.ones(1), torch.ones(1)), (torch.ones(1),), dtype=F32
    )
    assert verdict.status == "fail" and "structure" in verdict.reason


def test_compare_outputs_reports_the_worst_tensor():
    ref = (torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    good = torch.ones(4)
    bad = torch.tensor([1.0, 1.0, 1.0, 1.5])
    verdict = parity.compare_outputs((good, bad), (good, good), ref, dtype=F32)
    assert verdict.status == "fail"
    assert verdict.fused_error == pytest.approx(0.5)


def test_worst_orders_fail_over_inconclusive_over_pass_and_nan_first():
    p = parity.Verdict("pass", 1e-7, 1e-7, 1e-6)
    i = parity.Verdict("inconclusive", math.nan, math.nan, math.inf, "x")
    f = parity.Verdict("fail", 1.0, 0.0, 1e-6, "y")
    fnan = parity.Verdict("fail", math.nan, 0.0, 1e-6, "z")
    assert parity.worst([p, i]) is i
    assert parity.worst([p, f, i]) is f
    assert parity.worst([f, fnan]) is fnan
    assert parity.worst([]).passed


# --- properties ------------------------------------------------------------------------------

_shapes = st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 5))


@settings(max_examples=200)
@given(
    shape=_shapes,
    seed=st.integers(0, 2**16),
    where=st.floats(0, 1),
    value=st.sampled_from([math.nan, math.inf, -math.inf]),
)
def test_a_non_finite_fused_value_never_passes(shape, seed, where, value):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(shape, generator=gen, dtype=torch.float64)
    unfused = ref.float()
    fused = unfused.clone().reshape(-1)
    fused[int(where * (fused.numel() - 1))] = value
    verdict = parity.compare(fused.reshape(shape), unfused, ref, dtype=F32)
    assert not verdict.passed


@settings(max_examples=200)
@given(shape=_shapes, seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_error_is_scale_invariant(shape, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(shape, generator=gen, dtype=torch.float64)
    out = ref + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    base = parity.relative_error(out, ref)
    assert parity.relative_error(out * scale, ref * scale) == pytest.approx(base, rel=1e-9)


@settings(max_examples=200)
@given(shape=_shapes, seed=st.integers(0, 2**16))
def test_rounding_to_float32_passes(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(shape, generator=gen, dtype=torch.float64)
    assert parity.compare(ref.float(), ref.float(), ref, dtype=F32).passed


def test_the_oracle_uses_fusions_numerics() -> None:
    """One error measure and one tolerance rule: the harness re-exports fusion.numerics."""
    from fusion import numerics

    for name in ("Verdict", "judge", "tolerance", "dtype_floor", "relative_error", "compare"):
        assert getattr(parity, name) is getattr(numerics, name), name

"""`NormVariant`: one frozen value for an RMSNorm variant, from the fuser to the operators."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

from fusion.kernels import ops
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.modules import FusedRMSNorm

GEMMA = NormVariant(offset=1.0, weight_after_cast=False)
F32 = frozenset({(torch.float32, torch.float32)})


def test_equal_spellings_are_one_hashable_value() -> None:
    assert NormVariant(1, 1, 0, 0) == GEMMA and hash(NormVariant(1, 1, 0, 0)) == hash(GEMMA)
    assert type(NormVariant(1).offset) is float and NormVariant() == DEFAULT_VARIANT
    with pytest.raises(dataclasses.FrozenInstanceError):
        GEMMA.offset = 0.0  # type: ignore[misc]


def test_describe() -> None:
    assert DEFAULT_VARIANT.describe() == "float32 statistics, weight after cast to input dtype"
    assert GEMMA.describe() == "float32 statistics, weight before cast, scale 1 + weight"
    assert NormVariant(upcast=False).describe(has_weight=False) == (
        "statistics in input dtype, weightless"
    )


@pytest.mark.parametrize("variant", [DEFAULT_VARIANT, GEMMA, NormVariant(0.5, False, True, True)])
def test_operator_arguments_rebuild_the_same_variant(variant: NormVariant) -> None:
    assert ops._variant_of(*ops._operator_args(variant)) == variant


def test_fused_norm_holds_its_variant_read_only() -> None:
    norm = FusedRMSNorm(nn.Parameter(torch.randn(8)), 1e-6, variant=GEMMA, verified=F32)
    assert norm.variant is GEMMA
    with pytest.raises(AttributeError):
        norm.variant = DEFAULT_VARIANT  # type: ignore[misc]


def test_fused_norm_pickled_with_separate_flags_unpickles_to_its_variant() -> None:
    """A `FusedRMSNorm` pickled when it held the four fields as attributes loads with the
    same variant (and so computes the same function)."""
    norm = FusedRMSNorm(nn.Parameter(torch.randn(8)), 1e-6, variant=GEMMA, verified=F32)
    state = {k: v for k, v in norm.__dict__.items() if k not in ("_variant", "_float32_aten")}
    state.update(dataclasses.asdict(GEMMA))
    old = FusedRMSNorm.__new__(FusedRMSNorm)
    old.__setstate__(state)
    x = torch.randn(3, 8)
    assert old.variant == GEMMA and torch.equal(old(x), norm(x))
    assert "offset" not in old.__dict__
    again = pickle.loads(pickle.dumps(old))
    assert again.variant == GEMMA and torch.equal(again(x), norm(x))

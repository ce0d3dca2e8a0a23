"""`NormVariant`: one frozen value for an RMSNorm variant, from the fuser to the operators."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

from fusion.kernels import ops
from fusion.kernels import reference as torch_ref
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.runtime.merged import FusedRMSNorm

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


DIV = NormVariant(root="div_sqrt")
RECIP = NormVariant(root="recip_sqrt")


def test_root_is_validated_and_described() -> None:
    with pytest.raises(ValueError, match="root 'sqrt'"):
        NormVariant(root="sqrt")
    assert DEFAULT_VARIANT.fast and not DIV.fast and not RECIP.fast
    assert DIV.describe().endswith(", x / sqrt(v)") and DIV != DEFAULT_VARIANT
    assert RECIP.describe().endswith(", x * (1 / sqrt(v))")


@pytest.mark.parametrize("variant", [DIV, RECIP])
def test_every_shortcut_declines_a_non_rsqrt_root(variant: NormVariant) -> None:
    """No `torch.rms_norm` call, no operator (its schema has no root), no backend kernel:
    `ops.rms_norm` and `ops.add_rms_norm` are `torch_ref`'s plain ops in that spelling,
    bit for bit, on every CPU backend."""

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=generator)  # x * (1 / s) is rarer off in float32
    b = torch.randn(512, 64, generator=generator)
    weight = 1 + 0.1 * torch.randn(64, generator=generator)
    assert torch_ref.aten_norm(x, weight, variant) is None
    assert torch_ref.aten_norm(x, weight, DEFAULT_VARIANT) is not None
    with pytest.raises(ValueError, match="rsqrt spelling only"):
        ops._operator_args(variant)
    h = x.float()
    v = h.pow(2).mean(-1, keepdim=True) + 1e-6
    n = h / torch.sqrt(v) if variant.root == "div_sqrt" else h * (1 / torch.sqrt(v))
    expected = weight * n
    if not torch.equal(torch.rsqrt(v), 1 / torch.sqrt(v)):
        # the spellings differ where this CPU flavour's rsqrt is not 1/sqrt rounded (AVX-512
        # ATen; under AVX2 ATen computes rsqrt as 1/sqrt, and only x/sqrt still differs)
        assert not torch.equal(expected, weight * (h * torch.rsqrt(v)))
    elif variant.root == "div_sqrt":
        assert not torch.equal(expected, weight * (h * torch.rsqrt(v)))
    for backend in ("auto", "torch", "native", "onednn"):
        try:
            ops.rms_norm(backend, x[:1], weight, 1e-6)
        except ValueError:
            continue  # not available on this machine
        assert torch.equal(ops.rms_norm(backend, x, weight, 1e-6, variant=variant), expected)
        total, norm = ops.add_rms_norm(backend, x - b, b, weight, 1e-6, variant=variant)
        assert torch.equal(norm, torch_ref.rms_norm(total, weight, 1e-6, variant=variant))

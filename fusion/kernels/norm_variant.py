"""`NormVariant`: which RMSNorm function a norm kernel computes, as one frozen value.

`reference.rms_norm` defines each field; the norm fuser proves one for a module
(`fusion.fusers.rmsnorm`), `FusedRMSNorm` holds it, and every norm kernel (`Kernels.rms_norm`,
`Kernels.add_rms_norm`, `fusion.kernels.ops`, the autograd formulas) takes it whole and
reads only the fields it needs. The four numeric fields are listed together in exactly two
places: here, and where the `torch.library` operators (whose schemas take only tensors and
scalars) unpack and rebuild it (`fusion.kernels.ops._operator_args` and `_variant_of`). The
fifth, `root`, says how the inverse root was spelled: only `rsqrt` has kernels and operators;
the other spellings run `reference.rms_norm`'s plain ops (`NormVariant.fast`), whose
rounding is the spelling's own.

Frozen, so it is hashable (a cache key), safe as a shared default argument, and a constant
to Dynamo: a compiled fused model guards on the module's variant once and never recompiles
for it. It imports nothing of the fusion package, so the kernel layer can use it without
importing a fuser.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOTS = ("rsqrt", "div_sqrt", "recip_sqrt")
"""How a norm applies the inverse root of its mean square `v` (with eps) to the value `h`,
each a different rounding (1-2 ulp apart on about a third of the elements):
`h * rsqrt(v)` (also `v ** -0.5` in float32/float64, where ATen computes it as `rsqrt`),
`h / sqrt(v)`, and `h * reciprocal(sqrt(v))` (also `h * (1 / sqrt(v))`: Python's `1 / t` is
`t.reciprocal() * 1`)."""

RSQRT = "rsqrt"
"""The spelling every fused kernel and `torch.rms_norm` compute."""


@dataclass(frozen=True)
class NormVariant:
    """One RMSNorm variant (the function, not the weight: a weightless norm ignores the two
    weight-order fields). The defaults are Llama's: statistics in float32, the weight applied
    after the cast back to the input's dtype, no offset."""

    offset: float = 0.0
    """Added to the weight before it scales (Gemma's `1 + weight`)."""
    upcast: bool = True
    """Statistics and normalisation in float32 (else in the input's dtype)."""
    weight_after_cast: bool = True
    """The weight multiplies the normalised value after its cast back (Llama, T5), else
    before it, in the promoted dtype (Gemma, OLMo2, `F.rms_norm`)."""
    cast_to_weight: bool = False
    """With `weight_after_cast`: the cast is to the weight's dtype (T5), not the input's."""
    root: str = RSQRT
    """How the inverse root is applied, one of `ROOTS`: the op sequence the module runs,
    kept so the fused norm rounds as it does. Only `rsqrt` has fast paths (`fast`)."""

    def __post_init__(self) -> None:
        # Normalised types, so equal variants are equal values (and hash alike) however a
        # caller spelled them (1 or 1.0, numpy bools).
        object.__setattr__(self, "offset", float(self.offset))
        object.__setattr__(self, "upcast", bool(self.upcast))
        object.__setattr__(self, "weight_after_cast", bool(self.weight_after_cast))
        object.__setattr__(self, "cast_to_weight", bool(self.cast_to_weight))
        if self.root not in ROOTS:
            raise ValueError(f"root {self.root!r}: expected one of {', '.join(ROOTS)}")

    def describe(self, has_weight: bool = True) -> str:
        """One line for reports: the statistics' dtype, the weight's order (or `weightless`
        where `has_weight` is False) and the offset."""
        if not has_weight:
            order = "weightless"
        elif self.weight_after_cast:
            order = "weight after cast to " + (
                "weight dtype" if self.cast_to_weight else "input dtype"
            )
        else:
            order = "weight before cast"
        offset = f", scale {self.offset:g} + weight" if self.offset else ""
        stats = "float32 statistics" if self.upcast else "statistics in input dtype"
        root = "" if self.root == RSQRT else f", {_ROOT_WORDS[self.root]}"
        return f"{stats}, {order}{offset}{root}"

    @property
    def fast(self) -> bool:
        """May a kernel other than `reference.rms_norm`'s plain ops (a backend's, an
        operator's, `torch.rms_norm`) compute this variant? Only for the `rsqrt` spelling,
        the one they all multiply by; every shortcut asks this first and declines
        otherwise, so the other spellings run `reference.rms_norm`'s plain ops."""
        return self.root == RSQRT


_ROOT_WORDS = {"div_sqrt": "x / sqrt(v)", "recip_sqrt": "x * (1 / sqrt(v))"}


DEFAULT_VARIANT = NormVariant()
"""Llama's variant: the default of every norm kernel's `variant` argument."""

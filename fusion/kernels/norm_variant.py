"""`NormVariant`: which RMSNorm function a norm kernel computes, as one frozen value.

`torch_ref.rms_norm` defines each field; the norm fuser proves one for a module
(`fusion.fusers.rmsnorm`), `FusedRMSNorm` holds it, and every norm kernel (`Kernels.rms_norm`,
`Kernels.add_rms_norm`, `fusion.kernels.ops`, the autograd formulas) takes it whole and
reads only the fields it needs. The four fields are listed together in exactly two places:
here, and where the `torch.library` operators (whose schemas take only tensors and scalars)
unpack and rebuild it (`fusion.kernels.ops._operator_args` and `_variant_of`).

Frozen, so it is hashable (a cache key), safe as a shared default argument, and a constant
to Dynamo: a compiled fused model guards on the module's variant once and never recompiles
for it. It imports nothing of the fusion package, so the kernel layer can use it without
importing a fuser.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        # Normalised types, so equal variants are equal values (and hash alike) however a
        # caller spelled them (1 or 1.0, numpy bools).
        object.__setattr__(self, "offset", float(self.offset))
        object.__setattr__(self, "upcast", bool(self.upcast))
        object.__setattr__(self, "weight_after_cast", bool(self.weight_after_cast))
        object.__setattr__(self, "cast_to_weight", bool(self.cast_to_weight))

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
        return f"{stats}, {order}{offset}"


DEFAULT_VARIANT = NormVariant()
"""Llama's variant: the default of every norm kernel's `variant` argument."""

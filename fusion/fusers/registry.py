"""Which fusers exist and in what priority; their matches per class (`fusion.fusers.matches`).

Adding a fuser: one file in `fusion/fusers/` and one entry in `FUSERS`.
"""

from __future__ import annotations

from torch import nn

from fusion.fusers import matches
from fusion.fusers.base import Fuser
from fusion.fusers.decode_linear import DecodeLinearFuser
from fusion.fusers.glu import GLUFuser
from fusion.fusers.matches import Candidate, cache_key
from fusion.fusers.mla import MLAFuser
from fusion.fusers.moe import MoEFuser
from fusion.fusers.qkv import QKVFuser
from fusion.fusers.residual_norm import ResidualNormFuser
from fusion.fusers.rmsnorm import RMSNormFuser
from fusion.fusers.sibling import SiblingFuser

__all__ = ["FUSERS", "Candidate", "cache_key", "candidates", "clear_cache"]

FUSERS: tuple[type[Fuser], ...] = (
    MLAFuser,
    GLUFuser,
    QKVFuser,
    SiblingFuser,
    RMSNormFuser,
    MoEFuser,
    ResidualNormFuser,
    DecodeLinearFuser,
)
"""Every fuser, highest priority first. Only the first one that validates for an instance
may redefine its forward; others that leave the forward alone may still apply.
`ResidualNormFuser` comes after the others: it rewrites decoder layers, which no other fuser
takes today, and should never cost a module another fuser's (larger) rewrite.
`DecodeLinearFuser` last: it only takes plain linears, which nothing else rewrites."""


def clear_cache() -> None:
    """Forget every cached match (tests and fuzzers that generate many classes use this)."""
    matches.CACHE.clear()


def candidates(
    module: nn.Module, fusers: tuple[type[Fuser], ...] = FUSERS
) -> tuple[Candidate, ...]:
    """Every fuser of `fusers` that matched `module`'s class (or refused it with a reason),
    in priority order; traced at most once per cache key (`fusion.fusers.matches.candidates`)."""
    return matches.candidates(module, fusers)

"""Which fusers exist, in what priority, and the per-class cache of their matches.

Adding a fuser: one file in `fusion/fusers/` and one entry in `FUSERS`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from fusion.callpath import has_hooks, own_call_path
from fusion.errors import RewriteRefused
from fusion.fusers.base import Fuser
from fusion.fusers.decode_linear import DecodeLinearFuser
from fusion.fusers.glu import GLUFuser
from fusion.fusers.mla import MLAFuser
from fusion.fusers.moe import MoEFuser
from fusion.fusers.qkv import QKVFuser
from fusion.fusers.residual_norm import ResidualNormFuser
from fusion.fusers.rmsnorm import RMSNormFuser
from fusion.fusers.sibling import SiblingFuser
from fusion.trace import trace

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Candidate:
    """One fuser's verdict on one module class: a ready fuser, or the reason it refused."""

    fuser_name: str
    fuser: Fuser | None
    reason: str | None
    redefines_forward: bool = True


CacheKey = tuple
_CACHE: dict[CacheKey, tuple[Candidate, ...]] = {}
"""Explicit cache: `cache_key(module)` -> the candidates for that class and child layout."""


def cache_key(module: nn.Module) -> CacheKey:
    """The class, and for each child its name, exact type, `inplace` flag, `max_norm`
    (`nn.Embedding` renormalises its own weight in place when set), whether it carries
    hooks, a call path of its own, or an instance-level `forward`.

    Matching reads the forward (per class) and asks of each child whether calling it can
    write its input or state (its type, `inplace=True`, `max_norm`, hooks, what runs instead
    of the class forward), so all of that is in the key: two instances share a cached
    verdict only if the analysis would say the same of both. Widths, biases, dtypes and
    devices vary per instance and are checked by `validate`.
    """
    return (
        type(module),
        tuple(
            (
                name,
                type(child),
                getattr(child, "inplace", None),
                getattr(child, "max_norm", None),
                has_hooks(child) is not None,
                own_call_path(child),
                "forward" in child.__dict__,
            )
            for name, child in module.named_children()
        ),
    )


def clear_cache() -> None:
    """Forget every cached match (tests and fuzzers that generate many classes use this)."""
    _CACHE.clear()


def candidates(
    module: nn.Module, fusers: tuple[type[Fuser], ...] = FUSERS
) -> tuple[Candidate, ...]:
    """Every fuser that matched `module`'s class (or refused it with a reason), in priority
    order; traced at most once per cache key."""
    key = (cache_key(module), fusers)
    if key in _CACHE:
        return _CACHE[key]
    interested = [cls for cls in fusers if cls.candidate(module)]
    result: list[Candidate] = []
    if interested:
        graph = trace(module)
        for cls in interested:
            try:
                fuser = cls.match(graph, module)
            except RewriteRefused as exc:
                result.append(Candidate(cls.name, None, str(exc), cls.redefines_forward))
                continue
            except Exception as exc:  # a matcher bug must not take the whole pass down
                logger.debug(
                    "%s.match raised on %s", cls.__name__, type(module).__name__, exc_info=True
                )
                result.append(
                    Candidate(
                        cls.name,
                        None,
                        f"matcher error: {type(exc).__name__}: {exc}",
                        cls.redefines_forward,
                    )
                )
                continue
            if fuser is not None:
                result.append(Candidate(cls.name, fuser, None, cls.redefines_forward))
    _CACHE[key] = tuple(result)
    return _CACHE[key]

"""The fuser registry: priority, cache keys, refusals recorded per class."""

from __future__ import annotations

from torch import nn

from fusion.fusers import registry
from fusion.fusers.glu import GLUFuser
from fusion.fusers.mla import MLAFuser
from fusion.fusers.qkv import QKVFuser
from fusion.fusers.sibling import SiblingFuser
from tests.fusion.fusers import hazards


def test_priority_order() -> None:
    assert registry.FUSERS[:4] == (MLAFuser, GLUFuser, QKVFuser, SiblingFuser)


def test_cache_key_includes_child_types() -> None:
    a, b = hazards.Attention(), hazards.Attention()
    assert registry.cache_key(a) == registry.cache_key(b)
    b.k_proj = hazards.LinearWithForward(32, 16)
    assert registry.cache_key(a) != registry.cache_key(b)


def test_candidates_cached_and_refusals_kept() -> None:
    registry.clear_cache()
    module = hazards.InplaceMethod()
    first = registry.candidates(module)
    assert registry.candidates(hazards.InplaceMethod()) is first
    qkv = next(c for c in first if c.fuser_name == "qkv")
    assert qkv.fuser is None and "may change" in (qkv.reason or "")


def test_modules_without_candidates_are_not_traced() -> None:
    registry.clear_cache()
    assert registry.candidates(nn.Dropout()) == ()


def test_cache_key_includes_what_a_child_may_write() -> None:
    """Two instances whose children differ only in `max_norm` (an Embedding renormalising
    its weight in place), an instance `forward` or a call path of its own must not share
    a verdict: the analysis says different things of them."""
    plain, normed = hazards.Attention(), hazards.Attention()
    plain.codebook = nn.Embedding(4, 32)
    normed.codebook = nn.Embedding(4, 32, max_norm=1.0)
    assert registry.cache_key(plain) != registry.cache_key(normed)
    plain, own_forward, own_call = (hazards.Attention() for _ in range(3))
    own_forward.k_proj.forward = lambda x: x
    own_call.k_proj._call_impl = lambda x: x
    assert registry.cache_key(plain) != registry.cache_key(own_forward)
    assert registry.cache_key(plain) != registry.cache_key(own_call)
    assert registry.cache_key(plain) == registry.cache_key(hazards.Attention())

"""`fusion.fusers.base`: the per-signature match cache derives each verdict once and replays
refusals."""

from __future__ import annotations

import pytest

from fusion.errors import RewriteRefused
from fusion.fusers.base import per_signature


def test_per_signature_derives_once_and_caches_refusals() -> None:
    cache: dict = {}
    calls = []
    found = object()  # a fuser's match (refusals are cached as their reason strings)

    def derive():
        calls.append(1)
        return found

    assert per_signature(cache, "a", derive, "absent") is found
    assert per_signature(cache, "a", derive, "absent") is found
    assert len(calls) == 1

    def refuse():
        raise RewriteRefused("no")

    for _ in range(2):
        with pytest.raises(RewriteRefused, match="differs from its class's match: no"):
            per_signature(cache, "b", refuse, "absent")
    with pytest.raises(RewriteRefused, match="not there"):
        per_signature(cache, "c", lambda: None, "not there")

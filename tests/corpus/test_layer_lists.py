"""corpus.layer_lists: the per-layer half of the tiny shrinker (which layers to keep so
every kind survives in order, and section lists rescaled to a new total)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from corpus.layer_lists import PerLayer, keep_layers, rescale_sections


def test_rescale_sections():
    assert sum(rescale_sections([16, 24, 24], 4)) == 4
    assert all(x >= 1 for x in rescale_sections([16, 24, 24], 4))


@given(st.lists(st.integers(1, 64), min_size=1, max_size=4), st.integers(1, 64))
def test_rescale_sections_sums_exactly(sections, total):
    out = rescale_sections(sections, total)
    assert sum(out) == total
    assert len(out) == len(sections) and all(x >= 0 for x in out)
    if total >= len(sections):
        assert all(x >= 1 for x in out)


_KINDS = st.sampled_from(["full_attention", "sliding_attention", "linear_attention", "conv"])


@given(st.lists(_KINDS, min_size=1, max_size=40), st.integers(2, 4))
def test_keep_layers_covers_every_kind_in_order(kinds, minimum):
    attr = PerLayer("layer_types", "list", kinds)
    kept = keep_layers([attr], len(kinds), min(minimum, len(kinds)))
    assert kept == sorted(set(kept))
    assert {kinds[i] for i in kept} == set(kinds)
    assert len(kept) >= min(minimum, len(kinds))
    # greedy coverage: never more layers than kinds, unless needed to reach the minimum
    assert len(kept) <= max(len(set(kinds)), minimum)

"""The shared forward inputs."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import corpus
from corpus.tiny import special_token_ids

pytest.importorskip("transformers")


def test_shape_padding_and_cache_flag():
    m = corpus.build("llama", seed=0)
    inp = corpus.make_inputs(m, seed=0)
    assert inp["input_ids"].shape == (2, 6)
    mask = inp["attention_mask"]
    assert mask[0].tolist() == [1] * 6
    assert mask[1].tolist() == [1, 1, 1, 1, 0, 0]  # right padding: no fully masked query row
    assert inp["use_cache"] is False


def test_padded_positions_hold_the_pad_token():
    cfg = corpus.tiny_config("gemma")
    inp = corpus.make_inputs(cfg, seed=0)
    assert cfg.pad_token_id is not None
    assert inp["input_ids"][1, -2:].tolist() == [cfg.pad_token_id] * 2
    assert cfg.pad_token_id not in inp["input_ids"][0].tolist()


def test_deterministic_and_seed_dependent():
    cfg = corpus.tiny_config("llama")
    a = corpus.make_inputs(cfg, seed=1)
    b = corpus.make_inputs(cfg, seed=1)
    c = corpus.make_inputs(cfg, seed=2)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    # a config alone gives the same kwargs as the model built from it
    assert a.keys() == corpus.make_inputs(corpus.build("llama"), seed=1).keys()


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5", "llama"])
def test_special_tokens_never_drawn(name):
    cfg = corpus.tiny_config(name)
    inp = corpus.make_inputs(cfg, seed=0, batch=8, seq=64)
    ids = inp["input_ids"]
    specials = special_token_ids(cfg)
    real = ids[inp["attention_mask"].bool()]  # padded positions may hold the pad token
    assert not (set(real.tolist()) & specials)
    assert int(ids.max()) < cfg.get_text_config().vocab_size


def test_codebook_rows_for_musicgen():
    cfg = corpus.tiny_config("musicgen")
    inp = corpus.make_inputs(cfg, seed=0)
    assert inp["input_ids"].shape == (2 * cfg.num_codebooks, 6)
    assert inp["attention_mask"].shape == (2, 6)


def test_extra_kwargs_merge():
    inp = corpus.make_inputs(
        corpus.tiny_config("llama"), seed=0, extra={"output_hidden_states": True}
    )
    assert inp["output_hidden_states"] is True


@functools.cache
def _llama():
    return corpus.tiny_config("llama")


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 5), seq=st.integers(1, 32), seed=st.integers(0, 2**31 - 1))
def test_inputs_shape_mask_and_range_properties(batch, seq, seed):
    cfg = _llama()
    inp = corpus.make_inputs(cfg, seed=seed, batch=batch, seq=seq)
    ids, mask = inp["input_ids"], inp["attention_mask"]
    assert ids.shape == mask.shape == (batch, seq)
    assert ids.dtype == mask.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size
    assert mask[0::2].all()  # even rows unpadded
    assert mask[:, 0].all()  # every row keeps at least its first token
    # right padding only: once a row is masked it stays masked
    assert torch.equal(mask, mask.cummin(dim=1).values)
    assert torch.equal(ids, corpus.make_inputs(cfg, seed=seed, batch=batch, seq=seq)["input_ids"])

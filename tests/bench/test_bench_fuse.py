"""Time `fusion.fuse` over a Qwen3-0.6B-shaped model (28 layers) built on the meta device.

Reported, never asserted (target: median under 25 ms on a 2-core CPU with the match cache
warm). The cold case clears the per-class cache each round, so it includes tracing and
source rewriting of each class once.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import fusion
from fusion.fusers import registry

QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def _meta_model():
    config = AutoConfig.for_model("qwen3", **QWEN3_06B)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_fuse_qwen3_06b_meta(benchmark, cache: str) -> None:
    def setup():
        if cache == "cold":
            registry.clear_cache()
        return (_meta_model(),), {}

    fusion.plan(_meta_model())  # warm the class cache once
    report = benchmark.pedantic(fusion.fuse, setup=setup, rounds=5, iterations=1)
    counts = report.counts()
    assert counts["qkv"] == 28 and counts["glu"] == 28

"""Unit and property tests of the generic shrinker (corpus/tiny.py), on real config classes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corpus.rules import SIZES
from corpus.tiny import config_fields, shrink_kwargs, special_token_ids

transformers = pytest.importorskip("transformers")


def _rebuild(config, **explicit):
    """Shrink a default config and rebuild it through its constructor (what the corpus does)."""
    # As corpus.builder does: the given kwargs, then the shrinker's output over them.
    return type(config)(**{**explicit, **shrink_kwargs(config, explicit=explicit)})


def _make(cls, **kwargs):
    """Build ``cls(**kwargs)`` and shrink it, telling the shrinker which values were given."""
    return _rebuild(cls(**kwargs), **kwargs)


def test_llama_is_tiny_and_consistent():
    cfg = _rebuild(transformers.LlamaConfig())
    assert cfg.hidden_size == SIZES.hidden
    assert cfg.num_hidden_layers == 2
    assert cfg.vocab_size == SIZES.vocab
    assert cfg.hidden_size % cfg.num_attention_heads == 0
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    # kv heads default to None (MHA) in Llama: filled so the tiny model exercises GQA.
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size


def test_gpt2_style_names():
    cfg = _rebuild(transformers.GPT2Config())
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head) == (64, 2, 4)
    assert cfg.n_positions <= SIZES.positions


def test_eps_and_numerics_untouched():
    for cls in (transformers.LlamaConfig, transformers.GPT2Config, transformers.Gemma2Config):
        default = cls()
        kw = shrink_kwargs(default)
        for name in kw:
            assert not any(t in name for t in ("eps", "epsilon", "softcap", "theta", "range"))
        tiny = cls(**kw)
        for name in config_fields(cls):
            if "eps" in name or "softcap" in name:
                assert getattr(tiny, name) == getattr(default, name), name


def test_mqa_and_mha_preserved():
    mqa = _make(transformers.FalconConfig, num_kv_heads=1, new_decoder_architecture=True)
    assert mqa.num_kv_heads == 1
    mha = _make(transformers.MistralConfig, num_key_value_heads=32, num_attention_heads=32)
    assert mha.num_key_value_heads == mha.num_attention_heads


def test_layer_types_keep_every_kind_and_order():
    default = transformers.Qwen3NextConfig()
    kinds = list(dict.fromkeys(default.layer_types))
    tiny = _rebuild(default)
    assert len(tiny.layer_types) == tiny.num_hidden_layers >= 2
    assert list(dict.fromkeys(tiny.layer_types)) == kinds


def test_moe_and_mla_sizes():
    default = transformers.DeepseekV3Config()
    tiny = _rebuild(default)
    assert tiny.n_routed_experts == SIZES.experts
    assert tiny.num_experts_per_tok <= tiny.n_routed_experts
    assert tiny.n_routed_experts % tiny.n_group == 0
    # group-limited routing picks the top-2 experts of each group: groups need >= 2 experts.
    assert tiny.n_routed_experts // tiny.n_group >= 2
    assert tiny.qk_head_dim == tiny.qk_nope_head_dim + tiny.qk_rope_head_dim
    assert tiny.num_key_value_heads == tiny.num_attention_heads  # MLA: K/V per query head
    assert tiny.first_k_dense_replace == 1 < tiny.num_hidden_layers  # a dense and a MoE layer


def test_ssm_heads_times_head_dim_matches_inner_width():
    tiny = _rebuild(transformers.Mamba2Config())
    assert tiny.num_heads * tiny.head_dim == tiny.expand * tiny.hidden_size
    assert tiny.hidden_size % tiny.n_groups == 0 or tiny.num_heads % tiny.n_groups == 0


def test_special_tokens_remapped_into_vocab():
    tiny = _make(transformers.Qwen2Config, bos_token_id=151643, eos_token_id=151645)
    assert tiny.bos_token_id < tiny.vocab_size and tiny.eos_token_id < tiny.vocab_size
    assert tiny.bos_token_id != tiny.eos_token_id
    assert special_token_ids(tiny) >= {tiny.bos_token_id, tiny.eos_token_id}


def test_shrink_never_mutates_the_default():
    default = transformers.LlamaConfig()
    before = default.to_dict()
    shrink_kwargs(default)
    assert default.to_dict() == before


# --- properties -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([8, 12, 16, 32, 40, 64]),
    kv_div=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 80, 128]),
    layers=st.integers(2, 48),
    pattern=st.lists(
        st.sampled_from(["full_attention", "sliding_attention"]), min_size=1, max_size=6
    ),
    eps=st.floats(1e-12, 1e-3),
)
def test_qwen2_shrink_invariants(heads, kv_div, head_dim, layers, pattern, eps):
    kv = max(1, heads // kv_div)
    layer_types = [pattern[i % len(pattern)] for i in range(layers)]
    tiny = _make(
        transformers.Qwen2Config,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        layer_types=layer_types,
        rms_norm_eps=eps,
        use_sliding_window=True,
    )
    assert tiny.num_hidden_layers >= 2
    assert tiny.hidden_size % tiny.num_attention_heads == 0
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    if kv == 1:
        assert tiny.num_key_value_heads == 1
    if kv == heads:
        assert tiny.num_key_value_heads == tiny.num_attention_heads
    assert set(tiny.layer_types) == set(layer_types)
    assert len(tiny.layer_types) == tiny.num_hidden_layers
    assert tiny.rms_norm_eps == eps
    assert tiny.hidden_size <= SIZES.hidden and tiny.vocab_size <= SIZES.vocab


@settings(max_examples=25, deadline=None)
@given(
    key_heads=st.sampled_from([4, 8, 16]),
    ratio=st.sampled_from([1, 2, 4]),
    interval=st.integers(2, 6),
    layers=st.integers(4, 48),
)
def test_linear_attention_hybrid_keeps_attention_and_ratio(key_heads, ratio, interval, layers):
    layer_types = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    if "full_attention" not in layer_types:
        layer_types[-1] = "full_attention"
    tiny = _make(
        transformers.Qwen3NextConfig,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * ratio,
        num_hidden_layers=layers,
        layer_types=layer_types,
    )
    assert set(tiny.layer_types) == {"full_attention", "linear_attention"}
    assert tiny.linear_num_value_heads % tiny.linear_num_key_heads == 0
    assert tiny.linear_num_value_heads // tiny.linear_num_key_heads == ratio
    assert tiny.num_hidden_layers >= 2

"""Deterministic builds, realistic weights, config round trips and BuildError messages."""

from __future__ import annotations

import json
import math

import pytest
import torch

import corpus
from corpus.weights import NORM_STD

pytest.importorskip("transformers")


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "jamba", "deepseek_v3", "gpt2"])
def test_same_seed_same_weights_different_seed_different(name):
    a = corpus.build(name, seed=0)
    b = corpus.build(name, seed=0)
    c = corpus.build(name, seed=1)
    assert _same_state(a, b)
    assert not _same_state(a, c)


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    corpus.build("llama", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_dtype_and_eval_mode():
    m = corpus.build("llama", seed=0, dtype=torch.bfloat16)
    assert not m.training
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    # bf16 weights are the float32 weights rounded: same draw, any dtype.
    f = corpus.build("llama", seed=0)
    w16 = m.model.layers[0].self_attn.q_proj.weight
    w32 = f.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w16, w32.to(torch.bfloat16))


def test_scale_norms_randomised_around_one():
    m = corpus.build("llama", seed=0)
    w = m.model.layers[0].input_layernorm.weight.detach()
    assert not torch.all(w == 1)
    assert abs(w.mean().item() - 1) < 0.1
    assert 0.3 * NORM_STD < w.std().item() < 3 * NORM_STD


def test_zero_centred_norms_randomised_around_zero():
    # Gemma's RMSNorm computes x * (1 + w) with w initialised to 0.
    m = corpus.build("gemma", seed=0)
    w = m.model.layers[0].input_layernorm.weight.detach()
    assert not torch.all(w == 0)
    assert abs(w.mean().item()) < 0.1
    assert 0.3 * NORM_STD < w.std().item() < 3 * NORM_STD


def test_layernorm_bias_and_zero_linear_bias_randomised():
    gpt2 = corpus.build("gpt2", seed=0)
    assert not torch.all(gpt2.transformer.h[0].ln_1.bias == 0)
    qwen = corpus.build("qwen2", seed=0)  # q/k/v projections carry biases initialised to 0
    assert not torch.all(qwen.model.layers[0].self_attn.q_proj.bias == 0)


def test_other_parameters_keep_the_model_init():
    # Only norms and zero biases are redrawn: Llama's linear weights keep N(0, init_range).
    m = corpus.build("llama", seed=0)
    std = m.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - m.config.initializer_range) < 0.005


@pytest.mark.parametrize("name", ["llama", "mllama", "gemma3", "dots3_note_text", "jamba"])
def test_config_json_round_trip_is_bit_identical(name):
    cfg = corpus.tiny_config(name)
    d = json.loads(json.dumps(cfg.to_dict()))  # what a repro bundle stores
    again = corpus.config_from_dict(d["model_type"], d)
    a = corpus.build_from_config(cfg, seed=3)
    b = corpus.build_from_config(again, seed=3)
    assert type(a) is type(b)
    assert _same_state(a, b)


def test_build_equals_build_from_tiny_config():
    assert _same_state(
        corpus.build("qwen3", seed=5), corpus.build_from_config(corpus.tiny_config("qwen3"), seed=5)
    )


def test_tiny_config_is_a_fresh_object():
    a = corpus.tiny_config("llama")
    a.hidden_size = 999
    assert corpus.tiny_config("llama").hidden_size != 999


def test_build_error_names_unknown_architecture():
    with pytest.raises(corpus.BuildError, match="not-a-model") as info:
        corpus.build("not-a-model")
    assert info.value.arch == "not-a-model"


def test_build_error_names_architecture_and_cause(monkeypatch):
    import corpus.builder as builder

    def boom(*args, **kwargs):
        raise RuntimeError("synthetic construction failure")

    monkeypatch.setattr(builder, "deterministic_construction", boom)
    with pytest.raises(corpus.BuildError) as info:
        corpus.build("llama")
    msg = str(info.value)
    assert "'llama'" in msg and "synthetic construction failure" in msg
    assert info.value.stage == "model"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_known_broken_reason_is_quoted():
    broken = [n for n in corpus.all_types() if corpus.entry(n).status == "broken"]
    if not broken:
        pytest.skip("no broken architecture in this Transformers version")
    name = broken[0]
    try:
        corpus.check(name)
    except corpus.BuildError as exc:
        assert name in str(exc) and corpus.entry(name).reason in str(exc)
    else:
        pytest.fail(f"{name} is recorded as broken but built and ran")


def test_check_returns_finite_logits():
    out = corpus.check("llama", seed=0)
    assert torch.isfinite(out.logits).all()


def test_config_from_dict_restores_transformers_special_float_tags():
    # Transformers' JSON writes inf/nan as {"__float__": "Infinity"}; a bundle may hold them.
    d = corpus.tiny_config("llama").to_dict()
    d["custom"] = [{"__float__": "Infinity"}, {"__float__": "NaN"}, {"__float__": "not a tag"}]
    d["other"] = {"low": {"__float__": "-Infinity"}}
    again = corpus.config_from_dict(d["model_type"], d)
    assert again.custom[0] == math.inf
    assert math.isnan(again.custom[1])
    assert again.other == {"low": -math.inf}
    assert again.custom[2] == {"__float__": "not a tag"}

"""The catalog enumerates the installed Transformers' causal LMs, nothing hand-listed."""

from __future__ import annotations

import pytest

import corpus

transformers = pytest.importorskip("transformers")
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402


def test_all_types_is_the_mapping():
    assert set(corpus.all_types()) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_architectures_are_the_non_broken_types():
    archs = corpus.architectures()
    assert set(archs) <= set(corpus.all_types())
    for name in corpus.all_types():
        assert (name in archs) == (corpus.entry(name).status == "ok")


def test_entry_fields():
    e = corpus.entry("llama")
    assert e.name == "llama"
    assert e.config_class is transformers.LlamaConfig
    assert e.model_class_name == "LlamaForCausalLM"
    assert e.status == "ok" and e.reason is None


def test_broken_entries_carry_a_reason():
    for name in corpus.all_types():
        e = corpus.entry(name)
        if e.status != "ok":
            assert e.reason and len(e.reason) > 10, name


def test_unknown_entry_raises_keyerror():
    with pytest.raises(KeyError):
        corpus.entry("definitely-not-a-model")


def test_arch_for_config_resolves_text_sub_configs():
    # MllamaForCausalLM takes the text sub-config, whose model_type is not a causal-LM key.
    cfg = corpus.tiny_config("mllama")
    assert cfg.model_type != "mllama"
    assert corpus.arch_for_config(cfg) == "mllama"

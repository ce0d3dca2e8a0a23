"""harness.base.architectures: selection by name or glob, test plugins, unbuildable reasons."""

from __future__ import annotations

import pytest
import torch

from harness.base import architectures

PLUGIN = "tests.harness.plugin_archs"
NAMES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


def test_no_pattern_selects_everything_in_order():
    assert architectures.select([], NAMES) == NAMES


def test_globs_and_names_select_in_corpus_order_without_duplicates():
    assert architectures.select(["qwen3*", "llama", "qwen3"], NAMES) == [
        "llama",
        "qwen3",
        "qwen3_moe",
    ]


def test_an_unmatched_pattern_is_an_error_with_suggestions():
    with pytest.raises(architectures.UnknownArchitecture, match="did you mean llama"):
        architectures.select(["lama"], NAMES)


def test_plugins_come_from_the_environment_only_when_set():
    assert architectures.plugins_from_env({}) == ()
    env = {architectures.PLUGINS_ENV: f" {PLUGIN} , other.mod"}
    assert architectures.plugins_from_env(env) == (PLUGIN, "other.mod")


def test_plugin_architectures_are_not_in_the_corpus_by_default():
    assert "harness-test-abort" not in architectures.available()
    with_plugin = architectures.available((PLUGIN,))
    assert "harness-test-abort" in with_plugin
    assert with_plugin[: len(architectures.available())] == architectures.available()


def test_a_bad_plugin_is_a_clear_error():
    with pytest.raises(architectures.PluginError, match="cannot be imported"):
        architectures.plugin_architectures(["tests.harness.no_such_module"])
    with pytest.raises(architectures.PluginError, match="HARNESS_ARCHITECTURES"):
        architectures.plugin_architectures(["tests.harness.fakes"])


def test_build_dispatches_to_the_plugin_then_the_corpus():
    with pytest.raises(ValueError, match="never builds"):
        architectures.build(
            "harness-test-unbuildable", seed=0, dtype=torch.float32, device="cpu", plugins=(PLUGIN,)
        )
    model = architectures.build(
        "llama", seed=0, dtype=torch.float32, device="cpu", plugins=(PLUGIN,)
    )
    assert type(model).__name__ == "LlamaForCausalLM"


def test_unbuildable_architectures_have_reasons():
    for name, reason in architectures.unbuildable().items():
        assert reason.strip(), name

"""harness.suites.hf_tests.tester: the generic model tester gives the common mixins what a
hand-written Transformers model tester does, from the corpus's tiny configs."""

from __future__ import annotations

import io
import unittest

import torch
from transformers import LlamaForCausalLM, LlamaModel, Qwen3MoeForCausalLM

from harness.suites.hf_tests import tester


def test_tester_reads_the_tiny_config():
    model_tester = tester.CorpusModelTester("llama")
    config, inputs = model_tester.prepare_config_and_inputs_for_common()
    assert config is not model_tester.get_config()  # fresh each call: tests mutate theirs
    assert config.to_dict() == model_tester.get_config().to_dict()
    assert model_tester.hidden_size == config.hidden_size
    assert model_tester.num_hidden_layers == config.num_hidden_layers
    assert model_tester.num_attention_heads == config.num_attention_heads
    assert model_tester.vocab_size == config.vocab_size
    assert set(inputs) == {"input_ids", "attention_mask"}
    assert inputs["input_ids"].shape == (model_tester.batch_size, model_tester.seq_length)
    assert int(inputs["input_ids"].max()) < config.vocab_size
    assert inputs["attention_mask"].sum() < inputs["attention_mask"].numel()  # some padding
    again = tester.CorpusModelTester("llama").prepare_config_and_inputs_for_common()[1]
    assert torch.equal(again["input_ids"], inputs["input_ids"])  # seeded: same in both runs
    assert model_tester.all_model_classes == (LlamaModel, LlamaForCausalLM)


def test_moe_tester_classes():
    model_tester = tester.CorpusModelTester("qwen3_moe")
    assert model_tester.causal_lm_class is Qwen3MoeForCausalLM
    assert model_tester.base_model_class.__name__ == "Qwen3MoeModel"


def test_case_name_is_an_identifier():
    assert tester.test_case_name("qwen3_moe") == "HFQwen3MoeMixinTest"
    assert tester.test_case_name("gpt-sw3").isidentifier()


class _Checks:
    """A mixin shaped like Transformers' (tests reading self.model_tester)."""

    def test_builds_every_class(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(config).eval()
            with torch.no_grad():
                model(**inputs)
        self.assertEqual(len(self.all_model_classes), 2)


def test_make_test_case_runs_a_mixin():
    case = tester.make_test_case("llama", (_Checks,), module="somewhere")
    assert case.__name__ == "HFLlamaMixinTest" and case.__module__ == "somewhere"
    assert issubclass(case, unittest.TestCase) and case.test_torch_exportable is False
    result = unittest.TextTestRunner(stream=io.StringIO()).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(case)
    )
    assert result.testsRun == 1 and result.wasSuccessful(), result.errors + result.failures

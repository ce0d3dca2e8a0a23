"""A generic model tester: Transformers' common test mixins driven by the corpus's tiny configs.

Transformers' per-model test files pair `ModelTesterMixin` with a hand-written model tester
(`CausalLMModelTester`: a tiny config, inputs, the model classes). Neither ships in the sdist,
so `CorpusModelTester` plays that part for any corpus architecture: its config is
`corpus.tiny_config(arch)` (the generic shrinker plus the reviewed per-architecture
overrides), its inputs `corpus.make_inputs` (seeded ids avoiding special tokens, one padded
row in two), its classes the architecture's base model and causal LM. `make_test_case` builds
the `unittest.TestCase` pytest collects: the mixins' tests run unchanged on it.
"""

from __future__ import annotations

import unittest
from dataclasses import dataclass, field
from typing import Any

import corpus
from corpus.catalog import model_class


def base_model_class(config: Any) -> type | None:
    """The architecture's base model class (`LlamaModel` for a LlamaConfig), or None when
    Transformers registers none for this config class."""
    from transformers import MODEL_MAPPING

    try:
        return MODEL_MAPPING[type(config)]
    except KeyError:
        return None


@dataclass
class CorpusModelTester:
    """The `model_tester` the mixins read: a tiny config, common inputs, the model classes.

    Every call of `get_config` returns a fresh config (tests mutate theirs); inputs are
    seeded, so a test sees the same ids in the unfused and the fused run."""

    arch: str
    parent: unittest.TestCase | None = None
    batch_size: int = 3
    seq_length: int = 7
    is_training: bool = True
    seed: int = 0
    config: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.config = corpus.tiny_config(self.arch)

    def get_config(self) -> Any:
        """A fresh copy of the architecture's tiny config."""
        return corpus.tiny_config(self.arch)

    def _text(self) -> Any:
        """The text config (the config itself for a text-only architecture)."""
        return self.config.get_text_config()

    @property
    def vocab_size(self) -> int:
        """The text config's vocabulary size."""
        return int(self._text().vocab_size)

    @property
    def hidden_size(self) -> int:
        """The text config's hidden size."""
        return int(self._text().hidden_size)

    @property
    def num_hidden_layers(self) -> int:
        """The text config's layer count."""
        return int(self._text().num_hidden_layers)

    @property
    def num_attention_heads(self) -> int:
        """The text config's attention head count."""
        return int(self._text().num_attention_heads)

    @property
    def causal_lm_class(self) -> type:
        """The architecture's causal-LM class (the corpus's)."""
        return model_class(self.arch)

    @property
    def base_model_class(self) -> type | None:
        """The base model class, None when Transformers registers none."""
        return base_model_class(self.config)

    @property
    def all_model_classes(self) -> tuple[type, ...]:
        """Base model (when registered) and causal LM: the classes the mixins iterate."""
        return tuple(c for c in (self.base_model_class, self.causal_lm_class) if c is not None)

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, Any]]:
        """(fresh config, {"input_ids", "attention_mask"}) as the mixins expect them."""
        inputs = corpus.make_inputs(
            self.config, seed=self.seed, batch=self.batch_size, seq=self.seq_length
        )
        return self.get_config(), {
            "input_ids": inputs["input_ids"],
            "attention_mask": inputs["attention_mask"],
        }


def test_case_name(arch: str) -> str:
    """`HF<Arch>MixinTest` for an architecture name (non-identifier characters dropped)."""
    camel = "".join(part.capitalize() for part in arch.replace("-", "_").split("_") if part)
    return f"HF{camel}MixinTest"


def make_test_case(
    arch: str, mixins: tuple[type, ...], module: str = __name__
) -> type[unittest.TestCase]:
    """A `unittest.TestCase` running `mixins` (e.g. ModelTesterMixin) on architecture `arch`.

    Returns the class; its `__module__` is `module`, so pytest names its tests after the
    module that collects them. Export tests are off: their mixin is not in the sdist."""
    tester = CorpusModelTester(arch)

    def set_up(self: unittest.TestCase) -> None:
        self.model_tester = CorpusModelTester(arch, parent=self)

    attrs: dict[str, Any] = {
        # a class attribute, so `setUp` may set it: the tensor-parallel mixin declares it an
        # abstract property
        "model_tester": None,
        "all_model_classes": tester.all_model_classes,
        "test_torch_exportable": False,
        "setUp": set_up,
        "__module__": module,
        "__doc__": f"Transformers' common model tests on the corpus's tiny {arch}.",
    }
    return type(test_case_name(arch), (*mixins, unittest.TestCase), attrs)

"""corpus: every causal-LM architecture of the installed Transformers, as tiny random models.

Public API::

    corpus.architectures()            # buildable architecture names (installed Transformers)
    corpus.all_types()                # every causal-LM model type, buildable or not
    corpus.entry(name)                # Entry(name, config_class, model_class_name, status,
                                      #       reason, noncausal)
    corpus.arch_for_config(config)    # the architecture a (tiny) config belongs to
    corpus.tiny_config(name)          # the tiny config the model is built from
    corpus.build(name, *, seed, dtype, device)
    corpus.build_from_config(config, *, seed, dtype, device, name=None)
    corpus.config_from_dict(model_type, d)   # inverse of config.to_dict()
    corpus.make_inputs(model_or_config, *, seed, batch=2, seq=6, device)
    corpus.check(name, *, seed, dtype, device)   # build + one forward, BuildError on failure
    corpus.BuildError
"""

from corpus.builder import (
    build,
    build_from_config,
    check,
    config_from_dict,
    tiny_config,
)
from corpus.catalog import Entry, all_types, arch_for_config, architectures, entry
from corpus.errors import BuildError
from corpus.inputs import make_inputs

__all__ = [
    "BuildError",
    "Entry",
    "all_types",
    "arch_for_config",
    "architectures",
    "build",
    "build_from_config",
    "check",
    "config_from_dict",
    "entry",
    "make_inputs",
    "tiny_config",
]

"""Test plugin: replaces fusion.fuse with one that breaks llama's first MLP (see fakes.py).

For subprocess tests (a sweep that must find a failure, a repro.py that must reproduce it):
importing this module is what the harness does with every name in FUSION_HARNESS_TEST_PLUGINS.
Models without `model.layers.0.mlp` are fused normally.
"""

from __future__ import annotations

import fusion
from tests.harness.fakes import faulty_fuse

_real_fuse = fusion.fuse
_break = faulty_fuse("model.layers.0.mlp")


def _fuse(model, backend: str = "auto"):
    try:
        model.get_submodule("model.layers.0.mlp")
    except AttributeError:
        return _real_fuse(model, backend)
    return _break(model)


fusion.fuse = _fuse
HARNESS_ARCHITECTURES: dict = {}

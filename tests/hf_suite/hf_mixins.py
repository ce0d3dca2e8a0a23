"""Transformers' common model tests (ModelTesterMixin, GenerationTesterMixin where shipped,
and TensorParallelTesterMixin, from the 5.x sdist) on corpus architectures: one TestCase per
architecture of $FUSION_HF_SUITE_ARCHS (comma-separated). Of the tensor-parallel mixin, the
single-process tests run (the plans cover the embeddings and shard every expert); its
multi-process ones are skipped as Transformers skips them without RUN_TENSOR_PARALLEL_TESTS.

Not collected by a plain `pytest` run (the name is not test_*.py): it needs the network once
(the sdist) and minutes per architecture. Run it by name, plain or under the fusion plugin:

    python -m pytest tests/hf_suite/hf_mixins.py
    python -m pytest -p harness.pytest_fusion --fusion tests/hf_suite/hf_mixins.py
"""

from __future__ import annotations

import os

from harness.suites.hf_tests import sdist, tester

_tests = sdist.ensure_tests(sdist.installed_version())
_common = sdist.import_common(_tests)
_parallel = sdist.import_mixin(_tests, "test_tensor_parallel_mixin", "TensorParallelTesterMixin")
_mixins = (_common.ModelTesterMixin, _common.GenerationTesterMixin)
if _parallel is not None:
    _mixins = (*_mixins, _parallel)

for _arch in [
    a.strip() for a in os.environ.get("FUSION_HF_SUITE_ARCHS", "llama").split(",") if a.strip()
]:
    _case = tester.make_test_case(_arch, _mixins, module=__name__)
    globals()[_case.__name__] = _case
del _case

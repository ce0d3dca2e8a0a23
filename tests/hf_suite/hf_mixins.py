"""Transformers' common model tests (ModelTesterMixin, from the 5.x sdist) on corpus
architectures: one TestCase per architecture of $FUSION_HF_SUITE_ARCHS (comma-separated).

Not collected by a plain `pytest` run (the name is not test_*.py): it needs the network once
(the sdist) and minutes per architecture. Run it by name, plain or under the fusion plugin:

    python -m pytest tests/hf_suite/hf_mixins.py
    python -m pytest -p harness.pytest_fusion --fusion tests/hf_suite/hf_mixins.py
"""

from __future__ import annotations

import os

from harness.hf_tests import sdist, tester

_common = sdist.import_common(sdist.ensure_tests(sdist.installed_version()))

for _arch in [
    a.strip() for a in os.environ.get("FUSION_HF_SUITE_ARCHS", "llama").split(",") if a.strip()
]:
    _case = tester.make_test_case(
        _arch, (_common.ModelTesterMixin, _common.GenerationTesterMixin), module=__name__
    )
    globals()[_case.__name__] = _case
del _case

"""CI's run of Transformers' common model tests under the fusion plugin: for a selection of
corpus architectures (one whose fused model holds every fuser family;
$FUSION_HF_SUITE_CI_ARCHS overrides it, e.g. `llama,qwen3_moe`), every test that passes
unfused passes fused, except the listed exceptions (harness/suites/hf_tests/exceptions.py). Needs
the network once (the Transformers sdist, cached). `tox -e hf-suite` runs five architectures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.suites.hf_tests import compare, tester

CI_ARCHS = ("dots1",)
"""dots.llm1: one tiny model fusing every family the test asserts, as llama and qwen3_moe
(the selection before) did between them: q/k/v with q/k norms (qkv, rmsnorm), MoE blocks
(routed experts: moe) whose shared experts are a GLU MLP (glu), residual add + RMSNorm.
Its router is DeepSeek-V3's (sigmoid, grouped top-k), not qwen3_moe's softmax. About 2 min
on a shared 2-core AMD EPYC (AVX2), where llama + qwen3_moe took 4.4."""


def _archs() -> list[str]:
    given = os.environ.get("FUSION_HF_SUITE_CI_ARCHS", "")
    return [a.strip() for a in given.split(",") if a.strip()] or list(CI_ARCHS)


def _outcomes(path: Path) -> dict[str, dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return {json.loads(line)["test"]: json.loads(line) for line in lines}


@pytest.mark.slow
def test_common_tests_pass_fused_wherever_they_pass_unfused(tmp_path: Path) -> None:
    archs = _archs()
    runs = {}
    for fused in (False, True):
        path = tmp_path / f"{'fused' if fused else 'base'}.jsonl"
        done = compare.run_suite(archs, path, fused, ["-n", "2"])
        assert path.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
        runs[fused] = _outcomes(path)
    result = compare.compare(runs[False], runs[True])
    print(compare.report(result))
    for arch in archs:
        passed = result.passed_unfused[tester.test_case_name(arch)]
        assert passed >= 60, (arch, result.passed_unfused)
    applied = [r for o in runs[True].values() for r in o["fusions"] if r["applied"]]
    assert {fuser for r in applied for fuser in r["applied"]} >= {"qkv", "glu", "rmsnorm", "moe"}
    assert result.unexpected == 0, compare.report(result)

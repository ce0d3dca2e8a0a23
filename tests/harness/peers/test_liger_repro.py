"""harness.peers.liger_repro: a liger failure's bundle carries a replay that needs torch,
transformers and liger-kernel only: its files import nothing of this package, its weights are
the corpus's exact ones, and (with liger-kernel) it reproduces a finding in a process where
fusion, harness and corpus cannot be imported."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import corpus
from harness.base.results import Failure
from harness.peers import liger_repro
from harness.runner import arch_check, repro

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
OURS = {"fusion", "harness", "corpus"}


def _subject(architecture: str = "llama") -> arch_check.Subject:
    model = corpus.build(architecture, seed=0, dtype=torch.float32, device="cpu")
    config = json.loads(model.config.to_json_string(use_diff=False))
    options = arch_check.CheckOptions(system="liger")
    return arch_check.Subject(architecture, model.config.model_type, config, options)


WARNING = (
    "only the fused model warns: FutureWarning: `past_key_values` is deprecated and will be "
    "removed in version 5.40.0 for `LlamaModel.forward`. Use `cache` instead."
)


def _failure(message: str = WARNING, kind: str = "fused-warning") -> Failure:
    return Failure(kind, None, None, None, message, signature=f"{kind}|{message[:40]}")


def _imported(path) -> set[str]:
    """Top-level package names `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_a_liger_bundle_holds_a_replay_that_imports_nothing_of_ours(tmp_path):
    subject = _subject()
    bundle = repro.write_bundle(tmp_path, _failure(), subject)
    names = {p.name for p in bundle.iterdir()}
    assert {"bundle.json", "repro.py", liger_repro.SCRIPT, liger_repro.SHIMS} <= names
    assert {"weights.safetensors", "inputs.json"} <= names
    script, shims = bundle / liger_repro.SCRIPT, bundle / liger_repro.SHIMS
    assert not _imported(script) & OURS
    assert not _imported(shims) & OURS
    assert "liger_kernel" in _imported(script)
    compile(script.read_text(), str(script), "exec")  # the template filled in is Python
    model = corpus.build("llama", seed=0, dtype=torch.float32, device="cpu")
    saved = load_file(str(bundle / "weights.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(saved[k], state[k]) for k in saved)  # exact weights
    inputs = json.loads((bundle / "inputs.json").read_text())
    assert inputs["input_ids"]["values"] == corpus.make_inputs(model, seed=0)["input_ids"].tolist()


def test_a_bundle_of_another_system_has_no_standalone_replay(tmp_path):
    subject = _subject()
    fusion_subject = arch_check.Subject(
        subject.architecture, subject.model_type, subject.config, arch_check.CheckOptions()
    )
    bundle = repro.write_bundle(tmp_path, _failure(), fusion_subject)
    assert not (bundle / liger_repro.SCRIPT).exists()


@pytest.mark.skipif(
    not HAS_LIGER, reason="liger-kernel is not installed (pip install liger-kernel==0.8.5)"
)
def test_the_standalone_replay_reproduces_without_this_package(tmp_path):
    bundle = repro.write_bundle(tmp_path, _failure(), _subject())
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in sorted(OURS))
    code = (
        f"import runpy, sys; {blocked}; sys.argv = [{str(bundle / liger_repro.SCRIPT)!r}]; "
        f"runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "past_key_values` is deprecated" in done.stdout
